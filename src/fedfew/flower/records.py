"""What travels between the fedfew ServerApp and ClientApp, as Flower records.

Every payload is a :class:`flwr.app.RecordDict` of typed records (Flower's Message API):

- tensors (server models' state vectors, a client's rows and deltas) go in an
  :class:`~flwr.app.ArrayRecord`, one :class:`~flwr.app.Array` per tensor, keyed by name; the
  dtype travels with the array (NumPy's ``.npy`` format, never pickled), so float64 rows and
  float32 state vectors arrive bit for bit;
- scalars, lists of scalars and strings (round, client id, participants, the run config as YAML,
  error text) go in a :class:`~flwr.app.ConfigRecord`;
- structured server state that is neither (an algorithm's ``state_dict()``: FedFew's mu and last
  best losses) travels as ``torch.save`` bytes inside the ConfigRecord and is read back with
  ``torch.load(weights_only=True)``: tensors, numbers, strings, lists and dicts only, no code;
- counts and timings a client reports (``num-examples``, local steps, seconds) go in a
  :class:`~flwr.app.MetricRecord`.
"""
from __future__ import annotations

import io
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord

__all__ = ["to_record", "from_record", "pack", "unpack"]


def to_record(tensors: dict[str, torch.Tensor]) -> ArrayRecord:
    """An ArrayRecord holding ``tensors`` (detached CPU copies, dtype and shape kept).

    Args:
        tensors: name -> tensor of any shape; names must be non-empty strings.
    """
    record = ArrayRecord()
    for name, value in tensors.items():
        record[name] = Array(np.ascontiguousarray(value.detach().cpu().numpy()))
    return record


def from_record(record: ArrayRecord) -> dict[str, torch.Tensor]:
    """The tensors of an ArrayRecord (:func:`to_record`'s inverse), in the record's order, on the CPU."""
    return {name: torch.from_numpy(np.array(array.numpy(), copy=True)) for name, array in record.items()}


def pack(value: Any) -> bytes:
    """``torch.save`` bytes of ``value`` (tensors, numbers, strings, None, lists, tuples, dicts)."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def unpack(data: bytes) -> Any:
    """:func:`pack`'s inverse, restricted to plain data (``weights_only=True``: no code is run)."""
    return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
