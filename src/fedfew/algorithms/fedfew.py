"""FedFew: K shared models for M clients, trained with the STCH-Set scalarization.

Source: "Few-for-Many Personalized Federated Learning" (CVPR 2026) and its reference code
pgg3/FedFew (on PFLlib). Each round every participating client trains each of the K server
models for E local epochs from the broadcast weights and returns its losses L_ik and deltas
d_ik = theta_ik(local) - theta_k; the server sets

    theta_k += eta_s * sum_i alpha_i * w_ik * d_ik

with alpha, w the STCH-Set weights of the loss matrix (:func:`fedfew.scalarization.stch_set`).
The sum is streamed in log space (:class:`fedfew.aggregation.LogWeightedSum`), so no rank keeps
more than K deltas at a time.

Config (``conf/algorithm/fedfew.yaml``): ``K`` (3), ``mu`` (0.01), ``init``
(independent | identical), ``loss_source`` (running: mean minibatch loss of the last local
epoch, the reference's | pre: eval-mode loss of the broadcast model on the train split),
``sample_weighting`` (samples: L_ik * n_i / sum_j n_j, the reference's | none: the paper's
text), ``server_lr`` (eta_s = 1, as the reference), ``normalize`` (false: no renormalisation, the
reference's | true: divide model k's step by sum_i alpha_i w_ik, so each model moves by the
weighted mean of its deltas, FedAvg-sized steps instead of ~1/K of one).
"""
from __future__ import annotations

import warnings
from typing import Any

import torch

from fedfew.aggregation import LogWeightedSum
from fedfew.algorithms import ALGORITHMS
from fedfew.algorithms.base import Algorithm, Context
from fedfew.data.base import ClientSplit
from fedfew.local import evaluate_model, train_local
from fedfew.module import assign_flat_, flat_parameters
from fedfew.scalarization import SAMPLE_WEIGHTINGS, client_log_weights, stch_set
from fedfew.seeding import derive_seed

LOSS_SOURCES = ("running", "pre")


def exclude_nonfinite_client(client_id: int, rnd: int, losses: torch.Tensor, fatal: bool) -> None:
    """Warn that a client's loss or update is not finite (it is left out of this round), or
    raise when ``fail_on_nonfinite`` is set.

    Raises:
        FloatingPointError: with ``fatal``.
    """
    message = (f"round {rnd}: client {client_id} has a non-finite loss or update (losses {losses.tolist()}); "
               "it is excluded from this round's aggregation")
    if fatal:
        raise FloatingPointError(message + " (fail_on_nonfinite=true)")
    warnings.warn(message)


@ALGORITHMS.register("fedfew")
class FedFew(Algorithm):
    """FedFew with STCH-Set weights (see module docstring)."""

    row_shapes = {"loss": lambda K: (K,)}

    def __init__(self, cfg, ctx: Context) -> None:
        super().__init__(cfg, ctx)
        if cfg.loss_source not in LOSS_SOURCES:
            raise ValueError(f"algorithm.loss_source={cfg.loss_source!r}; allowed: {', '.join(LOSS_SOURCES)}")
        if cfg.sample_weighting not in SAMPLE_WEIGHTINGS:
            raise ValueError(
                f"algorithm.sample_weighting={cfg.sample_weighting!r}; allowed: {', '.join(SAMPLE_WEIGHTINGS)}"
            )
        self.mu = float(cfg.mu)
        self._accumulator: LogWeightedSum | None = None
        self._participant_total = 1.0

    @staticmethod
    def num_models(cfg) -> int:
        return int(cfg.K)

    def begin_round(self, rnd: int, participants: list[int]) -> None:
        module = self.ctx.module
        dim = sum(p.numel() for p in module.working.parameters())
        self._accumulator = LogWeightedSum(module.K, dim, device=self.ctx.fabric.device)
        self._participant_total = float(self.ctx.num_train[participants].sum())
        # flat server parameters, computed once per round rather than once per client
        self._server_flat = [flat_parameters(m) for m in module.models]

    def client_update(self, client: ClientSplit, rnd: int) -> dict[str, torch.Tensor]:
        ctx, module, run = self.ctx, self.ctx.module, self.ctx.cfg
        index = ctx.train_index[client.id]
        losses = torch.zeros(module.K, dtype=torch.float64)
        deltas = []
        for k in range(module.K):
            module.load_working(k)
            if self.cfg.loss_source == "pre":
                losses[k] = evaluate_model(module.working, ctx.data, index)[0]
            running = train_local(
                module, ctx.data, index, run.local_epochs, run.dataset.batch_size,
                seed=derive_seed(run.seed, "local", rnd, client.id, k), autocast=ctx.autocast,
            )
            if self.cfg.loss_source == "running":
                losses[k] = running
            deltas.append(flat_parameters(module.working) - self._server_flat[k])
        if not (bool(torch.isfinite(losses).all()) and all(bool(torch.isfinite(d).all()) for d in deltas)):
            exclude_nonfinite_client(client.id, rnd, losses, run.get("fail_on_nonfinite", False))
            return {"loss": torch.full_like(losses, float("nan"))}
        log_w = client_log_weights(losses * self._loss_scale(client.id), self.mu)
        for k in range(module.K):
            self._accumulator.add(k, float(log_w[k]), deltas[k])
        return {"loss": losses}

    def _loss_scale(self, client_id: int) -> float:
        """p_i = n_i / sum_j n_j over this round's participants (``samples``), else 1."""
        if self.cfg.sample_weighting != "samples":
            return 1.0
        return float(self.ctx.num_train[client_id]) / self._participant_total

    def end_round(self, rnd: int, participants: list[int], rows: dict[str, torch.Tensor]) -> dict[str, Any]:
        losses = rows["loss"].double().cpu()
        K = self.ctx.module.K
        valid = torch.isfinite(losses).all(dim=1)  # clients excluded for non-finite results
        accumulator = self._accumulator.all_reduce_()
        alpha = torch.zeros(len(participants), dtype=torch.float64)
        w = torch.zeros(len(participants), K, dtype=torch.float64)
        logs: dict[str, Any] = {"loss": losses, "excluded": [participants[j] for j in torch.nonzero(~valid).flatten().tolist()]}
        if not bool(valid.any()):
            warnings.warn(f"round {rnd}: every participating client was excluded; the models keep their parameters")
            self._accumulator, self._server_flat = None, []
            return {**logs, "g": float("nan"), "alpha": alpha, "w": w, "assignment": torch.zeros(len(participants), dtype=torch.long),
                    "effective_step": torch.zeros(K, dtype=torch.float64)}
        # the same scaled losses L'_ik = p_i L_ik as the clients used for their log weights
        scale = torch.tensor([self._loss_scale(c) for c in participants], dtype=torch.float64)
        weights = stch_set((losses * scale[:, None])[valid], self.mu)
        alpha[valid], w[valid] = weights.alpha, weights.w
        update = accumulator.result(float(weights.g) / self.mu)
        weight = alpha[:, None] * w
        step = torch.ones(K, dtype=torch.float64)
        if self.cfg.get("normalize", False):
            # each model moves by the weighted *mean* of its deltas (FedAvg-sized steps)
            total = weight.sum(dim=0)
            step = torch.where(total > 0, 1.0 / total, torch.zeros_like(total))
        eta = float(self.cfg.server_lr)
        for k, model in enumerate(self.ctx.module.models):
            new = self._server_flat[k] + (eta * float(step[k])) * update[k]
            if not bool(torch.isfinite(new).all()):  # never let NaN/inf reach a server model
                warnings.warn(f"round {rnd}: the update of model {k} is not finite; model {k} keeps its parameters")
                continue
            assign_flat_(model, new)
        self._accumulator, self._server_flat = None, []
        return {**logs, "g": float(weights.g), "alpha": alpha, "w": w,
                "assignment": w.argmax(dim=1), "effective_step": weight.sum(dim=0)}
