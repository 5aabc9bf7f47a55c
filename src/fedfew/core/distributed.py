"""Collectives that are no-ops on a single process (Fabric's world of 1).

Rows of per-client results are exchanged by "sum of disjoint rows": each rank writes the
rows of its own clients into a zero (M, ...) tensor and one all-reduce(sum) gives the full
matrix in client order. That works for any split of clients over ranks, including ranks
with no client at all (M smaller than the world size), so no rank can hang waiting for
another's variable-sized message.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def all_reduce_(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """In-place all-reduce (``"sum"`` or ``"max"``) across ranks; identity on one process."""
    if world_size() > 1:
        dist.all_reduce(tensor, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op])
    return tensor


def gather_rows(rows: dict[int, torch.Tensor], num_rows: int, like: torch.Tensor) -> torch.Tensor:
    """Assemble per-client rows held by different ranks into one (num_rows, ...) tensor.

    Args:
        rows: this rank's rows, ``{row index: tensor of shape like.shape}``.
        num_rows: total number of rows M.
        like: a tensor with the shape, dtype and device of one row.
    Returns:
        (num_rows, *like.shape) tensor, identical on every rank.
    """
    out = torch.zeros((num_rows, *like.shape), dtype=like.dtype, device=like.device)
    for i, row in rows.items():
        out[i] = row
    return all_reduce_(out, "sum")


def merge_dicts(local: dict) -> dict:
    """The union of every rank's ``local`` dict (keys disjoint across ranks), on every rank.

    Used for per-client host state, which each rank keeps for its own clients only: a
    checkpoint written by rank 0 must hold every client's. Identity on one process.
    """
    if world_size() == 1:
        return local
    parts: list = [None] * world_size()
    dist.all_gather_object(parts, local)
    merged: dict = {}
    for part in parts:
        merged.update(part)
    return merged
