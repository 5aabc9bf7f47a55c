"""The streamed log-space weighted sum equals the direct sum."""
from __future__ import annotations

import math

import torch

from fedfew.core.aggregation import LogWeightedSum
from fedfew.stch.scalarization import client_log_weights, stch_set


def test_streamed_sum_equals_direct_sum_for_stch_weights():
    torch.manual_seed(1)
    M, K, d, mu = 9, 3, 17, 0.02
    L = torch.rand(M, K, dtype=torch.float64) * 3
    deltas = torch.randn(M, K, d, dtype=torch.float64)
    res = stch_set(L, mu)
    acc = LogWeightedSum(K, d, dtype=torch.float64)
    a = client_log_weights(res.losses, mu)
    for i in torch.randperm(M).tolist():  # order must not matter
        for k in range(K):
            acc.add(k, float(a[i, k]), deltas[i, k])
    direct = torch.einsum("ik,ikd->kd", res.alpha[:, None] * res.w, deltas)
    torch.testing.assert_close(acc.result(float(res.g) / mu), direct, rtol=1e-10, atol=1e-12)


def test_huge_and_tiny_log_weights_do_not_overflow():
    acc = LogWeightedSum(2, 3)
    acc.add(0, 500.0, torch.ones(3))     # exp(500) overflows float32/float64 on its own
    acc.add(0, 500.0 + math.log(3.0), 2 * torch.ones(3))
    acc.add(1, -1e4, torch.ones(3))      # exp(-1e4) underflows
    out = acc.result(log_norm=500.0 + math.log(4.0))
    torch.testing.assert_close(out[0], torch.full((3,), (1 + 3 * 2) / 4.0))
    assert torch.equal(out[1], torch.zeros(3))  # underflowed weight: the model keeps its parameters


def test_empty_slot_gives_zero_update():
    acc = LogWeightedSum(2, 4)
    acc.add(0, 0.0, torch.ones(4))
    acc.add(1, -math.inf, torch.ones(4))
    out = acc.all_reduce_().result(0.0)
    assert torch.equal(out[1], torch.zeros(4)) and torch.equal(out[0], torch.ones(4))
