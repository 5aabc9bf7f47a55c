"""Scale-free mu (issue 15): with mu_scale=relative the STCH-Set weights do not depend on M,
the reference setting reproduces the reference code's weights, and a 3 x 2 case by hand."""
from __future__ import annotations

import math

import pytest
import torch

from fedfew.core.aggregation import LogWeightedSum
from fedfew.stch.scalarization import stch_set


def _clients(M: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(M, 3, generator=g, dtype=torch.float64) * 2, torch.randint(20, 200, (M,), generator=g)


@pytest.mark.parametrize("weighting", ["samples", "none"])
def test_relative_weights_unchanged_when_every_client_is_duplicated(weighting):
    """Doubling M by duplicating every client leaves w unchanged and each client's alpha split
    evenly between its two copies (so the server step, sum_i alpha_i w_ik d_ik, is unchanged)."""
    L, n = _clients(7)
    one = stch_set(L, 0.2, n, weighting, "relative")
    two = stch_set(torch.cat([L, L]), 0.2, torch.cat([n, n]), weighting, "relative")
    torch.testing.assert_close(two.w[:7], one.w)
    torch.testing.assert_close(two.w[7:], one.w)
    torch.testing.assert_close(two.alpha[:7] + two.alpha[7:], one.alpha)
    torch.testing.assert_close(two.alpha[:7], two.alpha[7:])


def test_reference_scale_is_not_invariant_to_duplication():
    """The reference's p_i halves when M doubles: its temperature doubles and w changes."""
    L, n = _clients(7)
    one = stch_set(L, 0.01, n, "samples", "reference")
    two = stch_set(torch.cat([L, L]), 0.01, torch.cat([n, n]), "samples", "reference")
    assert not torch.allclose(two.w[:7], one.w, atol=1e-3)


def test_reference_setting_gives_the_reference_weights():
    """pgg3/FedFew: L'_ik = (n_i / sum_j n_j) L_ik, w = softmax_k(-L'/mu), alpha_i proportional to
    1 / sum_k exp(-L'_ik / mu), written out with plain exp (no log-space) on a well-scaled case."""
    L, n = _clients(5)
    mu = 0.01
    p = n.double() / n.sum()
    Lp = L * p[:, None]
    S = torch.exp(-Lp / mu).sum(dim=1)
    w_ref = torch.exp(-Lp / mu) / S[:, None]
    alpha_ref = (1 / S) / (1 / S).sum()
    res = stch_set(L, mu, n, "samples", "reference")
    torch.testing.assert_close(res.w, w_ref)
    torch.testing.assert_close(res.alpha, alpha_ref)
    torch.testing.assert_close(res.g, mu * torch.log((1 / S).sum()))


def test_three_clients_two_models_by_hand():
    """L = [[1, 2], [2, 1], [3, 3]], n = [10, 10, 40] (mean 20, weights 0.5, 0.5, 2), mu = 1:
    L' = [[0.5, 1], [1, 0.5], [6, 6]].
    w_1 = [1, e^-0.5] / (1 + e^-0.5), w_2 its mirror, w_3 = [1/2, 1/2];
    S_i = sum_k e^{-L'_ik}: S_1 = S_2 = e^-0.5 + e^-1, S_3 = 2 e^-6; alpha ~ 1 / S."""
    L = torch.tensor([[1.0, 2.0], [2.0, 1.0], [3.0, 3.0]], dtype=torch.float64)
    n = torch.tensor([10, 10, 40])
    res = stch_set(L, 1.0, n, "samples", "relative")
    a = 1 / (1 + math.exp(-0.5))
    torch.testing.assert_close(res.w, torch.tensor([[a, 1 - a], [1 - a, a], [0.5, 0.5]], dtype=torch.float64))
    inv = torch.tensor([1 / (math.exp(-0.5) + math.exp(-1))] * 2 + [1 / (2 * math.exp(-6))], dtype=torch.float64)
    torch.testing.assert_close(res.alpha, inv / inv.sum())
    # the struggling third client (loss 3 on both models, and the largest) dominates alpha
    assert float(res.alpha[2]) > 0.98


def test_log_weighted_sum_mean_is_the_weighted_mean_even_when_weights_underflow():
    """mean() = sum_i exp(a_i) d_i / sum_i exp(a_i), exact for weights far below float64's range."""
    acc = LogWeightedSum(K=2, dim=3, dtype=torch.float64)
    d = torch.tensor([[1.0, 0.0, 2.0], [3.0, 1.0, 0.0], [0.0, 4.0, 4.0]], dtype=torch.float64)
    logs = [-2000.0, -2001.0, -2003.0]  # exp underflows to 0 in float64
    for a, delta in zip(logs, d):
        acc.add(0, a, delta)
    acc.add(1, 5.0, d[0])
    w = torch.softmax(torch.tensor(logs, dtype=torch.float64), dim=0)
    torch.testing.assert_close(acc.mean()[0], (w[:, None] * d).sum(dim=0))
    torch.testing.assert_close(acc.mean()[1], d[0])
    assert float(acc.result(0.0)[0].abs().max()) == 0.0  # the unnormalised sum underflows
