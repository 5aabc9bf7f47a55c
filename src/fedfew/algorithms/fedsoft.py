"""FedSoft (Ruan and Joe-Wong, 2022, "FedSoft: Soft Clustered Federated Learning with Proximal
Local Updating", AAAI).

The server keeps K cluster centres c_1..c_K; a client's data is a mixture of the clusters'
distributions, with importance weights u_ik (rows sum to 1). Each participating client:

1. estimates u_i (every ``estimate_every`` rounds, and the first time it takes part; otherwise
   it reuses the saved u_i): n_ik = number of its train samples whose loss is lowest under
   centre k (eval mode, ties to the lowest k), u_ik = n_ik / n_i, floored at ``sigma`` so no
   weight is 0, then renormalised to sum 1 (:func:`importance_weights`);
2. trains its personal model w_i (kept on the host; the first time it starts at the proximal
   centre sum_k u_ik c_k) for E local epochs on the proximal objective

       h_i(w) = F_i(w) + (lam / 2) * sum_k u_ik ||w - c_k||^2,
       grad   = grad F_i(w) + lam * sum_k u_ik (w - c_k) = grad F_i(w) + lam * (w - sum_k u_ik c_k)

   (with sum_k u_ik = 1 the K proximal terms are one term towards the u-weighted centre,
   :func:`proximal_centre`, which is what is computed);
3. sends w_i and u_i; the server sets every centre to the importance- and size-weighted mean
   of the participants' personal models,

       c_k <- sum_i u_ik n_i w_i / sum_i u_ik n_i.

The paper's per-cluster client sampling (clients drawn for centre k with probabilities
proportional to u_ik n_i) is not simulated: participants follow ``participation``, and every
participant contributes to every centre with its weight u_ik n_i (the paper's aggregation
over all clients). The centres are initialised independently (``init: independent``): with
identical centres every sample's argmin is centre 0.

Evaluation: the paper reports both the centres (on test sets of the underlying cluster
distributions, which our partitions do not have) and the clients' local models. We score each
client with its personal model w_i (``score: personal``, the personalised number; a client that
never took part gets the centre 0); ``score: centres`` instead lets each client pick the centre
with the lowest loss on its selection split (the protocol FedFew and IFCA are scored with).

BatchNorm: models are state vectors (:func:`fedfew.core.model_set.flat_state`): a personal model keeps
its own running statistics, the centres' statistics are averaged with the weights u_ik n_i, a new
personal model starts from the u-weighted mix of the centres' statistics, and the proximal
term acts on the parameters only.

Logged: ``w`` = u (P x K, in the slot FedFew uses for its client-model weights), ``assignment``
= argmax_k u_ik, ``weight_per_model`` = sum_i u_ik n_i.

Config (``conf/algorithm/fedsoft.yaml``): ``K`` (centres), ``lam`` (proximal coefficient),
``sigma`` (importance floor, in (0, 1/K]; default 1e-4), ``estimate_every`` (the
paper's tau), ``score`` (personal | centres), ``init`` (independent | identical).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import nn

from fedfew.algorithms import ALGORITHMS
from fedfew.algorithms._averaging import Averaging
from fedfew.algorithms._client_training import loss_row, proximal_term
from fedfew.algorithms.round_log import Kind
from fedfew.data.base import ClientSplit, FederatedData
from fedfew.algorithms.base import Hint
from fedfew.core.model_set import assign_state_, flat_state, state_numel, unflatten_like


@torch.no_grad()
def per_sample_losses(models: list[nn.Module], data: FederatedData, index: torch.Tensor,
                      batch_size: int = 1024) -> torch.Tensor:
    """(n, K) eval-mode cross-entropy of every sample of ``index`` under every model (float32)."""
    columns = []
    for model in models:
        was_training = model.training
        model.eval()
        parts = []
        for start in range(0, index.numel(), batch_size):
            x, y = data.batch(index[start : start + batch_size])
            parts.append(F.cross_entropy(model(x).float(), y, reduction="none"))
        model.train(was_training)
        columns.append(torch.cat(parts) if parts else torch.zeros(0, device=index.device))
    return torch.stack(columns, dim=1)


def importance_weights(losses: torch.Tensor, sigma: float) -> torch.Tensor:
    """FedSoft's importance weights from per-sample losses.

    Args:
        losses: (n, K) loss of each sample under each centre (NaN counts as +inf).
        sigma: floor in (0, 1/K].
    Returns:
        (K,) float64: u_k = max(n_k / n, sigma) / sum_j max(n_j / n, sigma), with n_k the number
        of samples whose lowest loss is under centre k (ties to the lowest k). Sums to 1;
        uniform for n = 0.
    Raises:
        ValueError: sigma outside (0, 1/K].
    """
    n, K = losses.shape
    if not 0.0 < sigma <= 1.0 / K:
        raise ValueError(f"algorithm.sigma={sigma} must be in (0, 1/K] = (0, {1.0 / K:g}]")
    if n == 0:
        return torch.full((K,), 1.0 / K, dtype=torch.float64)
    best = torch.nan_to_num(losses.double(), nan=float("inf")).argmin(dim=1)
    counts = torch.bincount(best.cpu(), minlength=K).double()
    u = (counts / n).clamp_min(sigma)
    return u / u.sum()


def proximal_centre(u: torch.Tensor, centres: list[torch.Tensor]) -> torch.Tensor:
    """sum_k u_k c_k ((d,)): the minimiser of sum_k u_k ||w - c_k||^2 when sum_k u_k = 1."""
    out = torch.zeros_like(centres[0])
    for weight, centre in zip(u.tolist(), centres):
        out.add_(centre, alpha=float(weight))
    return out


@ALGORITHMS.register("fedsoft")
class FedSoft(Averaging):
    """K centres; personal models with a u-weighted proximal term; importance-weighted averaging."""

    key_rules = {"K": "integer >= 1",
                 "lam": "number >= 0",
                 "sigma": "number > 0 (importance floor; <= 1/K)",
                 "estimate_every": "integer >= 1",
                 "score": "personal | centres",
                 "init": "independent | identical"}

    watch_collapse = True
    collapse_keys = (Hint("algorithm.init", "independent"), Hint("algorithm.K", change="a smaller"))

    row_shapes = {"loss": lambda K: (1,), "importance": lambda K: (K,)}
    #: w: the participants' importance weights u_ik; assignment: argmax_k u_ik
    log_keys = {**Averaging.log_keys, "loss": Kind.PER_CLIENT, "w": Kind.PER_CLIENT_MODEL, "assignment": Kind.PER_CLIENT}

    def __init__(self, cfg: DictConfig, ctx) -> None:
        super().__init__(cfg, ctx)
        K = ctx.module.K
        self.lam = float(cfg.lam)
        self.sigma = float(cfg.sigma)
        if self.sigma > 1.0 / K:  # the one bound key_rules cannot state: it depends on K
            raise ValueError(f"algorithm.sigma={cfg.sigma!r} > 1/algorithm.K = {1.0 / K:g}: the importance floor "
                             "must be <= 1/K")
        self.estimate_every = int(cfg.estimate_every)
        self.score = str(cfg.get("score", "personal"))

    @staticmethod
    def num_models(cfg: DictConfig) -> int:
        return int(cfg.K)

    @classmethod
    def communication(cls, cfg: DictConfig, model: nn.Module) -> tuple[int, int]:
        D = state_numel(model)
        return D + cls.num_models(cfg), cls.num_models(cfg) * D  # up: w_i and u_i; down: all K centres

    def importance(self, client: ClientSplit, rnd: int) -> torch.Tensor:
        """u_i: estimated this round (every ``estimate_every`` rounds, or when none is saved) or
        the saved one; saved on the host."""
        saved = self.ctx.host_state.get(int(client.id), {}).get("importance")
        if saved is not None and (rnd - 1) % self.estimate_every != 0:
            return saved.double()
        losses = per_sample_losses(list(self.ctx.module.models), self.ctx.data, self.ctx.train_index[client.id])
        u = importance_weights(losses, self.sigma)
        self.save_client(client.id, importance=u)
        return u

    def client_update(self, client: ClientSplit, rnd: int) -> dict[str, torch.Tensor]:
        ctx = self.ctx
        working = ctx.module.working
        u = self.importance(client, rnd)
        centre = proximal_centre(u, self.broadcast)
        if not self.load_personal(client, "personal"):
            assign_state_(working, centre)  # first participation: start at the proximal centre
        # the proximal term on the parameters (unflatten_like reads the first d entries of the state)
        penalty = proximal_term(unflatten_like(centre, working), self.lam) if self.lam > 0 else None
        loss = self.local_train(client, rnd, None, penalty=penalty, stream="personal")
        w = flat_state(working)
        if ctx.finite_or_reported(client.id, w, "local model"):
            self.save_client(client.id, personal=w)
            n = float(ctx.num_train[client.id])
            for k, weight in enumerate(u.tolist()):
                self.weighted_sum.add(k, weight * n, w - self.broadcast[k])
        return {"loss": loss_row(loss), "importance": u.to(torch.float64)}

    def end_round(self, rnd: int, participants: list[int], rows: dict[str, torch.Tensor]) -> dict[str, Any]:
        logs = super().end_round(rnd, participants, rows)  # c_k <- sum_i u_ik n_i w_i / sum_i u_ik n_i
        u = rows["importance"].cpu()
        logs.update(w=u, assignment=u.argmax(dim=1))
        return logs

    def model_assignment(self, client: ClientSplit, chosen: int) -> int:
        """``score: centres``: the centre picked; ``personal``: the centre with the largest
        importance weight u_ik (centre 0 for a client that never took part)."""
        if self.score == "centres":
            return int(chosen)
        u = self.ctx.host_state.get(int(client.id), {}).get("importance")
        return 0 if u is None else int(torch.as_tensor(u).argmax())

    def candidates(self, client: ClientSplit) -> list[nn.Module]:
        if self.score == "centres":
            return list(self.ctx.module.models)
        self.load_personal(client, "personal")
        return [self.ctx.module.working]
