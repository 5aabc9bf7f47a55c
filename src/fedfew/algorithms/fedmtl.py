"""FedMTL: federated multi-task learning with MOCHA's task-relationship regulariser (Smith,
Chiang, Sanjabi and Talwalkar, 2017, "Federated Multi-Task Learning", NeurIPS), in the variant
used as the "FedMTL" baseline of personalised-FL libraries: per-client models trained by local
SGD with the regulariser's gradient, on any (non-convex) model.

Variant, explicitly. MOCHA's problem is

    min_{W, Omega} sum_i F_i(w_i) + R(W, Omega),   R = lam1 * tr(W Omega W^T) + lam2 * ||W||_F^2,

with W = [w_1 .. w_M] (d x M), solved for convex linear models through the dual and with Omega
learned. We implement:

- Omega fixed to the mean-regularised task relationship Omega = I - (1/M) 11^T (Evgeniou and
  Pontil's; it is idempotent, so it equals the (I - (1/M) 11^T)^2 found in PFLlib-style code as
  a matrix product), over all M clients, no Omega update; then tr(W Omega W^T) =
  sum_i ||w_i - w_bar||^2 with w_bar the mean of the M personal models;
- R(W) = (lam / 2) * tr(W Omega W^T) (lam2 = 0; ``optim.weight_decay`` plays lam2's role);
- primal local SGD: client i runs E local epochs on

      F_i(w_i) + (lam / 2) * tr(W Omega W^T)   (the other columns fixed at their latest values)

  whose gradient in w_i is lam * sum_j Omega_ij w_j = lam * ((1 - 1/M) w_i - (1/M) sum_{j != i} w_j)
  (:func:`regulariser_gradient` for any Omega), i.e. a proximal term
  lam * (1 - 1/M) / 2 * ||w_i - m_{-i}||^2 towards the mean m_{-i} of the other clients' models;
- the server keeps w_bar (server model 0, in float64 internally): each participant sends the
  change of its personal model, w_bar <- w_bar + (1/M) sum_i (w_i^new - w_i^old), so w_bar is
  always the mean of every client's latest model (clients that never took part count with the
  initial model w^0, their column of W).

lam = 0 is local training; a large lam pulls every personal model to the common mean. Clients
are scored with their personal model (a client that never took part with w_bar). Personal
models live on the host (``personal``).

BatchNorm: w_i and w_bar are state vectors (:func:`fedfew.core.model_set.flat_state`): a personal model
keeps its own running statistics, w_bar's are the mean of every client's latest statistics (the
same 1/M weights), and the regulariser acts on the parameters only.

Config (``conf/algorithm/fedmtl.yaml``): ``lam`` (>= 0).
"""
from __future__ import annotations

from typing import Any

import torch
from omegaconf import DictConfig
from torch import nn

from fedfew.algorithms import ALGORITHMS
from fedfew.algorithms._averaging import WeightedSum
from fedfew.algorithms._client_training import ClientTraining, loss_row, proximal_term
from fedfew.algorithms.round_log import Kind
from fedfew.data.base import ClientSplit
from fedfew.core.model_set import assign_state_, flat_state, unflatten_like


def centering_omega(M: int) -> torch.Tensor:
    """(M, M) float64 Omega = I - (1/M) 11^T (symmetric, idempotent, Omega 1 = 0)."""
    if M < 1:
        raise ValueError(f"M={M} must be >= 1")
    return torch.eye(M, dtype=torch.float64) - torch.full((M, M), 1.0 / M, dtype=torch.float64)


def regulariser(W: torch.Tensor, omega: torch.Tensor, lam: float) -> torch.Tensor:
    """(lam / 2) * tr(W Omega W^T) for W (d, M) and Omega (M, M)."""
    return 0.5 * lam * torch.trace(W @ omega @ W.T)


def regulariser_gradient(W: torch.Tensor, omega: torch.Tensor, lam: float) -> torch.Tensor:
    """(d, M) gradient of :func:`regulariser` for a symmetric Omega: column i is
    lam * sum_j Omega_ij w_j."""
    return lam * (W @ omega)


@ALGORITHMS.register("fedmtl")
class FedMTL(ClientTraining):
    """Personal models with the mean-regularised MTL term; the server keeps their mean."""

    key_rules = {"lam": "number >= 0"}

    row_shapes = {"loss": lambda K: (1,)}
    #: clients_moved: the participants whose (finite) personal model moved the server's mean this round
    log_keys = {"loss": Kind.PER_CLIENT, "clients_moved": Kind.SCALAR}

    def __init__(self, cfg: DictConfig, ctx) -> None:
        super().__init__(cfg, ctx)
        self.lam = float(cfg.lam)
        self.M = len(ctx.num_train)
        # w^0 (the column of a client that never took part) and the float64 mean of all columns
        self._initial = flat_state(ctx.module.models[0]).double()
        self._mean = self._initial.clone()

    def begin_round(self, rnd: int, participants: list[int]) -> None:
        self._sum = WeightedSum(1, self._mean.numel(), device=self.ctx.fabric.device)

    def personal(self, client_id: int) -> torch.Tensor:
        """w_i (float64, on the device): the saved one, or w^0 for a client that never took part."""
        saved = self.load_client(client_id, "personal")
        device = self.ctx.fabric.device
        return self._initial.to(device) if saved is None else saved.double()

    def client_update(self, client: ClientSplit, rnd: int) -> dict[str, torch.Tensor]:
        module, M = self.ctx.module, self.M
        working = module.working
        module.load_working(0)  # buffers
        w_old = self.personal(client.id)
        assign_state_(working, w_old)  # copy_ casts to the parameters' dtype
        penalty = None
        if self.lam > 0 and M > 1:
            others = (self._mean.to(w_old.device) * M - w_old) / (M - 1)  # m_{-i} (parameters first)
            penalty = proximal_term(unflatten_like(others, working), self.lam * (1.0 - 1.0 / M))
        loss = self.local_train(client, rnd, None, penalty=penalty, stream=0)
        w_new = flat_state(working)
        if self.ctx.finite_or_reported(client.id, w_new, "local model"):
            self.save_client(client.id, personal=w_new)
            self._sum.add(0, 1.0, w_new.double() - w_old)
        return {"loss": loss_row(loss)}

    def end_round(self, rnd: int, participants: list[int], rows: dict[str, torch.Tensor]) -> dict[str, Any]:
        self._sum.all_reduce_()
        self._mean = self._mean.to(self._sum.acc.device) + self._sum.acc[0] / self.M
        server = self.ctx.module.models[0]
        assign_state_(server, self._mean.to(next(server.parameters()).dtype))
        moved = float(self._sum.total[0])
        self._sum = None
        return {"loss": rows["loss"], "clients_moved": moved}

    def candidates(self, client: ClientSplit) -> list[nn.Module]:
        module = self.ctx.module
        module.load_working(0)
        saved = self.load_client(client.id, "personal")
        if saved is not None:
            assign_state_(module.working, saved)
        return [module.working]

    def state_dict(self) -> dict[str, Any]:
        return {"mean": self._mean.cpu().clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._mean = torch.as_tensor(state["mean"], dtype=torch.float64).clone()
