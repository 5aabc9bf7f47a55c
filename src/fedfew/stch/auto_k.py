"""``algorithm.K=auto``: start with ``K_max`` server models and retire those no client needs.

The rule reads only what the STCH-Set step already computes each round: the scaled loss matrix
L' (P x K, nats, the losses the weights see: :func:`fedfew.stch.scalarization.weight_losses`), the
soft selections w = softmax_k(-L'/mu) and mu itself. mu is the resolution of the objective:
two models whose losses on a client differ by less than mu get weights within a factor e of
each other, and the smoothed objective cannot tell them apart (its error bound is
mu * (log M + log K)). A model is **redundant** in a round when

- **unserved**: it is no client's near-best model, i.e. for every client i,
  L'_ik > min_j L'_ij + mu (so w_ik < w_i,best / e); or
- **duplicate** of another model k': take the clients whose best model (argmax_k w_ik) is k or
  k'. For every one of them the two losses are close,

      |L'_ik - L'_ik'| <= max(mu, (min_{j not k, k'} L'_ij - max(L'_ik, L'_ik')) / 2),

  i.e. within mu (their w split lies within [1/(1+e), e/(1+e)] = [0.27, 0.73]) or within half
  the margin from the pair to the next model (the pair sits together, far from every other
  model: two models that split one group's clients and drift apart by more than a small mu
  still count), and the pair holds the majority of the client's weight, w_ik + w_ik' > 1/2.
  The majority condition is what tells a settled duplicate from a model set that has not
  separated yet: in the first rounds every loss is within mu of every other, but the weight is
  spread over all K models, so no pair holds a majority. Of the two, the model that is the best
  of fewer of those clients is the duplicate (ties: the smaller soft client count sum_i w_ik,
  then the later model id). With K = 2 there is no next model: within mu only.

Under the normalised server step (``normalize=true``) such models never die by themselves: a
starved model still moves towards the weighted mean of its nearest clients, and two duplicates
converge to the same point and split their clients' weight. Retiring them is what shrinks K.

A model redundant for ``auto_patience`` rounds in a row is retired, at most one per round (the
unserved before duplicates, then the one with the smallest soft client count sum_i w_ik),
never below ``K_min`` models. Retiring removes the model from the K-model set
(:meth:`fedfew.core.model_set.KModelSet.retire_`): the engines, the STCH-Set weights and the next
round see K - 1 models; each model keeps its original id (``module.model_ids``) in every log.

No split rule is built: a model whose clients disagree is not divided (start with a larger
``K_max`` instead).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

REASONS = ("unserved", "duplicate")


@dataclass(frozen=True)
class Redundancy:
    """One round's verdict per model (positions 0..K-1 of the current set).

    Attributes:
        unserved: (K,) bool, no client has the model within mu of its best loss.
        duplicate_of: (K,) int64, the position of the model it duplicates, -1 if none.
        gap: (K,) float64, for a duplicate: max over the pair's clients of |L'_ik - L'_ik'|
            (nats; <= mu, or <= half the margin to the next model); NaN otherwise.
        pair_weight: (K,) float64, for a duplicate: min over the pair's clients of
            w_ik + w_ik'; NaN otherwise.
        served: (K,) int64, clients whose best model (argmax_k w_ik) it is.
        soft_clients: (K,) float64, sum_i w_ik.
    """

    unserved: torch.Tensor
    duplicate_of: torch.Tensor
    gap: torch.Tensor
    pair_weight: torch.Tensor
    served: torch.Tensor
    soft_clients: torch.Tensor

    def reason(self, k: int) -> str | None:
        """``"unserved"``, ``"duplicate"`` or None for model position ``k``."""
        if bool(self.unserved[k]):
            return "unserved"
        return "duplicate" if int(self.duplicate_of[k]) >= 0 else None


def redundant_models(losses: torch.Tensor, w: torch.Tensor, mu: float) -> Redundancy:
    """Which models are redundant this round (the two conditions of the module docstring).

    Args:
        losses: (P, K) scaled losses L'_ik of the round's valid participants (nats; the ones
            the STCH-Set weights were computed from).
        w: (P, K) client-model weights, rows summing to 1.
        mu: the round's mu (> 0, same units as ``losses``).
    Returns:
        :class:`Redundancy`.
    Raises:
        ValueError: shapes differ, P = 0, or mu is not a finite number > 0.
    """
    if losses.shape != w.shape or losses.ndim != 2 or losses.shape[0] == 0:
        raise ValueError(f"losses and w must be the same (P, K) shape with P >= 1, got {tuple(losses.shape)} "
                         f"and {tuple(w.shape)}")
    mu = float(mu)
    if not (mu > 0 and math.isfinite(mu)):
        raise ValueError(f"mu must be a finite number > 0, got {mu}")
    L, w = losses.double(), w.double()
    P, K = L.shape
    near = L <= L.min(dim=1, keepdim=True).values + mu
    unserved = ~near.any(dim=0)
    best = w.argmax(dim=1)
    served = torch.bincount(best, minlength=K)
    soft = w.sum(dim=0)
    duplicate_of = torch.full((K,), -1, dtype=torch.int64)
    gap = torch.full((K,), math.nan, dtype=torch.float64)
    pair_weight = torch.full((K,), math.nan, dtype=torch.float64)
    for k in range(K):
        for j in range(k + 1, K):
            if bool(unserved[k]) or bool(unserved[j]):
                continue
            clients = (best == k) | (best == j)
            if not bool(clients.any()):
                continue
            gaps = (L[clients, k] - L[clients, j]).abs()
            tolerance = torch.full_like(gaps, mu)
            if K > 2:  # or half the margin from the pair to the next model, when that is wider
                others = [m for m in range(K) if m not in (k, j)]
                margin = L[clients][:, others].min(dim=1).values - torch.maximum(L[clients, k], L[clients, j])
                tolerance = torch.maximum(tolerance, margin / 2)
            pair_gap = float(gaps.max())
            weight = float((w[clients, k] + w[clients, j]).min())
            if bool((gaps > tolerance).any()) or weight <= 0.5:
                continue
            # the lesser of the two: best of fewer of the pair's clients, then fewer soft clients, then the later one
            key_k = (int((best[clients] == k).sum()), float(soft[k]), -k)
            key_j = (int((best[clients] == j).sum()), float(soft[j]), -j)
            lesser, other = (k, j) if key_k < key_j else (j, k)
            if duplicate_of[lesser] < 0 or pair_gap < gap[lesser]:  # keep the closest partner
                duplicate_of[lesser], gap[lesser], pair_weight[lesser] = other, pair_gap, weight
    return Redundancy(unserved, duplicate_of, gap, pair_weight, served, soft)


@dataclass
class ModelSetChange:
    """One retirement: ``round`` (after its server step), the retired ``model`` (original id),
    ``reason`` (unserved | duplicate), ``partner`` (id of the model it duplicates, or None),
    ``K`` (models left), ``mu`` of that round, and the figures behind the verdict."""

    round: int
    model: int
    reason: str
    partner: int | None
    K: int
    mu: float
    gap: float | None = None
    pair_weight: float | None = None
    soft_clients: float = 0.0

    def text(self) -> str:
        """One line for metrics.csv, the console and W&B."""
        if self.reason == "duplicate":
            close = "<= mu" if self.gap <= self.mu else "> mu but within half the margin to the next model"
            why = (f"duplicate of model {self.partner}: its clients' losses within {self.gap:.3g} ({close} = {self.mu:.3g}), "
                   f"the pair holding >= {self.pair_weight:.2f} of each one's weight")
        else:
            why = f"unserved: no client has it within mu = {self.mu:.3g} of its best loss"
        return f"round {self.round}: retired model {self.model} ({why}); K = {self.K}"

    def as_dict(self) -> dict[str, Any]:
        return {"round": self.round, "model": self.model, "reason": self.reason, "partner": self.partner,
                "K": self.K, "mu": self.mu, "gap": self.gap, "pair_weight": self.pair_weight,
                "soft_clients": self.soft_clients, "text": self.text()}


class AutoK:
    """The retire rule over rounds (``algorithm.K=auto``).

    Args:
        K_min: never retire below this many models (>= 1).
        patience: rounds in a row a model must be redundant before it is retired (>= 1).
    Raises:
        ValueError: K_min or patience < 1.
    """

    def __init__(self, K_min: int = 1, patience: int = 3) -> None:
        if int(K_min) < 1 or int(patience) < 1:
            raise ValueError(f"algorithm.K_min and algorithm.auto_patience must be >= 1, got {K_min}, {patience}")
        self.K_min, self.patience = int(K_min), int(patience)
        self.streak: dict[int, int] = {}
        self.changes: list[ModelSetChange] = []

    def step(self, rnd: int, losses: torch.Tensor, w: torch.Tensor, mu: float,
             model_ids: list[int]) -> tuple[int, ModelSetChange] | None:
        """Update the redundancy streaks with one round; return the model to retire, if any.

        Args:
            rnd: the round. losses, w, mu: as :func:`redundant_models` (columns in the order
                of ``model_ids``). model_ids: original ids of the current models.
        Returns:
            ``(position, change)`` of the model to retire now, or None. The caller removes it
            from the model set; the change is recorded in :attr:`changes`.
        """
        report = redundant_models(losses, w, mu)
        reasons = [report.reason(k) for k in range(len(model_ids))]
        self.streak = {mid: (self.streak.get(mid, 0) + 1 if reason else 0) for mid, reason in zip(model_ids, reasons)}
        if len(model_ids) <= self.K_min:
            return None
        due = [k for k, mid in enumerate(model_ids) if self.streak[mid] >= self.patience]
        if not due:
            return None
        k = min(due, key=lambda k: (reasons[k] != "unserved", float(report.soft_clients[k]), -model_ids[k]))
        partner = int(report.duplicate_of[k]) if reasons[k] == "duplicate" else -1
        change = ModelSetChange(
            round=int(rnd), model=int(model_ids[k]), reason=str(reasons[k]),
            partner=int(model_ids[partner]) if partner >= 0 else None, K=len(model_ids) - 1, mu=float(mu),
            gap=float(report.gap[k]) if partner >= 0 else None,
            pair_weight=float(report.pair_weight[k]) if partner >= 0 else None,
            soft_clients=float(report.soft_clients[k]),
        )
        self.changes.append(change)
        del self.streak[model_ids[k]]
        return k, change

    def state_dict(self) -> dict[str, Any]:
        return {"streak": dict(self.streak), "changes": [c.__dict__.copy() for c in self.changes]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.streak = {int(k): int(v) for k, v in state["streak"].items()}
        self.changes = [ModelSetChange(**c) for c in state["changes"]]
