"""STCH-Set weights: against autograd, the smoothing bound, and numerical extremes."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedfew.stch.scalarization import client_log_weights, stch_set, stch_value, weight_losses


@pytest.mark.parametrize("M,K,mu", [(5, 3, 0.5), (20, 3, 0.01), (7, 1, 1.0), (3, 4, 2.0)])
def test_gradient_of_g_equals_alpha_times_w(M, K, mu):
    torch.manual_seed(M * 10 + K)
    losses = (torch.rand(M, K, dtype=torch.float64) * 3).requires_grad_(True)
    stch_value(losses, mu).backward()
    weights = stch_set(losses.detach(), mu)
    expected = weights.alpha[:, None] * weights.w
    torch.testing.assert_close(losses.grad, expected, rtol=1e-10, atol=1e-12)
    assert math.isclose(float(weights.g), float(stch_value(losses.detach(), mu)), rel_tol=1e-12)
    torch.testing.assert_close(weights.alpha.sum(), torch.tensor(1.0, dtype=torch.float64))
    torch.testing.assert_close(weights.w.sum(dim=1), torch.ones(M, dtype=torch.float64))


def test_hand_computed_two_by_two():
    # L = [[1, 2], [3, 0.5]], mu = 1: w rows are softmax(-L); alpha ∝ 1 / sum_k exp(-L_ik)
    L = torch.tensor([[1.0, 2.0], [3.0, 0.5]], dtype=torch.float64)
    S = torch.exp(-L).sum(dim=1)
    w = torch.exp(-L) / S[:, None]
    alpha = (1 / S) / (1 / S).sum()
    g = math.log(float((1 / S).sum()))
    res = stch_set(L, 1.0)
    torch.testing.assert_close(res.w, w)
    torch.testing.assert_close(res.alpha, alpha)
    assert math.isclose(float(res.g), g, rel_tol=1e-12)


@given(
    M=st.integers(1, 30), K=st.integers(1, 6),
    mu=st.sampled_from([1.0, 0.1, 0.01, 1e-3, 1e-4]), seed=st.integers(0, 10_000),
)
@settings(max_examples=60, deadline=None)
def test_g_approaches_max_min_within_bound(M, K, mu, seed):
    gen = torch.Generator().manual_seed(seed)
    losses = torch.rand(M, K, generator=gen, dtype=torch.float64) * 5
    target = float(losses.min(dim=1).values.max())
    g = float(stch_set(losses, mu).g)
    bound = mu * (math.log(M) + math.log(K))
    assert abs(g - target) <= bound + 1e-9


def test_extreme_losses_float32_no_nan():
    res = stch_set(torch.tensor([[20.0, 25.0]], dtype=torch.float32), mu=0.1)
    assert res.w.dtype == torch.float32
    assert torch.isfinite(res.w).all() and torch.isfinite(res.alpha).all() and torch.isfinite(res.g)
    assert float(res.w[0, 0]) == pytest.approx(1.0)
    # exp(-50) = 1.93e-22: representable in float32 as a normal number
    assert float(res.w[0, 1]) == pytest.approx(math.exp(-50), rel=1e-3)
    assert float(res.w.sum()) == pytest.approx(1.0)
    # the naive formula underflows to 0/0 here
    naive = torch.exp(torch.tensor([-200.0, -250.0])) / torch.exp(torch.tensor([-200.0, -250.0])).sum()
    assert torch.isnan(naive).all()


def test_tiny_mu_and_bfloat16_stay_finite():
    losses = (torch.rand(10, 3) * 4).to(torch.bfloat16)
    res = stch_set(losses, mu=1e-4)
    for t in (res.g, res.alpha, res.w, res.log_weight):
        assert torch.isfinite(t).all()
    assert res.w.dtype == torch.float32  # computed in float32 whatever the input
    assert float(res.alpha.sum()) == pytest.approx(1.0, abs=1e-6)
    torch.testing.assert_close(res.w.sum(dim=1), torch.ones(10))


def test_single_model_gives_w_one():
    res = stch_set(torch.tensor([[0.3], [2.0], [1.1]]), mu=0.01)
    torch.testing.assert_close(res.w, torch.ones(3, 1))
    # K = 1: smin is the identity, so alpha is softmax(L / mu)
    torch.testing.assert_close(res.alpha, torch.softmax(torch.tensor([0.3, 2.0, 1.1]) / 0.01, dim=0))


def test_sample_weighting_scales_losses_by_client_share():
    """mu_scale=reference: L_ik * n_i / sum_j n_j (pgg3/FedFew); relative: L_ik * n_i / mean_j n_j."""
    L = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    n = torch.tensor([30, 10])
    scaled = weight_losses(L, n, "samples", "reference")
    torch.testing.assert_close(scaled, torch.tensor([[0.75, 1.5], [0.75, 1.0]]))
    res = stch_set(L, 0.5, n, "samples", "reference")
    torch.testing.assert_close(res.w, torch.softmax(-scaled / 0.5, dim=1))
    torch.testing.assert_close(weight_losses(L, n, "samples", "relative"), torch.tensor([[1.5, 3.0], [1.5, 2.0]]))


@pytest.mark.parametrize("mu", [0.0, -1.0, float("nan"), float("inf")])
def test_invalid_mu_rejected(mu):
    with pytest.raises(ValueError, match="algorithm.mu"):
        stch_set(torch.ones(2, 2), mu)


def test_non_finite_losses_rejected_naming_entry():
    with pytest.raises(ValueError, match=r"\[\[1, 0\]\]"):
        stch_set(torch.tensor([[1.0, 2.0], [float("nan"), 1.0]]), 0.1)
    with pytest.raises(ValueError, match="sample_weighting"):
        stch_set(torch.ones(2, 2), 0.1, torch.ones(2), "bogus")


def test_client_log_weights_match_global_log_weight():
    torch.manual_seed(0)
    L = torch.rand(6, 3, dtype=torch.float64) * 2
    mu = 0.05
    res = stch_set(L, mu)
    local = client_log_weights(res.losses, mu)
    torch.testing.assert_close(local - float(res.g) / mu, res.log_weight)
    torch.testing.assert_close((local - float(res.g) / mu).exp(), res.alpha[:, None] * res.w)


# ----------------------------------------------------------------------------- stch_value (dtype, checks)
@pytest.mark.parametrize("shape", [(3, 1), (1, 3)])
def test_stch_value_fp16_losses_are_upcast(shape):
    """fp16 losses [300, 2.3, 2.3] at mu = 1e-3: L / mu = 3e5 overflows fp16 (max 65504), so the
    objective must be computed in float32. (3, 1): three clients, one model -> alpha = [1, 0, 0];
    (1, 3): one client, three models -> w = [0, 1/2, 1/2] (2.3 rounds to the same fp16 value)."""
    mu = 1e-3
    values = torch.tensor([300.0, 2.3, 2.3], dtype=torch.float16)
    assert torch.isinf(-values.reshape(shape) / mu).any()  # what the fp16 computation would meet
    losses = values.reshape(shape).clone().requires_grad_(True)
    g = stch_value(losses, mu)
    assert g.dtype == torch.float32 and bool(torch.isfinite(g))
    exact = losses.detach().double()  # the fp16 values, exactly
    if shape == (3, 1):  # g = mu * log sum_i exp(L_i / mu) = 300 + mu * log(1 + 2 exp(-(300 - 2.30078125) / mu))
        expected, weights = 300.0, [[1.0], [0.0], [0.0]]
    else:  # g = -mu * log sum_k exp(-L_k / mu) = 2.30078125 + mu * log(1 / 2) (the 300 term is exp(-3e5))
        expected, weights = 2.30078125 - mu * math.log(2.0), [[0.0, 0.5, 0.5]]
    assert float(exact.flatten()[1]) == 2.30078125
    assert float(g.detach()) == pytest.approx(expected, rel=1e-6)
    g.backward()
    assert losses.grad.dtype == torch.float16
    assert losses.grad.double().tolist() == weights
    assert float(losses.grad.double().sum()) == 1.0
    ref = stch_set(exact, mu)  # float64 weights alpha_i * w_ik
    torch.testing.assert_close(losses.grad.double(), ref.alpha[:, None] * ref.w, rtol=0, atol=1e-3)


def test_stch_value_keeps_float64_and_bf16_weights_sum_to_one():
    L = torch.tensor([[1.0, 2.0], [3.0, 0.5]], dtype=torch.float64)
    S = torch.exp(-L).sum(dim=1)  # hand value, mu = 1: g = log sum_i 1 / S_i
    assert stch_value(L, 1.0).dtype == torch.float64
    assert math.isclose(float(stch_value(L, 1.0)), math.log(float((1 / S).sum())), rel_tol=1e-12)
    bf = torch.tensor([[150.0, 2.0], [3.0, 0.5]], dtype=torch.bfloat16, requires_grad=True)
    stch_value(bf, 1e-2).backward()
    assert float(bf.grad.double().sum()) == pytest.approx(1.0, abs=1e-2)


@pytest.mark.parametrize("bad", [[[float("nan"), 1.0]], [[float("inf")], [float("inf")]], [[1.0], [float("-inf")]]])
def test_stch_value_rejects_non_finite_losses(bad):
    with pytest.raises(ValueError, match="non-finite entries at"):
        stch_value(torch.tensor(bad), 0.1)


@pytest.mark.parametrize("mu", [0.0, -1.0, float("nan"), float("inf")])
def test_stch_value_rejects_bad_mu(mu):
    with pytest.raises(ValueError, match="algorithm.mu"):
        stch_value(torch.ones(2, 2), mu)


@pytest.mark.parametrize("shape", [(3,), (0, 2), (2, 0), (1, 2, 2)])
def test_stch_value_rejects_non_matrix(shape):
    with pytest.raises(ValueError, match=r"\(M, K\) matrix"):
        stch_value(torch.ones(shape), 0.1)
