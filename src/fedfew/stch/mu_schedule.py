"""mu over rounds (``algorithm.mu_schedule``): FedFew's temperature without a grid.

mu is the STCH-Set temperature in nats of (scaled) loss: w_ik = softmax_k(-L'_ik / mu) and
alpha_i = softmax_i(smin_k L'_ik / mu). One number sets two things: how hard each client picks
its model (w), and how strongly the server step leans towards the struggling clients (alpha).
Schedules, round r of R (1-based):

- ``constant``: mu_r = mu (the default; the paper's).
- ``cosine``: mu_r = mu_end + (mu - mu_end) * (1 + cos(pi * (r - 1) / (R - 1))) / 2, from mu at
  round 1 to mu_end at round R (early rounds share, late rounds specialise).
- ``exponential``: mu_r = mu * (mu_end / mu) ** ((r - 1) / (R - 1)), geometric from mu to mu_end.
- ``spread`` (scale-free, no unit to choose): mu_r is the temperature at which the client
  weights of the previous round's best losses, a_i = softmax_i(b_i / mu) with
  b_i = min_k L'_ik, effectively weigh a fraction ``mu_clients`` of the P participants:

      1 / sum_i a_i^2 = mu_clients * P            (solved for mu by bisection in log mu)

  So the outer weights alpha always spread over the same share of the clients (default half):
  the struggling clients count more, but a model's step stays a mean over many clients instead
  of following its single worst client (what a too small mu does), and the models still learn
  from their own clients (what a too large mu undoes). Multiplying every loss by a constant
  multiplies mu by it and leaves every weight unchanged; duplicating every client leaves it
  unchanged. Round 1 (no losses yet), a round whose best losses are all equal, or P *
  mu_clients <= 1 keep the previous mu (round 1: ``algorithm.mu``).
- ``loss`` (scale-free): mu_r = mu_ratio * Lbar_{r-1}, with Lbar_{r-1} the mean of the previous
  round's best losses b_i and Lbar_0 = log C (the cross-entropy of an untrained model over C
  classes; floored at :data:`MIN_LOSS_LEVEL`). ``algorithm.mu`` is not used. Measured to lose
  to a fixed mu (docs/results.md): mu falls with the loss, and late in training alpha follows a
  few clients.

The previous round's losses are used because each client's server-step weight is folded in as
soon as it has trained (:mod:`fedfew.core.aggregation`), before the round's other losses exist.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch

#: floor of Lbar under ``loss`` (nats): a training loss that underflows to 0 keeps mu > 0
MIN_LOSS_LEVEL = 1e-8

#: schedules whose mu decreases from ``mu`` to ``mu_end`` (``mu_end`` <= ``mu`` required)
DECREASING = ("cosine", "exponential")
#: schedules set from the previous round's losses
FROM_LOSSES = ("spread", "loss")


def _progress(rnd: int, rounds: int) -> float:
    return (rnd - 1) / max(rounds - 1, 1)


MU_SCHEDULES: dict[str, Callable[[float, float, int, int], float]] = {
    "constant": lambda mu, mu_end, r, R: mu,
    "cosine": lambda mu, mu_end, r, R: mu_end + (mu - mu_end) * 0.5 * (1 + math.cos(math.pi * _progress(r, R))),
    "exponential": lambda mu, mu_end, r, R: mu * (mu_end / mu) ** _progress(r, R),
    "spread": lambda mu, mu_end, r, R: math.nan,  # set from the losses: :func:`spread_mu`
    "loss": lambda mu, mu_end, r, R: math.nan,  # set from the losses: :func:`round_mu`
}


def effective_clients(best: torch.Tensor, mu: float) -> float:
    """1 / sum_i a_i^2 for a = softmax_i(best_i / mu): how many clients the weights spread over
    (1 = one client, P = all equally). ``best``: (P,) losses (nats)."""
    a = torch.softmax(best.double() / mu, dim=0)
    return float(1.0 / (a * a).sum())


def spread_mu(best: torch.Tensor, fraction: float, iterations: int = 100) -> float | None:
    """The mu at which softmax_i(best_i / mu) has ``fraction * P`` effective clients.

    The effective number of clients grows monotonically from the number of tied worst clients
    (mu -> 0) to P (mu -> inf), so a bisection on log mu between 1e-6 and 1e6 times the range of
    ``best`` finds it (to a relative 1e-12).

    Args:
        best: (P,) best scaled loss of each participant (nats), finite.
        fraction: target share of the participants, in (0, 1).
    Returns:
        mu (nats), or None when it is undefined: P < 2, every loss equal, or fraction * P <= 1.
    """
    best = best.double().flatten()
    P = best.numel()
    target = float(fraction) * P
    span = float(best.max() - best.min()) if P else 0.0
    if P < 2 or target <= 1.0 or not span > 0:
        return None
    lo, hi = math.log(span * 1e-6), math.log(span * 1e6)
    for _ in range(iterations):
        mid = 0.5 * (lo + hi)
        if effective_clients(best, math.exp(mid)) < target:
            lo = mid
        else:
            hi = mid
    return math.exp(0.5 * (lo + hi))


def round_mu(cfg: Any, rnd: int, rounds: int, previous_best: torch.Tensor | None, num_classes: int,
             previous_mu: float | None = None) -> float:
    """mu of round ``rnd`` (1-based) of ``rounds``.

    Args:
        cfg: the ``algorithm`` config: ``mu`` (nats, > 0), ``mu_schedule`` (default constant),
            ``mu_end`` (cosine, exponential: mu of the last round, 0 < mu_end <= mu),
            ``mu_clients`` (spread: the share of the participants alpha spreads over, in (0, 1)),
            ``mu_ratio`` (loss: mu as a fraction of the mean best loss, > 0).
        previous_best: (P,) best scaled loss min_k L'_ik of each valid participant of the last
            round that had one (nats), or None before the first round.
        num_classes: C (``loss`` before the first round: log C).
        previous_mu: the last round's mu (``spread`` keeps it when its own is undefined; None:
            ``cfg.mu``).
    Returns:
        mu_r (nats of scaled loss, > 0).
    Raises:
        ValueError: an unknown schedule, or values that make mu_r not a finite number > 0.
    """
    name = str(cfg.get("mu_schedule", "constant"))
    if name not in MU_SCHEDULES:
        raise ValueError(f"algorithm.mu_schedule={name!r}; allowed: {', '.join(MU_SCHEDULES)}")
    if name == "spread":
        found = spread_mu(previous_best, float(cfg.get("mu_clients", 0.5))) if previous_best is not None else None
        mu = found if found is not None else (float(cfg.mu) if previous_mu is None else float(previous_mu))
    elif name == "loss":
        level = math.log(num_classes) if previous_best is None else float(previous_best.double().mean())
        mu = float(cfg.get("mu_ratio", 0.1)) * max(level, MIN_LOSS_LEVEL)
    else:
        mu = MU_SCHEDULES[name](float(cfg.mu), float(cfg.get("mu_end", cfg.mu)), int(rnd), int(rounds))
    if not (mu > 0 and math.isfinite(mu)):
        raise ValueError(f"algorithm.mu_schedule={name}: mu of round {rnd} is {mu}, not a finite number > 0 "
                         "(check algorithm.mu, mu_end, mu_ratio and mu_clients)")
    return mu
