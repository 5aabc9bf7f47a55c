"""Smooth Tchebycheff set scalarization (STCH-Set) and its gradient weights.

FedFew (CVPR 2026, "Few-for-Many Personalized Federated Learning") trains K shared models
for M clients by minimising, with lambda_i = 1 and ideal point z*_i = 0,

    g(Theta) = mu * log sum_i exp( smin_k L_ik / mu ),
    smin_k x_k = -mu * log sum_k exp(-x_k / mu),

whose gradient is d g / d theta_k = sum_i alpha_i * w_ik * grad L_ik with

    w_ik    = softmax_k(-L_ik / mu)         (soft model selection; rows sum to 1)
    alpha_i = softmax_i(smin_k L_ik / mu)   (weight on struggling clients; sums to 1).

Everything is computed in log space (logsumexp / log_softmax) so that losses with
L/mu >> 87 (exp underflow in float32) stay finite, and always in float32 or wider, whatever
the input dtype (bfloat16 losses from mixed precision are upcast first).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

SAMPLE_WEIGHTINGS = ("none", "samples")


@dataclass(frozen=True)
class STCHWeights:
    """Result of :func:`stch_set`.

    Attributes:
        g: () the smoothed objective mu * log sum_i exp(smin_k L'_ik / mu).
        alpha: (M,) client weights, non-negative, sum to 1.
        w: (M, K) client-model weights, non-negative, rows sum to 1.
        smin: (M,) smooth minimum over models per client, smin_k L'_ik.
        log_weight: (M, K) log(alpha_i * w_ik), the log of the server step's weight on
            d_ik; finite even where alpha_i * w_ik underflows to 0.
        losses: (M, K) the (possibly sample-weighted) losses L' actually scalarised.
    """

    g: torch.Tensor
    alpha: torch.Tensor
    w: torch.Tensor
    smin: torch.Tensor
    log_weight: torch.Tensor
    losses: torch.Tensor


def weight_losses(
    losses: torch.Tensor, num_samples: torch.Tensor | None, sample_weighting: str
) -> torch.Tensor:
    """Apply the sample weighting of the reference code to the loss matrix.

    Args:
        losses: (M, K) losses L_ik.
        num_samples: (M,) client sizes n_i (needed for ``"samples"``).
        sample_weighting: ``"none"`` (L unchanged, the paper's text) or ``"samples"``
            (L_ik * p_i with p_i = n_i / sum_j n_j, the reference code pgg3/FedFew).
    Returns:
        (M, K) float32 (or wider) losses.
    Raises:
        ValueError: unknown weighting, or ``"samples"`` without valid sizes.
    """
    losses = losses.float() if losses.dtype not in (torch.float32, torch.float64) else losses
    if sample_weighting == "none":
        return losses
    if sample_weighting != "samples":
        raise ValueError(
            f"algorithm.sample_weighting={sample_weighting!r}; allowed: {', '.join(SAMPLE_WEIGHTINGS)}"
        )
    if num_samples is None or len(num_samples) != losses.shape[0]:
        raise ValueError("sample_weighting='samples' needs num_samples of length M (one size per client)")
    n = torch.as_tensor(num_samples, dtype=losses.dtype, device=losses.device)
    if bool((n <= 0).any()):
        raise ValueError(f"num_samples must be positive, got {n.tolist()}")
    return losses * (n / n.sum())[:, None]


def stch_set(
    losses: torch.Tensor,
    mu: float,
    num_samples: torch.Tensor | None = None,
    sample_weighting: str = "none",
) -> STCHWeights:
    """STCH-Set objective and gradient weights from a loss matrix, in log space.

    Args:
        losses: (M, K) loss of model k on client i (any float dtype; computed in float32,
            float64 kept).
        mu: smoothing parameter, > 0. The approximation error of ``g`` against
            ``max_i min_k L_ik`` is at most ``mu * (log M + log K)``.
        num_samples: (M,) client sizes n_i, for ``sample_weighting="samples"``.
        sample_weighting: ``"none"`` or ``"samples"`` (see :func:`weight_losses`).
    Returns:
        :class:`STCHWeights` with g, alpha (M), w (M, K).
    Raises:
        ValueError: ``mu <= 0`` or not finite, ``losses`` not 2-D / empty / not finite.

    Source: FedFew paper, STCH-Set objective and its gradient; reference code pgg3/FedFew
    (``serverfedfew.py``) for the ``samples`` weighting.
    """
    mu = float(mu)
    if not (mu > 0) or mu == float("inf"):
        raise ValueError(f"algorithm.mu must be a finite number > 0, got {mu}")
    if losses.ndim != 2 or losses.shape[0] == 0 or losses.shape[1] == 0:
        raise ValueError(f"losses must be an (M, K) matrix with M, K >= 1, got shape {tuple(losses.shape)}")
    if not bool(torch.isfinite(losses).all()):
        bad = torch.nonzero(~torch.isfinite(losses)).tolist()
        raise ValueError(f"losses must be finite; non-finite entries at (client, model) {bad[:10]}")
    scaled = weight_losses(losses, num_samples, sample_weighting)
    neg = -scaled / mu                                      # (M, K)
    log_w = torch.log_softmax(neg, dim=1)                   # log w_ik
    smin_over_mu = -torch.logsumexp(neg, dim=1)             # smin_k L_ik / mu = -log S_i
    log_alpha = torch.log_softmax(smin_over_mu, dim=0)      # log alpha_i
    g = mu * torch.logsumexp(smin_over_mu, dim=0)
    return STCHWeights(
        g=g,
        alpha=log_alpha.exp(),
        w=log_w.exp(),
        smin=mu * smin_over_mu,
        log_weight=log_alpha[:, None] + log_w,
        losses=scaled,
    )


def stch_value(losses: torch.Tensor, mu: float) -> torch.Tensor:
    """The STCH-Set objective g alone, differentiable w.r.t. ``losses``.

    Args:
        losses: (M, K) losses. mu: > 0.
    Returns:
        () tensor g = mu * logsumexp_i(-logsumexp_k(-L_ik / mu)).
    """
    return mu * torch.logsumexp(-torch.logsumexp(-losses / mu, dim=1), dim=0)


def client_log_weights(scaled_losses: torch.Tensor, mu: float) -> torch.Tensor:
    """Unnormalised log server-step weights of one client, computable before the others train.

    log(alpha_i * w_ik) = a_ik - g / mu with a_ik = -L'_ik / mu + 2 * smin_k(L'_ik) / mu,
    where g is :func:`stch_set`'s objective over all clients (the only global quantity).

    Args:
        scaled_losses: (K,) or (M, K) losses after sample weighting (``STCHWeights.losses``).
        mu: smoothing, > 0.
    Returns:
        tensor of the same shape, float64.
    """
    neg = -scaled_losses.double() / mu
    smin_over_mu = -torch.logsumexp(neg, dim=-1, keepdim=True)
    return neg + 2.0 * smin_over_mu
