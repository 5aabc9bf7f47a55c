"""Streaming, exact weighted sums of client updates in log space.

The FedFew server step needs sum_i alpha_i w_ik d_ik, but alpha depends on every client's
losses, which are known only after every client has trained. Instead of keeping all M x K
deltas in memory, each delta is added as soon as it exists with its *unnormalised* log weight
a_ik (see :func:`fedfew.stch.scalarization.client_log_weights`), rescaling a running maximum as in
a streaming softmax; the global normaliser is applied once at the end. Memory is K x d per
rank whatever M is, and the result equals the direct sum up to float rounding.
"""
from __future__ import annotations

import math

import torch

from fedfew.core.distributed import all_reduce_


class LogWeightedSum:
    """Accumulates S_k = sum_i exp(a_ik) d_ik and W_k = sum_i exp(a_ik) for K slots without
    overflow or underflow.

    Internally S_k = exp(m_k) * acc_k and W_k = exp(m_k) * total_k, with m_k the running maximum
    of the a_ik added to slot k; so the weighted mean S_k / W_k = acc_k / total_k never under-
    or overflows, however small the slot's weights are (:meth:`mean`).

    Args:
        K: number of slots (models).
        dim: length d of each delta.
        device, dtype: where and how acc (K, d) is stored (float32 by default).
    """

    def __init__(self, K: int, dim: int, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
        self.log_scale = torch.full((K,), -math.inf, dtype=torch.float64)
        self.acc = torch.zeros((K, dim), device=device, dtype=dtype)
        self.total = torch.zeros(K, dtype=torch.float64)
        self.count = torch.zeros(K, dtype=torch.int64)

    def add(self, k: int, log_weight: float, delta: torch.Tensor) -> None:
        """Add exp(log_weight) * delta (shape (d,)) to slot k.

        Raises:
            ValueError: ``log_weight`` is NaN or +inf (a -inf weight adds nothing).
        """
        a = float(log_weight)
        if math.isnan(a) or a == math.inf:
            raise ValueError(f"log weight of slot {k} is {a}; it must be finite or -inf")
        if a == -math.inf:
            return
        m = float(self.log_scale[k])
        if a > m:
            self.acc[k].mul_(math.exp(m - a))  # exp(-inf) = 0 on the first add
            self.total[k] *= math.exp(m - a)
            self.log_scale[k] = a
            m = a
        self.acc[k].add_(delta.to(self.acc.dtype), alpha=math.exp(a - m))
        self.total[k] += math.exp(a - m)
        self.count[k] += 1

    def all_reduce_(self) -> "LogWeightedSum":
        """Combine the partial sums of every rank (two all-reduces: max, then sum)."""
        # collectives run on the accumulator's device (NCCL cannot reduce host tensors)
        local = self.log_scale.to(self.acc.device)
        shared = all_reduce_(local.clone(), "max")
        factor = torch.where(torch.isfinite(local), (local - shared).exp(), torch.zeros_like(local))
        self.acc.mul_(factor.to(self.acc.dtype)[:, None])
        total = self.total.to(self.acc.device) * factor.to(torch.float64)
        self.log_scale = shared.cpu()
        all_reduce_(self.acc, "sum")
        self.total = all_reduce_(total, "sum").cpu()
        self.count = all_reduce_(self.count.to(self.acc.device), "sum").cpu()
        return self

    def result(self, log_norm: float) -> torch.Tensor:
        """(K, d) tensor exp(-log_norm) * S_k; a slot with no finite weight, or whose total
        weight underflows, is exactly 0 (so the model keeps its parameters)."""
        scale = torch.where(
            torch.isfinite(self.log_scale), (self.log_scale - log_norm).exp(), torch.zeros_like(self.log_scale)
        )
        return self.acc * scale.to(self.acc.device, self.acc.dtype)[:, None]

    def mean(self) -> torch.Tensor:
        """(K, d) weighted means S_k / W_k = sum_i exp(a_ik) d_ik / sum_i exp(a_ik); a slot that
        received no finite weight is exactly 0 (the model keeps its parameters)."""
        scale = torch.where(self.total > 0, 1.0 / self.total.clamp_min(1e-300), torch.zeros_like(self.total))
        return self.acc * scale.to(self.acc.device, self.acc.dtype)[:, None]
