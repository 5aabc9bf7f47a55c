"""mu over rounds (``algorithm.mu_schedule``): FedFew's temperature without a grid.

mu is the STCH-Set temperature in nats of (scaled) loss: w_ik = softmax_k(-L'_ik / mu). A
fixed mu means different things as training goes: at the start every loss is near log C and a
gap of mu = 0.2 nats is a large fraction of it; at the end the losses are ~0.1 and the same mu
makes every client's weight soft again. Schedules, round r of R (1-based):

- ``constant``: mu_r = mu (the default; the paper's).
- ``cosine``: mu_r = mu_end + (mu - mu_end) * (1 + cos(pi * (r - 1) / (R - 1))) / 2, from mu at
  round 1 to mu_end at round R (early rounds share, late rounds specialise).
- ``exponential``: mu_r = mu * (mu_end / mu) ** ((r - 1) / (R - 1)), geometric from mu to mu_end.
- ``loss`` (scale-free): mu_r = mu_ratio * Lbar_{r-1}, where Lbar_{r-1} is the mean over the
  previous round's participants of their best scaled loss, min_k L'_ik (nats), and
  Lbar_0 = log C (the cross-entropy of a uniform guess over the C classes, i.e. the loss of an
  untrained model). w then depends only on the ratios L'_ik / Lbar: multiplying every loss by a
  constant leaves every weight unchanged, and mu shrinks with the losses as the models learn
  (Lbar is floored at :data:`MIN_LOSS_LEVEL`).
  ``algorithm.mu`` is not used. The previous round's losses are used because each client's
  server-step weight is folded in as soon as it has trained (:mod:`fedfew.aggregation`), before
  the round's other losses exist.
"""
from __future__ import annotations

import math
from typing import Any, Callable

#: floor of Lbar under ``loss`` (nats): a training loss that underflows to 0 keeps mu > 0
MIN_LOSS_LEVEL = 1e-8

#: schedules whose mu decreases from ``mu`` to ``mu_end`` (``mu_end`` <= ``mu`` required)
DECREASING = ("cosine", "exponential")


def _progress(rnd: int, rounds: int) -> float:
    return (rnd - 1) / max(rounds - 1, 1)


MU_SCHEDULES: dict[str, Callable[[float, float, int, int], float]] = {
    "constant": lambda mu, mu_end, r, R: mu,
    "cosine": lambda mu, mu_end, r, R: mu_end + (mu - mu_end) * 0.5 * (1 + math.cos(math.pi * _progress(r, R))),
    "exponential": lambda mu, mu_end, r, R: mu * (mu_end / mu) ** _progress(r, R),
    "loss": lambda mu, mu_end, r, R: math.nan,  # set from the losses: :func:`round_mu`
}


def round_mu(cfg: Any, rnd: int, rounds: int, previous_best_loss: float | None, num_classes: int) -> float:
    """mu of round ``rnd`` (1-based) of ``rounds``.

    Args:
        cfg: the ``algorithm`` config: ``mu`` (nats, > 0), ``mu_schedule`` (default constant),
            ``mu_end`` (cosine, exponential: mu of the last round, 0 < mu_end <= mu),
            ``mu_ratio`` (loss: mu as a fraction of the mean best loss, > 0).
        previous_best_loss: Lbar_{r-1}, the mean best scaled loss of the last round that had
            valid clients (nats), or None before the first round (``loss`` then uses log C).
        num_classes: C.
    Returns:
        mu_r (nats of scaled loss, > 0).
    Raises:
        ValueError: an unknown schedule, or a value that makes mu_r not a finite number > 0.
    """
    name = str(cfg.get("mu_schedule", "constant"))
    if name not in MU_SCHEDULES:
        raise ValueError(f"algorithm.mu_schedule={name!r}; allowed: {', '.join(MU_SCHEDULES)}")
    if name == "loss":
        level = math.log(num_classes) if previous_best_loss is None else float(previous_best_loss)
        mu = float(cfg.get("mu_ratio", 0.1)) * max(level, MIN_LOSS_LEVEL)
    else:
        mu = MU_SCHEDULES[name](float(cfg.mu), float(cfg.get("mu_end", cfg.mu)), int(rnd), int(rounds))
    if not (mu > 0 and math.isfinite(mu)):
        raise ValueError(f"algorithm.mu_schedule={name}: mu of round {rnd} is {mu}, not a finite number > 0 "
                         "(check algorithm.mu, mu_end and mu_ratio)")
    return mu
