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

Units of mu (``mu_scale``). The reference code multiplies L_ik by p_i = n_i / sum_j n_j before
the softmaxes, so its mu is a temperature in units of p_i * loss: about loss / M, i.e. the same
mu = 0.01 is a temperature of ~0.2 nats at M = 20 and ~10 nats at M = 1000. With
``mu_scale="relative"`` (our default) the sample weights are divided by their mean,
L'_ik = (n_i / mean_j n_j) L_ik, so mu is a temperature in nats of loss for a client of average
size, whatever M; with ``sample_weighting="none"`` the weights are 1 and mu is in nats as well.
Duplicating every client then leaves w and the relative weights alpha_i / alpha_j unchanged.
``mu_scale="reference"`` keeps the reference's p_i (its mu = 0.01 equals relative mu = 0.01 * M
for equal client sizes).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

SAMPLE_WEIGHTINGS = ("none", "samples")
MU_SCALES = ("relative", "reference")


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
    losses: torch.Tensor, num_samples: torch.Tensor | None, sample_weighting: str, mu_scale: str = "relative"
) -> torch.Tensor:
    """Apply the client-size weighting to the loss matrix (see the module doc on mu's units).

    Args:
        losses: (M, K) losses L_ik (nats).
        num_samples: (M,) client sizes n_i (needed for ``"samples"``).
        sample_weighting: ``"none"`` (L unchanged, the paper's text) or ``"samples"`` (L_ik
            weighted by the client's size, the reference code pgg3/FedFew).
        mu_scale: with ``"samples"``: ``"relative"`` weights by n_i / mean_j n_j (mean weight 1,
            so mu stays in nats for any M), ``"reference"`` by p_i = n_i / sum_j n_j (the
            reference's; mu's meaning then changes with M).
    Returns:
        (M, K) float32 (or wider) losses L'.
    Raises:
        ValueError: unknown weighting or scale, or ``"samples"`` without valid sizes.
    """
    losses = losses.float() if losses.dtype not in (torch.float32, torch.float64) else losses
    if mu_scale not in MU_SCALES:
        raise ValueError(f"algorithm.mu_scale={mu_scale!r}; allowed: {', '.join(MU_SCALES)}")
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
    weight = n / n.mean() if mu_scale == "relative" else n / n.sum()
    return losses * weight[:, None]


def stch_set(
    losses: torch.Tensor,
    mu: float,
    num_samples: torch.Tensor | None = None,
    sample_weighting: str = "none",
    mu_scale: str = "relative",
) -> STCHWeights:
    """STCH-Set objective and gradient weights from a loss matrix, in log space.

    Args:
        losses: (M, K) loss of model k on client i (any float dtype; computed in float32,
            float64 kept).
        mu: smoothing parameter, > 0. The approximation error of ``g`` against
            ``max_i min_k L_ik`` is at most ``mu * (log M + log K)``.
        num_samples: (M,) client sizes n_i, for ``sample_weighting="samples"``.
        sample_weighting: ``"none"`` or ``"samples"`` (see :func:`weight_losses`).
        mu_scale: ``"relative"`` or ``"reference"`` (see :func:`weight_losses`).
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
    scaled = weight_losses(losses, num_samples, sample_weighting, mu_scale)
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
    """The STCH-Set objective g alone, differentiable w.r.t. ``losses``:

        g = mu * logsumexp_i( -logsumexp_k(-L_ik / mu) ) = mu * log sum_i exp(smin_k L_ik / mu),

    so that d g / d L_ik = alpha_i * w_ik (the weights of :func:`stch_set`, which sum to 1).

    Computed in log space and, like :func:`stch_set`, in float32 or wider: float16/bfloat16
    losses are upcast to float32 first (in float16, L / mu overflows to inf above 65504, e.g.
    L = 300 at mu = 1e-3, and rounding breaks the weights' sum), float64 is kept. The gradient
    flows back to ``losses`` in their own dtype.

    Args:
        losses: (M, K) losses L_ik of model k on client i (nats), any float dtype.
        mu: smoothing parameter, a finite number > 0 (same units as the losses).
    Returns:
        () tensor g, float32 (float64 for float64 losses).
    Raises:
        ValueError: ``mu`` not a finite number > 0; ``losses`` not an (M, K) matrix with
            M, K >= 1; a non-finite loss (the message lists the (client, model) entries).

    Source: FedFew paper, STCH-Set objective (the ``g`` of :func:`stch_set`).
    """
    mu = float(mu)
    if not (mu > 0) or mu == float("inf"):
        raise ValueError(f"algorithm.mu must be a finite number > 0, got {mu}")
    if losses.ndim != 2 or losses.shape[0] == 0 or losses.shape[1] == 0:
        raise ValueError(f"losses must be an (M, K) matrix with M, K >= 1, got shape {tuple(losses.shape)}")
    if not bool(torch.isfinite(losses).all()):
        bad = torch.nonzero(~torch.isfinite(losses.detach())).tolist()
        raise ValueError(f"losses must be finite; non-finite entries at (client, model) {bad[:10]}")
    wide = losses if losses.dtype in (torch.float32, torch.float64) else losses.float()
    return mu * torch.logsumexp(-torch.logsumexp(-wide / mu, dim=1), dim=0)


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
