"""FedFew: K shared models for M clients, trained with the STCH-Set scalarization.

Source: "Few-for-Many Personalized Federated Learning" (CVPR 2026) and its reference code
pgg3/FedFew (on PFLlib). Each round every participating client trains each of the K server
models for E local epochs from the broadcast weights and returns its losses L_ik and deltas
d_ik = theta_ik(local) - theta_k; the server sets

    theta_k += eta_s * sum_i alpha_i * w_ik * d_ik

with alpha, w the STCH-Set weights of the loss matrix (:func:`fedfew.stch.scalarization.stch_set`).
The sum is streamed in log space (:class:`fedfew.core.aggregation.LogWeightedSum`), so no rank keeps
more than K deltas at a time.

Config (``conf/algorithm/fedfew.yaml``): ``K`` (3; the number of known groups on
``partition=clustered``), ``mu`` (temperature of the soft selections, in nats of loss, see
``mu_scale``), ``mu_scale`` (relative: client-size weights n_i / mean n, so mu means the same for
any M | reference: p_i = n_i / sum n, the reference's, mu then shrinks like 1/M),
``init`` (independent | identical), ``loss_source`` (running: mean minibatch loss of the last
local epoch, the reference's | pre: eval-mode loss of the broadcast model on the train split),
``sample_weighting`` (samples: L_ik weighted by client size, the reference's | none: the
paper's text), ``server_lr`` (eta_s = 1, as the reference), ``normalize`` (true, our default:
divide model k's step by sum_i alpha_i w_ik, so each model moves by the weighted *mean* of its
deltas | false: the reference's rule). ``K=auto`` (with ``K_max``, ``K_min``, ``auto_patience``)
starts with K_max models and retires redundant ones (:mod:`fedfew.stch.auto_k`); ``mu_schedule``
(constant | cosine, exponential: from ``mu`` to ``mu_end`` | spread: alpha spreads over
``mu_clients`` of the clients | loss: ``mu_ratio`` x the mean best loss) sets mu per round
(:mod:`fedfew.stch.mu_schedule`).

Why ``normalize=true`` is the default: with the reference's rule sum_k sum_i alpha_i w_ik = 1, so
the K models share ONE client-sized step. The model that leads early takes most of it, the
others stop moving, their w_ik go to 0 and every client ends on one model (measured on digits,
M = 20, K = 3: effective steps [0.32, 0.45, 0.23] at round 1, [0.000, 0.985, 0.013] by round
31, clients per model [0, 20, 0]). Normalising keeps every model moving towards the clients it
serves best (alpha still weighs struggling clients more inside each model's mean).
``algorithm=fedfew_reference`` restores every reference setting at once.

Logged every round (``end_round``): ``g``, ``alpha`` (P), ``w`` (P x K), ``loss`` (P x K),
``assignment`` (argmax_k w_ik), and the diagnostics of :func:`set_diagnostics`:
``effective_step`` (K; the fraction of a client-sized step model k actually took:
eta_s * sum_i alpha_i w_ik, divided by that sum when normalising), ``weight_share`` (K;
sum_i alpha_i w_ik), ``effective_clients`` (K; (sum_i w_ik)^2 / sum_i w_ik^2), ``models_in_use``
(models that are some client's argmax w), ``loss_gap_mean`` (mean over clients of the gap between
their second-best and best model loss, nats) and ``model_distance_mean`` (mean pairwise L2
distance between the server models' parameters); also ``model_ids`` (the original ids of the
round's models: the columns of w and loss, the values of ``assignment``), ``K``, ``mu`` and, when
K=auto retired a model after the round, ``model_set_change`` (one line of text).

Local training is delegated to an engine (top-level ``engine``: ``loop``, the default, trains
the K models one after another; ``vmap`` trains them -- and on a GPU several clients' -- as
one stacked set with torch.func; see :mod:`fedfew.engines`).
"""
from __future__ import annotations

import warnings
from typing import Any

import torch

from fedfew.core.aggregation import LogWeightedSum
from fedfew.algorithms import ALGORITHMS
from fedfew.algorithms.base import Algorithm, Context
from fedfew.algorithms.round_log import Kind
from fedfew.stch.auto_k import AutoK
from fedfew.data.base import ClientSplit
from fedfew.algorithms.base import Hint
from fedfew.engines import ENGINES
from fedfew.engines.base import ClientJob
from fedfew.core.local_training import evaluate_model
from fedfew.core.model_set import assign_state_, flat_parameters, flat_state, state_numel
from fedfew.stch.mu_schedule import round_mu
from fedfew.stch.scalarization import client_log_weights, stch_set
from fedfew.core.seeding import derive_seed



def nonfinite_models(losses: torch.Tensor, deltas: torch.Tensor) -> list[int]:
    """Positions k whose loss (K,) or delta row (K, D) is not finite."""
    bad = ~torch.isfinite(losses) | ~torch.isfinite(deltas).all(dim=1).to(losses.device)
    return torch.nonzero(bad).flatten().tolist()


@ALGORITHMS.register("fedfew")
class FedFew(Algorithm):
    """FedFew with STCH-Set weights (see module docstring)."""

    key_rules = {"K": "integer >= 1, or auto (auto: start with K_max models, retire redundant ones)",
                 "K_max": "integer >= 1 (K=auto: models at the start; <= num_clients)",
                 "K_min": "integer >= 1 (K=auto: models never retired below; <= K_max)",
                 "auto_patience": "integer >= 1 (K=auto: rounds in a row a model is redundant before it is retired)",
                 "mu": "number > 0 (temperature of alpha and w, in nats of loss)",
                 "mu_schedule": "constant | cosine | exponential | spread | loss (mu over rounds)",
                 "mu_end": "number > 0 (cosine, exponential: the last round's mu; <= mu)",
                 "mu_clients": "number in (0, 1) (mu_schedule=spread: share of the clients alpha spreads over)",
                 "mu_ratio": "number > 0 (mu_schedule=loss: mu as a fraction of the mean best loss)",
                 "mu_scale": "relative | reference (units of mu)",
                 "init": "independent | identical",
                 "loss_source": "running | pre (the losses alpha and w are computed from)",
                 "sample_weighting": "samples | none",
                 "server_lr": "number > 0",
                 "normalize": "true | false (true: each model moves by the weighted mean of its deltas)"}

    row_shapes = {"loss": lambda K: (K,)}
    #: excluded: participants left out for non-finite results; model_ids: the ids of this round's models
    #: (the columns of w and loss, the entries of the per-model vectors, the values of assignment); K, mu:
    #: the round's; g: the STCH-Set value; alpha (P), w (P x K): the weights; the models' effective step
    #: and weight share sum_i alpha_i w_ik; set_diagnostics'; K=auto: the text of a retirement
    log_keys = {"loss": Kind.PER_CLIENT_MODEL, "excluded": Kind.RECORD, "model_ids": Kind.RECORD,
                "K": Kind.SCALAR, "mu": Kind.SCALAR, "g": Kind.SCALAR, "alpha": Kind.PER_CLIENT,
                "w": Kind.PER_CLIENT_MODEL, "assignment": Kind.PER_CLIENT, "effective_step": Kind.PER_MODEL,
                "weight_share": Kind.PER_MODEL, "effective_clients": Kind.PER_MODEL, "models_in_use": Kind.SCALAR,
                "loss_gap_mean": Kind.SCALAR, "model_distance_mean": Kind.SCALAR, "model_set_change": Kind.RECORD}
    uses_engine = True
    watch_collapse = True
    collapse_keys = (Hint("algorithm.normalize", True, "each model moves by the weighted mean of its deltas; the "
                          "reference's rule makes the K models share one step"),
                     Hint("algorithm.mu", why="softer w", change="a larger"), Hint("algorithm.init", "independent"))
    collapse_hint = ("On label-skew splits (Dirichlet) one model serving every client can be the objective's own "
                     "optimum: docs/fedfew.md")

    def __init__(self, cfg, ctx: Context) -> None:
        super().__init__(cfg, ctx)
        self.mu = float(cfg.mu)  # this round's mu (algorithm.mu_schedule, set in begin_round)
        self._best: torch.Tensor | None = None  # (P,) best scaled losses of the last round (mu_schedule spread, loss)
        # K=auto (fedfew.stch.auto_k): retire models no client needs; its own rule replaces the collapse warning
        self.auto = AutoK(int(cfg.get("K_min", 1)), int(cfg.get("auto_patience", 3))) if self.is_auto(cfg) else None
        self.watch_collapse = self.auto is None
        self.engine = ENGINES.get(ctx.cfg.get("engine", "loop") or "loop").from_context(ctx)
        self._accumulator: LogWeightedSum | None = None
        self._participant_total = 1.0
        self._participant_count = 1

    @staticmethod
    def is_auto(cfg) -> bool:
        """Whether ``algorithm.K=auto`` (start with ``K_max`` models, retire redundant ones)."""
        return str(cfg.K) == "auto"

    @staticmethod
    def num_models(cfg) -> int:
        """K, or ``K_max`` under ``K=auto`` (the models at the start)."""
        return int(cfg.K_max) if FedFew.is_auto(cfg) else int(cfg.K)

    def begin_round(self, rnd: int, participants: list[int]) -> None:
        ctx, module = self.ctx, self.ctx.module
        self.mu = round_mu(self.cfg, rnd, int(ctx.cfg.rounds), self._best, ctx.data.num_classes, previous_mu=self.mu)
        dim = state_numel(module.working)  # state vector: parameters + BatchNorm statistics
        self._accumulator = LogWeightedSum(module.K, dim, device=ctx.fabric.device)
        self._participant_total = float(ctx.num_train[participants].sum())
        self._participant_count = len(participants)

    def train_clients(self, clients: list[ClientSplit], rnd: int) -> dict[int, dict[str, torch.Tensor]]:
        """The cohort's losses, (K,) per client; the deltas go straight into the streaming sum.

        The engine (``engine=loop|vmap``) trains the K models from the server weights, several
        clients at once where it plans chunks (:meth:`fedfew.engines.base.Engine.plan`: loop, one
        at a time); chunks are trained in the order of their first client in ``clients``.
        """
        ids = [client.id for client in clients]
        chunk_of = {c: chunk for chunk in self.engine.plan({c: int(self.ctx.num_train[c]) for c in ids}) for c in chunk}
        losses: dict[int, torch.Tensor] = {}
        for c in ids:
            if c not in losses:
                self._train_chunk([x for x in chunk_of.get(c, [c]) if x not in losses], rnd, losses)
        return {c: {"loss": losses[c]} for c in ids}

    def client_update(self, client: ClientSplit, rnd: int) -> dict[str, torch.Tensor]:
        """One client's losses (K,): a cohort of one (a Flower client)."""
        return self.train_clients([client], rnd)[client.id]

    def _train_chunk(self, client_ids: list[int], rnd: int, losses_out: dict[int, torch.Tensor]) -> None:
        """Train ``client_ids`` with the engine, fold each finite result into the accumulator
        and put its losses (NaN rows for excluded clients) in ``losses_out``."""
        ctx, module, run = self.ctx, self.ctx.module, self.ctx.cfg
        # seeds follow the model's id, so retiring a model (K=auto) leaves the others' streams unchanged
        jobs = [ClientJob(c, ctx.train_index[c], [derive_seed(run.seed, "local", rnd, c, k) for k in module.model_ids])
                for c in client_ids]
        pre = {}
        if self.cfg.loss_source == "pre":  # eval-mode loss of each broadcast model, before training
            pre = {c: torch.tensor([evaluate_model(m, ctx.data, ctx.train_index[c])[0] for m in module.models],
                                   dtype=torch.float64) for c in client_ids}
        for result in self.engine.train(jobs):
            losses = pre.get(result.client, result.losses)
            bad = nonfinite_models(losses, result.deltas)
            if bad:  # the whole client is left out of this round (its alpha needs all K losses)
                for k in bad:
                    ctx.nonfinite.report(result.client, f"local copy of model {module.model_ids[k]}")
                losses_out[result.client] = torch.full_like(losses, float("nan"))
                continue
            log_w = client_log_weights(losses * self._loss_scale(result.client), self.mu)
            for k in range(module.K):
                self._accumulator.add(k, float(log_w[k]), result.deltas[k])
            losses_out[result.client] = losses

    def _loss_scale(self, client_id: int) -> float:
        """The weight of client ``client_id``'s losses this round (:func:`weight_losses`):
        ``samples``: n_i / mean_j n_j (``mu_scale=relative``) or p_i = n_i / sum_j n_j
        (``reference``), over this round's participants; ``none``: 1."""
        if self.cfg.sample_weighting != "samples":
            return 1.0
        share = float(self.ctx.num_train[client_id]) / self._participant_total
        return share * self._participant_count if self.cfg.get("mu_scale", "relative") == "relative" else share

    def end_round(self, rnd: int, participants: list[int], rows: dict[str, torch.Tensor]) -> dict[str, Any]:
        losses = rows["loss"].double().cpu()
        K = self.ctx.module.K
        valid = torch.isfinite(losses).all(dim=1)  # clients excluded for non-finite results
        accumulator = self._accumulator.all_reduce_()
        alpha = torch.zeros(len(participants), dtype=torch.float64)
        w = torch.zeros(len(participants), K, dtype=torch.float64)
        ids = list(self.ctx.module.model_ids)  # original ids of this round's models (columns of w, loss)
        logs: dict[str, Any] = {"loss": losses, "excluded": [participants[j] for j in torch.nonzero(~valid).flatten().tolist()],
                                "model_ids": ids, "K": K, "mu": self.mu}
        if not bool(valid.any()):  # nothing finite arrived (the round loop counts such rounds: fedfew.core.nonfinite)
            self._accumulator = None
            return {**logs, "g": float("nan"), "alpha": alpha, "w": w, "assignment": torch.zeros(len(participants), dtype=torch.long),
                    "effective_step": torch.zeros(K, dtype=torch.float64)}
        # the same scaled losses L'_ik = s_i L_ik (_loss_scale) as the clients used for their log weights
        scale = torch.tensor([self._loss_scale(c) for c in participants], dtype=torch.float64)
        weights = stch_set((losses * scale[:, None])[valid], self.mu)
        alpha[valid], w[valid] = weights.alpha, weights.w
        weight = alpha[:, None] * w
        share = weight.sum(dim=0)  # (K,) sum_i alpha_i w_ik
        if self.cfg.get("normalize", True):
            # each model moves by the weighted *mean* of its deltas (FedAvg-sized steps), computed in
            # log space so a model whose total weight underflows still moves towards its clients
            update, step = accumulator.mean(), (accumulator.total > 0).double()
        else:
            update, step = accumulator.result(float(weights.g) / self.mu), share.clone()
        eta = float(self.cfg.server_lr)
        for k, model in enumerate(self.ctx.module.models):
            # the server parameters do not change during a round: no (K, d) copy is kept
            new = flat_state(model) + eta * update[k]
            if not bool(torch.isfinite(new).all()):  # never let NaN/inf reach a server model
                warnings.warn(f"round {rnd}: the update of model {k} is not finite; model {k} keeps its parameters")
                step[k] = 0.0
                continue
            assign_state_(model, new)
        self._accumulator = None
        diagnostics = set_diagnostics(losses[valid], w[valid], [flat_parameters(m) for m in self.ctx.module.models])
        self._best = weights.losses.min(dim=1).values.double()  # b_i of mu_schedule spread / loss
        if self.auto is not None:  # K=auto: retire a redundant model after this round's step
            retired = self.auto.step(rnd, weights.losses, weights.w, self.mu, ids)
            if retired is not None:
                self.ctx.module.retire_(retired[0])
                logs["model_set_change"] = retired[1].text()
        return {**logs, "g": float(weights.g), "alpha": alpha, "w": w,
                "assignment": torch.tensor(ids, dtype=torch.long)[w.argmax(dim=1)],  # model ids
                "effective_step": eta * step, "weight_share": share, **diagnostics}

    def model_assignment(self, client: ClientSplit, chosen: int) -> int:
        """The original id of the server model the client picked (= ``chosen`` unless K=auto
        retired models)."""
        return int(self.ctx.module.model_ids[chosen])

    def summary(self) -> dict[str, Any]:
        """Final-summary entries: under K=auto ``K`` (models left), ``K_initial`` (K_max),
        ``model_ids`` (ids of the models left, in the order of the final set) and ``K_changes``
        (every retirement: round, model, reason, partner, K, mu, figures, text)."""
        if self.auto is None:
            return {}
        module = self.ctx.module
        return {"K": module.K, "K_initial": module.initial_K, "model_ids": list(module.model_ids),
                "K_changes": [c.as_dict() for c in self.auto.changes]}

    def state_dict(self) -> dict[str, Any]:
        """What the mu schedules read (the last round's mu and best losses) and the K=auto
        streaks and changes (the model ids are the module's, saved with the models)."""
        return {"mu": self.mu, "best_losses": self._best,
                "auto": self.auto.state_dict() if self.auto is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.mu, self._best = float(state["mu"]), state["best_losses"]
        if self.auto is not None and state.get("auto") is not None:
            self.auto.load_state_dict(state["auto"])


def set_diagnostics(losses: torch.Tensor, w: torch.Tensor, flat_models: list[torch.Tensor]) -> dict[str, Any]:
    """How many of the K models serve clients, and how different they are.

    Args:
        losses: (P, K) raw losses L_ik (nats) of the round's valid participants.
        w: (P, K) client-model weights (rows sum to 1).
        flat_models: K flat (d,) parameter vectors of the server models.
    Returns:
        ``effective_clients`` (K,) float64: (sum_i w_ik)^2 / sum_i w_ik^2, the number of clients
        model k effectively serves (0 for a model with no weight); ``models_in_use`` (int): models
        that are some client's argmax_k w_ik; ``loss_gap_mean`` (float, nats): mean over clients of
        (second-best - best) L_ik, NaN for K = 1; ``model_distance_mean`` (float): mean pairwise
        L2 distance between the models' parameters, NaN for K = 1.
    """
    K = w.shape[1]
    col = w.sum(dim=0)
    sq = (w ** 2).sum(dim=0)
    effective = torch.where(sq > 0, col ** 2 / sq.clamp_min(1e-300), torch.zeros_like(col))
    in_use = int(torch.unique(w.argmax(dim=1)).numel()) if len(w) else 0
    if K > 1 and len(losses):
        two = torch.topk(losses, 2, dim=1, largest=False).values
        gap = float((two[:, 1] - two[:, 0]).mean())
        stacked = torch.stack([m.double() for m in flat_models])
        distance = float(torch.pdist(stacked).mean())
    else:
        gap = distance = float("nan")
    return {"effective_clients": effective, "models_in_use": in_use, "loss_gap_mean": gap,
            "model_distance_mean": distance}
