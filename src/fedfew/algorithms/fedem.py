"""FedEM (Marfoq, Neglia, Bellet, Kameni and Vidal, 2021, "Federated Multi-Task Learning under a
Mixture of Distributions", NeurIPS; reference code omarfoq/FedEM).

Every client's data distribution is a mixture of K shared components, p_i(y | x) =
sum_k pi_ik p_k(y | x; theta_k). The server keeps the K component models theta_1..theta_K;
client i keeps its mixture weights pi_i (K,) on the host (initialised uniform, 1/K). In a round,
each participating client, from the broadcast theta:

1. E-step, on its train split: for every train sample s the responsibilities

       q_sk = pi_ik p_k(y_s | x_s) / sum_j pi_ij p_j(y_s | x_s),   p_k(y_s | x_s) = exp(-l_sk)

   with l_sk the cross-entropy of sample s under component k, computed in log space
   (log q_sk = log pi_ik - l_sk - logsumexp_j(log pi_ij - l_sj), :func:`responsibilities`), then
   pi_ik <- mean_s q_sk. The losses are computed in **eval mode** (dropout off, BatchNorm running
   statistics), as the reference's ``Learner.gather_losses`` does (on ``val_iterator``, which is
   the client's train split, unshuffled);
2. M-step: each component k is trained from theta_k for E local epochs of the run's local
   optimizer on the responsibility-weighted cross-entropy, per minibatch B

       loss_k = (1 / |B|) sum_{s in B} q_sk l_sk

   (the reference's ``(loss_vec.T @ weights[indices]) / loss_vec.size(0)``: divided by the batch
   size, not by sum_s q_sk, so a component with a small pi_ik takes a proportionally small step:
   about 1/K of a client step while pi is uniform, which the tuned lr makes up for in part);
3. sends the K trained models; the server sets each theta_k to the n_i-weighted mean of the
   participants' copies (:class:`~fedfew.algorithms._averaging.Averaging`). The weights are n_i
   only, not n_i * pi_ik: the reference averages every component with ``clients_weights`` =
   n_i / sum_j n_j, whatever pi.

A client is scored with its mixture sum_k pi_ik softmax(f_k(x)) (:class:`Mixture`, the
reference's ``LearnersEnsemble.evaluate_iterator``; a client that never took part: uniform pi).
Its model assignment (``models_served``, ``assignment_ari``) is argmax_k pi_ik. With K = 1, q = 1
and FedEM is FedAvg: the same initial model, the same local streams (component k draws the
shuffling stream ``derive_seed(seed, "local", round, client, k)``, FedAvg's for k = 0), the same
steps and the same average (tests/test_fedem.py).

Departures from the reference:

- participation: the reference averages over *all* clients, the absent ones contributing the
  model they were last synchronised to (the previous theta_k), which shrinks the server step by
  the participating share of the samples; here, as for every averaging method of the project,
  theta_k moves to the n_i-weighted mean over the round's participants (the same under full
  participation, the default);
- the E-step's sample losses are computed once per round before training (as the reference's
  ``step``); the reference's per-learner optimizers and learning-rate schedulers are the
  project's (a fresh ``module.make_optimizer`` optimizer per local training, ``optim.*``,
  clipping included);
- a sample with a non-finite loss under component k has likelihood 0 under it (a diverged
  component takes no responsibility); a sample with no finite likelihood under any component
  keeps the prior, q_s = pi_i. A pi_ik that reaches 0 stays 0 (as in the reference);
- ``eval.protocol=finetune``: the scored mixture is fine-tuned as one model on its own negative
  log-likelihood, pi_i fixed. Its gradient for theta_k is sum_s q_sk grad l_sk with the
  responsibilities of the current parameters (train mode), i.e. the reference's local tuning
  (``tune_locally``: each component trained on the q-weighted loss) with q refreshed at each step.

BatchNorm: components are state vectors; a component's running statistics are averaged with the
same n_i weights as its parameters; the E-step uses them (eval mode).

Logged every round: ``loss`` (P x K; the eval-mode mean loss of each component on the client's
train split, the E-step's), ``w`` (P x K; the new pi_i, in the slot FedFew uses for its
client-model weights), ``assignment`` (argmax_k pi_ik), ``nll`` (P; the mixture's negative
log-likelihood per sample before the round, -mean_s log sum_k pi_ik p_k(y_s | x_s), the quantity
EM decreases), ``effective_step`` (K; sum_i n_i pi_ik / sum_i n_i, the share of the
participants' samples component k is trained on: about the fraction of a client step it takes)
and ``weight_per_model``.

Config (``conf/algorithm/fedem.yaml``): ``K`` (components, default 3 like FedFew's K, or the
number of groups on ``partition=clustered``), ``init`` (independent, the reference's: each
component from its own seed | identical).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import nn

from fedfew.algorithms import ALGORITHMS
from fedfew.algorithms._averaging import Averaging
from fedfew.algorithms._client_training import loss_row
from fedfew.algorithms.fedsoft import per_sample_losses
from fedfew.algorithms.round_log import Kind
from fedfew.data.base import ClientSplit
from fedfew.core.local_training import train_local
from fedfew.core.seeding import derive_seed


def responsibilities(log_pi: torch.Tensor, losses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FedEM's E-step for one client, in log space (float64).

    Args:
        log_pi: (K,) log mixture weights log pi_k (-inf for a weight of 0).
        losses: (n, K) loss l_sk = -log p_k(y_s | x_s) of each sample under each component; NaN
            or +inf: likelihood 0.
    Returns:
        q: (n, K) responsibilities, rows summing to 1 (a row with no finite likelihood: pi);
        pi: (K,) the new mixture weights, mean_s q_s (the old pi for n = 0);
        nll: () the mixture's negative log-likelihood per sample under the *old* pi,
            -mean_s logsumexp_k(log pi_k - l_sk) (+inf when some sample has no finite likelihood;
            nan for n = 0).
    """
    log_pi = log_pi.double().reshape(-1)
    inf = float("inf")
    joint = log_pi - torch.nan_to_num(losses.double(), nan=inf, posinf=inf)  # (n, K): log pi_k p_k(y_s | x_s)
    log_evidence = torch.logsumexp(joint, dim=1, keepdim=True)                 # (n, 1): log sum_k pi_k p_k
    known = torch.isfinite(log_evidence)
    q = torch.where(known, (joint - torch.where(known, log_evidence, 0.0)).exp(), log_pi.exp())
    if q.shape[0] == 0:
        return q, log_pi.exp(), torch.tensor(float("nan"), dtype=torch.float64)
    return q, q.mean(dim=0), -log_evidence.mean()


class Mixture(nn.Module):
    """A client's FedEM predictor: log sum_k pi_k softmax(f_k(x)).

    The output (B, C) holds log-probabilities of the mixture (they sum to 1 in probability), so
    ``cross_entropy`` on it is the mixture's negative log-likelihood and its argmax is the
    mixture's prediction. Computed in float32 as logsumexp_k(log pi_k + log_softmax(f_k(x))): no
    underflow of small probabilities, and with K = 1 it is log_softmax(f_1(x)) exactly.

    Args:
        models: the K component models (the server models themselves, not copies).
        pi: (K,) mixture weights (summing to 1).
    """

    def __init__(self, models: list[nn.Module], pi: torch.Tensor) -> None:
        super().__init__()
        self.components = nn.ModuleList(models)
        device = next(models[0].parameters()).device
        self.register_buffer("log_pi", torch.as_tensor(pi, dtype=torch.float64).log().float().to(device))
        # evaluation restores a candidate's mode after scoring it: keep the components' own
        self.training = models[0].training

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        log_probs = torch.stack([F.log_softmax(m(x).float(), dim=-1) for m in self.components])  # (K, B, C)
        weighted = log_probs + self.log_pi[:, None, None]
        # a component with pi_k = 0 takes no part, even one whose outputs are NaN (a diverged
        # component the E-step gave no responsibility): NaN + -inf would make every class NaN
        absent = torch.isneginf(self.log_pi)[:, None, None]
        return torch.logsumexp(torch.where(absent, float("-inf"), weighted), dim=0)


@ALGORITHMS.register("fedem")
class FedEM(Averaging):
    """K shared components, per-client mixture weights pi_i (``pi`` on the host); EM rounds."""

    key_rules = {"K": "integer >= 1 (mixture components)",
                 "init": "independent | identical"}

    watch_collapse = True
    collapse_hint = ("Keys that help: a smaller algorithm.K, algorithm.init=independent (identical components take "
                     "equal responsibilities). The component that fits best early takes the responsibilities, and a "
                     "component's step shrinks with them (its loss is q-weighted): docs/algorithms.md")

    row_shapes = {"loss": lambda K: (K,), "pi": lambda K: (K,), "nll": lambda K: (1,)}
    #: w: the participants' mixture weights pi_ik; assignment: argmax_k pi_ik; nll: each one's negative
    #: log-likelihood; effective_step: the n_i-weighted mean of pi_ik per component
    log_keys = {**Averaging.log_keys, "w": Kind.PER_CLIENT_MODEL, "assignment": Kind.PER_CLIENT,
                "nll": Kind.PER_CLIENT, "effective_step": Kind.PER_MODEL}

    @staticmethod
    def num_models(cfg: DictConfig) -> int:
        return int(cfg.K)

    def client_pi(self, client_id: int) -> torch.Tensor:
        """pi_i (K,) float64 on the host: the saved one, or uniform for a client that never took part."""
        saved = self.ctx.host_state.get(int(client_id), {}).get("pi")
        K = self.ctx.module.K
        return torch.full((K,), 1.0 / K, dtype=torch.float64) if saved is None else saved.double().cpu()

    def client_update(self, client: ClientSplit, rnd: int) -> dict[str, torch.Tensor]:
        ctx, run, module = self.ctx, self.ctx.cfg, self.ctx.module
        index = ctx.train_index[client.id]
        # E-step (eval mode, the broadcast components, the client's pi)
        losses = per_sample_losses(list(module.models), ctx.data, index)  # (n, K)
        q, pi, nll = responsibilities(self.client_pi(client.id).log().to(losses.device), losses)
        self.save_client(client.id, pi=pi)
        # M-step: each component from theta_k on its q-weighted loss, then sent for averaging
        weight = torch.zeros(ctx.data.targets.shape[0], dtype=torch.float32, device=index.device)
        for k in range(module.K):
            weight[index] = q[:, k].to(weight.dtype)
            module.load_working(k)
            train_local(module, ctx.data, index, int(run.local_epochs), int(run.dataset.batch_size),
                        seed=derive_seed(run.seed, "local", rnd, client.id, k), autocast=ctx.autocast, sample_weight=weight)
            self.contribute(k, client)
        return {"loss": loss_row(losses.double().mean(dim=0)), "pi": loss_row(pi), "nll": loss_row(nll)}

    def end_round(self, rnd: int, participants: list[int], rows: dict[str, torch.Tensor]) -> dict[str, Any]:
        logs = super().end_round(rnd, participants, rows)
        pi = rows["pi"].cpu()
        n = self.ctx.num_train[participants].double()
        logs.update(w=pi, assignment=pi.argmax(dim=1), nll=rows["nll"][:, 0].cpu(),
                    effective_step=(n[:, None] * pi).sum(dim=0) / n.sum().clamp_min(1.0))
        return logs

    def candidates(self, client: ClientSplit) -> list[nn.Module]:
        """The client's mixture sum_k pi_ik softmax(f_k) over the current components."""
        return [Mixture(list(self.ctx.module.models), self.client_pi(client.id))]

    def model_assignment(self, client: ClientSplit, chosen: int) -> int:
        """argmax_k pi_ik (component 0 for a client that never took part: uniform pi)."""
        return int(self.client_pi(client.id).argmax())
