"""Local training and evaluation of one model on one client's samples."""
from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from fedfew.data.base import FederatedData
from fedfew.core.model_set import KModelSet, has_batch_norm


def batch_bounds(n: int, batch_size: int, merge_single: bool = False) -> list[tuple[int, int]]:
    """The batches of one local epoch over ``n`` samples: ``(start, end)`` slices of the epoch's
    order, ``batch_size`` each, the last one partial (kept, so clients smaller than a batch still
    train).

    With ``merge_single`` (models with BatchNorm, see :func:`fedfew.core.model_set.has_batch_norm`), a
    final batch of exactly one sample is merged into the previous batch, which then holds
    ``batch_size + 1`` samples: BatchNorm cannot normalise a batch of one in train mode
    ("Expected more than 1 value per channel when training"), and merging keeps every sample
    visited once per epoch. E.g. n = 33, B = 32: one batch of 33 (without BatchNorm: 32 + 1).
    The same rule is used by ``engine=loop`` (:func:`train_local`), ``engine=vmap`` and the
    baselines that write their own step loop (APFL, FedRep's head phase).

    Args:
        n: samples in the epoch (>= 0). batch_size: B >= 1.
        merge_single: merge a final one-sample batch into the previous one.
    Returns:
        consecutive ``(start, end)`` pairs covering ``[0, n)``; empty for n = 0.
    Raises:
        ValueError: ``merge_single`` and n = 1 (a client with one train sample cannot train a
            BatchNorm model).
    """
    if merge_single and n == 1:
        raise ValueError("a client with a single train sample cannot train a model with BatchNorm "
                         "(a batch of one has no batch statistics); use a partition that gives every client "
                         ">= 2 train samples, or a model without BatchNorm (model.norm=none)")
    bounds = [(start, min(start + batch_size, n)) for start in range(0, n, batch_size)]
    if merge_single and len(bounds) > 1 and bounds[-1][1] - bounds[-1][0] == 1:
        bounds[-2:] = [(bounds[-2][0], n)]
    return bounds


def train_local(
    module: KModelSet,
    data: FederatedData,
    index: torch.Tensor,
    epochs: int,
    batch_size: int,
    seed: int,
    penalty: Callable[[nn.Module], torch.Tensor] | None = None,
    autocast=None,
    forward: Callable[[torch.Tensor], torch.Tensor] | None = None,
    sample_weight: torch.Tensor | None = None,
) -> float:
    """Train ``module.working`` in place with SGD on the samples ``index``.

    One fresh optimizer (``module.configure_optimizers()``) per call; each epoch visits every
    sample once in a random order (the last, partial batch is kept, unlike PFLlib's
    ``drop_last=True``, so clients smaller than a batch still train; with BatchNorm a final
    batch of one sample is merged into the previous batch, :func:`batch_bounds`; the order is
    :meth:`FederatedData.epoch_order`, length-grouped for text with ``group_by_length``). Shuffling and dropout
    draw from ``seed`` only, so the result does not depend on which rank trains the client.

    Args:
        module: the K-model set; its ``working`` copy is trained.
        data: pooled tensors (on the training device).
        index: (n,) int64 sample indices of the client's train split (same device).
        epochs: local epochs E >= 1.
        batch_size: B >= 1.
        seed: stream for shuffling and dropout.
        penalty: optional extra term added to the loss (e.g. a proximal term); it is not
            part of the returned loss.
        autocast: optional context-manager factory (Fabric's ``autocast``) for mixed precision.
        forward: optional replacement of ``module.working``'s forward with the same parameters
            (e.g. its ``torch.compile``-d version); the loss is then its mean cross-entropy.
        sample_weight: optional (N,) float32 weight q_s of every pooled sample (only those of
            ``index`` are read): the minibatch loss is then (1/|B|) sum_{s in B} q_s l_s, FedEM's
            responsibility-weighted M-step (Marfoq et al. 2021); with every q_s = 1 the same steps.
    Returns:
        the running loss: sample-weighted mean of the minibatch cross-entropies of the last
        epoch (the reference's ``running`` loss source), as a Python float.
    Raises:
        ValueError: a model with BatchNorm and a client with one train sample (:func:`batch_bounds`).
    """
    model = module.working
    model.train()
    optimizer = module.configure_optimizers()
    torch.manual_seed(seed)
    n = index.numel()
    bounds = batch_bounds(n, batch_size, merge_single=has_batch_norm(model))
    running = torch.zeros((), device=index.device)
    for _ in range(epochs):
        order = data.epoch_order(index, batch_size)
        running = torch.zeros((), device=index.device)
        for start, end in bounds:
            chunk = order[start:end]
            x, y = data.batch(chunk)
            with autocast() if autocast is not None else contextlib.nullcontext():
                if sample_weight is None:
                    loss = module.training_step((x, y)) if forward is None else F.cross_entropy(forward(x), y)
                else:
                    per_sample = F.cross_entropy(model(x), y, reduction="none")
            if sample_weight is not None:
                loss = (per_sample.float() * sample_weight[chunk]).mean()
            total = loss if penalty is None else loss + penalty(model)
            optimizer.zero_grad(set_to_none=True)
            total.backward()
            optimizer.step()
            running += loss.detach().float() * y.numel()
    return float(running) / max(n, 1)


@torch.no_grad()
def evaluate_model(
    model: nn.Module, data: FederatedData, index: torch.Tensor, batch_size: int = 1024
) -> tuple[float, int]:
    """Eval-mode mean cross-entropy and number of correct predictions on ``index``.

    Args:
        model: any classifier (B, ...) -> (B, C).
        data: pooled tensors. index: (n,) sample indices.
    Returns:
        (mean loss as float, correct count as int); (nan, 0) for an empty index.
    """
    was_training = model.training
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64, device=index.device)
    correct = torch.zeros((), dtype=torch.int64, device=index.device)
    for start in range(0, index.numel(), batch_size):
        x, y = data.batch(index[start : start + batch_size])
        logits = model(x).float()
        loss_sum += F.cross_entropy(logits, y, reduction="sum").double()
        correct += (logits.argmax(dim=1) == y).sum()
    model.train(was_training)
    n = index.numel()
    return (float(loss_sum) / n if n else float("nan")), int(correct)
