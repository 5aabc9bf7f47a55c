"""Pieces shared by the baselines whose server needs every participant's whole vector
(CFL: the updates' cosine similarities; FedMGDA+: their Gram matrix; FedAMP: the personal
models' distances), not only a weighted sum of them.

Such a vector travels as a gathered row of length d (``row_shapes`` entry ``(d,)``, float64,
on the training device): each rank writes its own clients' rows and one all-reduce gives the
(P, d) matrix in participant order on every rank (:func:`fedfew.core.distributed.gather_rows`).
That costs P x d float64 per round on each device: fine for the small models of these
baselines, heavy for a million-parameter model with hundreds of participants.

A client whose vector is not finite is reported (:mod:`fedfew.core.nonfinite`; ``FloatingPointError``
with ``fail_on_nonfinite``) and sends a zero row with ``valid = 0``; the server leaves it out.

The module name starts with ``_`` so the algorithm registry does not treat it as a method.
"""
from __future__ import annotations

from typing import Callable

import torch

from fedfew.algorithms.base import Context


def vector_rows(d: int) -> dict[str, Callable[[int], tuple[int, ...]]]:
    """``row_shapes`` entries for one (d,) vector and its validity flag per participant."""
    return {"vector": lambda K: (d,), "valid": lambda K: (1,)}


def finite_or_excluded(ctx: Context, client_id: int, vector: torch.Tensor, what: str = "local model") -> bool:
    """True when ``vector`` is finite; otherwise client ``client_id`` is reported to the run's
    non-finite log (:meth:`Context.finite_or_reported`; ``FloatingPointError`` under
    ``fail_on_nonfinite``) and left out of this round."""
    return ctx.finite_or_reported(client_id, vector, what)


def vector_row(vector: torch.Tensor, valid: bool) -> dict[str, torch.Tensor]:
    """The client's ``vector`` / ``valid`` rows (a zero vector when not valid), float64."""
    out = vector.detach().to(torch.float64).reshape(-1)
    if not valid:
        out = torch.zeros_like(out)
    return {"vector": out, "valid": torch.tensor([1.0 if valid else 0.0], dtype=torch.float64, device=out.device)}


def check_number(cfg, key: str, low: float | None = None, high: float | None = None, *,
                 low_open: bool = False, high_open: bool = False, integer: bool = False) -> float:
    """``cfg[key]`` as a number inside the given range, or ValueError naming
    ``algorithm.<key>``, its value and the allowed range."""
    value = cfg.get(key)
    lo = "" if low is None else ("(" if low_open else "[") + f"{low:g}"
    hi = "" if high is None else f"{high:g}" + (")" if high_open else "]")
    if low is not None and high is not None:
        allowed = f"{lo}, {hi}"
    elif low is not None:
        allowed = (">" if low_open else ">=") + f" {low:g}"
    else:
        allowed = ("<" if high_open else "<=") + f" {high:g}"
    kind = "an integer" if integer else "a number"
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if ok and integer and not float(value).is_integer():
        ok = False
    if ok:
        v = float(value)
        ok = v == v and abs(v) != float("inf")
        if ok and low is not None:
            ok = v > low if low_open else v >= low
        if ok and high is not None:
            ok = v < high if high_open else v <= high
    if not ok:
        rng = allowed if (low is None or high is None) else f"in {allowed}"
        raise ValueError(f"algorithm.{key}={value!r} must be {kind} {rng}")
    return int(value) if integer else float(value)
