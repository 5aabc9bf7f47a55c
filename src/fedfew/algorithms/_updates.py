"""Pieces shared by the baselines whose server needs every participant's whole vector
(CFL: the updates' cosine similarities; FedMGDA+: their Gram matrix; FedAMP: the personal
models' distances), not only a weighted sum of them.

Such a vector travels as a gathered row of length d (``row_shapes`` entry ``(d,)``, float64,
on the training device): each rank writes its own clients' rows and one all-reduce gives the
(P, d) matrix in participant order on every rank (:func:`fedfew.core.distributed.gather_rows`).
That costs P x d float64 per round on each device: fine for the small models of these
baselines, heavy for a million-parameter model with hundreds of participants.

A client whose vector is not finite is reported (:meth:`fedfew.algorithms.base.Context.finite_or_reported`,
the one non-finite policy; ``FloatingPointError`` with ``fail_on_nonfinite``) and sends a zero row with
``valid = 0``; the server leaves it out.

The module name starts with ``_`` so the algorithm registry does not treat it as a method.
"""
from __future__ import annotations

from typing import Callable

import torch


def vector_rows(d: int) -> dict[str, Callable[[int], tuple[int, ...]]]:
    """``row_shapes`` entries for one (d,) vector and its validity flag per participant."""
    return {"vector": lambda K: (d,), "valid": lambda K: (1,)}


def vector_row(vector: torch.Tensor, valid: bool) -> dict[str, torch.Tensor]:
    """The client's ``vector`` / ``valid`` rows (a zero vector when not valid), float64."""
    out = vector.detach().to(torch.float64).reshape(-1)
    if not valid:
        out = torch.zeros_like(out)
    return {"vector": out, "valid": torch.tensor([1.0 if valid else 0.0], dtype=torch.float64, device=out.device)}
