"""Client groups with known structure: the data side of ``partition=clustered``.

Each of G groups of clients sees the data through its own transform, so that the clients of
one group share a task and clients of different groups do not (IFCA's rotated MNIST, Ghosh et
al. 2020, "An Efficient Framework for Clustered Federated Learning"). Few-for-many methods
should recover the groups: K = G models, one per group, and the model assignment should match
the true groups (adjusted Rand index 1).

``group_transform`` (a key of :data:`GROUP_TRANSFORMS`):

- ``rotate``: group g's images are rotated by g x 90 degrees counter-clockwise (``torch.rot90``
  on the last two axes; G <= 4; square images, or flat inputs whose loader declares
  ``image_shape``, as digits does: (8, 8)). Labels unchanged.
- ``permute_labels``: group g relabels class c as pi_g(c), pi_0 the identity and the other
  pi_g distinct seeded permutations (any dataset, text included). Inputs unchanged.

``group_data``: ``split`` (default): the samples are dealt to the groups (stratified by label:
each class's samples are shuffled and dealt in turn), each sample used once, so clients are as
large as under the other partitions of the same dataset; ``replicate`` (IFCA's construction):
every group holds the whole dataset, transformed, so the pooled data grows G times. Either way
the clients of group g then split group g's samples with the usual label split
(``partition.within``: iid, dirichlet or pathological).
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Callable

import numpy as np
import torch

from fedfew.data.base import PooledDataset

GROUP_DATA = ("replicate", "split")
#: rotations by g x 90 degrees: at most four distinct ones
MAX_ROTATION_GROUPS = 4


class GroupError(ValueError):
    """An impossible ``partition=clustered`` request (the message says what to change)."""


def _rotate(pooled: PooledDataset, inputs: torch.Tensor, targets: torch.Tensor, g: int, G: int,
            rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Group g's copy rotated by g x 90 degrees (labels unchanged)."""
    if g == 0:
        return inputs, targets
    if inputs.dim() >= 3:
        return torch.rot90(inputs, g, dims=(-2, -1)).contiguous(), targets
    h, w = pooled_image_shape(pooled)
    flat = inputs.reshape(len(inputs), h, w)
    return torch.rot90(flat, g, dims=(-2, -1)).reshape(inputs.shape).contiguous(), targets


def _permute_labels(pooled: PooledDataset, inputs: Any, targets: torch.Tensor, g: int, G: int,
                    rng: np.random.Generator) -> tuple[Any, torch.Tensor]:
    """Group g's copy with labels mapped through its permutation (inputs unchanged)."""
    perm = label_permutations(pooled.num_classes, G, rng)[g]
    return inputs, torch.as_tensor(perm, dtype=torch.int64)[targets]


#: group transform by config value (``partition.group_transform``); each maps (pooled, inputs,
#: targets, g, G, rng) to group g's (inputs, targets)
GROUP_TRANSFORMS: dict[str, Callable[..., tuple[Any, torch.Tensor]]] = {
    "rotate": _rotate,
    "permute_labels": _permute_labels,
}


def pooled_image_shape(pooled: PooledDataset) -> tuple[int, int]:
    """(H, W) of the dataset's images: the last two axes of (N, C, H, W) inputs, or the loader's
    ``image_shape`` for flat inputs (digits: (8, 8)).

    Raises:
        GroupError: text, or flat inputs without a declared image shape.
    """
    if pooled.inputs is None:
        raise GroupError(f"partition.group_transform=rotate needs images, but {pooled.name} is text; "
                         "use partition.group_transform=permute_labels")
    if pooled.inputs.dim() >= 3:
        return int(pooled.inputs.shape[-2]), int(pooled.inputs.shape[-1])
    shape = getattr(pooled, "image_shape", None)
    if shape is None or math.prod(shape) != pooled.inputs[0].numel():
        raise GroupError(f"partition.group_transform=rotate needs images, but {pooled.name}'s inputs are flat "
                         f"vectors of {pooled.inputs[0].numel()} values with no image shape; use "
                         "partition.group_transform=permute_labels")
    return int(shape[0]), int(shape[1])


def label_permutations(num_classes: int, groups: int, rng: np.random.Generator) -> list[np.ndarray]:
    """G distinct permutations of the C classes: the identity for group 0, seeded random ones
    (drawn until distinct from the earlier ones) for the others.

    Raises:
        GroupError: more groups than the C! permutations that exist.
    """
    if groups > math.factorial(min(num_classes, 20)):
        raise GroupError(f"partition.groups={groups} > {num_classes}! distinct label permutations")
    out = [np.arange(num_classes)]
    seen = {tuple(out[0])}
    state = rng.bit_generator.state  # every call with the same rng state gives the same list
    while len(out) < groups:
        perm = rng.permutation(num_classes)
        if tuple(perm) not in seen:
            seen.add(tuple(perm))
            out.append(perm)
    rng.bit_generator.state = state
    return out


def check_groups(cfg: Any, num_clients: int | None, pooled: PooledDataset | None = None) -> None:
    """Validate a ``partition=clustered`` config (and, given the data, that the transform applies).

    Raises:
        GroupError: groups < 1 or > num_clients, unknown transform or group_data, rotate with
            more than 4 groups, rotate on text or on non-square images.
    """
    G = cfg.get("groups")
    if not isinstance(G, int) or isinstance(G, bool) or G < 1:
        raise GroupError(f"partition.groups={G!r} must be an integer >= 1")
    if num_clients is not None and G > int(num_clients):
        raise GroupError(f"partition.groups={G} > num_clients={num_clients}: every group needs at least one "
                         f"client; use partition.groups <= {num_clients} or more clients")
    transform = cfg.get("group_transform")
    if transform not in GROUP_TRANSFORMS:
        raise GroupError(f"partition.group_transform={transform!r}; allowed: {', '.join(GROUP_TRANSFORMS)}")
    if cfg.get("group_data", "split") not in GROUP_DATA:
        raise GroupError(f"partition.group_data={cfg.get('group_data')!r}; allowed: {', '.join(GROUP_DATA)}")
    if transform == "rotate" and G > MAX_ROTATION_GROUPS:
        raise GroupError(f"partition.groups={G} with group_transform=rotate: only {MAX_ROTATION_GROUPS} distinct "
                         "rotations (0/90/180/270 degrees) exist; use partition.groups <= 4 or "
                         "partition.group_transform=permute_labels")
    if pooled is not None and transform == "rotate":
        h, w = pooled_image_shape(pooled)
        if h != w:
            raise GroupError(f"partition.group_transform=rotate needs square images, {pooled.name}'s are {h}x{w}; "
                             "use partition.group_transform=permute_labels")


def make_groups(pooled: PooledDataset, cfg: Any, num_clients: int, seed: int) -> tuple[PooledDataset, np.ndarray]:
    """The pooled dataset seen by G groups, and each sample's group.

    Args:
        pooled: the loaded dataset (N samples).
        cfg: the ``partition`` config: ``groups`` (G), ``group_transform``, ``group_data``.
        num_clients: M (G <= M).
        seed: the partition seed (the label permutations and the ``split`` deal draw from their
            own stream of it, so the client partition's streams are unchanged).
    Returns:
        (dataset, group): ``split``: N samples, each transformed by its own group (pooled in
        group order); ``replicate``: G x N samples, block g = group g's transformed copy of all N.
        ``group`` is (N',) int64.
    Raises:
        GroupError: see :func:`check_groups`.
    """
    check_groups(cfg, num_clients, pooled)
    G = int(cfg.groups)
    transform = GROUP_TRANSFORMS[str(cfg.group_transform)]
    rng = np.random.default_rng(np.random.SeedSequence(int(seed)).spawn(3)[2])
    targets = pooled.targets.long()
    N = len(targets)
    if str(cfg.get("group_data", "split")) == "replicate":
        members = [np.arange(N)] * G
    else:
        members = _deal_by_label(targets.numpy(), G, rng)
    inputs, labels, texts, official, group = [], [], [], [], []
    for g, idx in enumerate(members):
        index = torch.as_tensor(idx, dtype=torch.long)
        x = pooled.inputs[index] if pooled.inputs is not None else None
        x, y = transform(pooled, x, targets[index], g, G, rng)
        inputs.append(x)
        labels.append(y)
        if pooled.texts is not None:
            texts.extend(pooled.texts[i] for i in idx)
        if pooled.official_test is not None:
            official.append(pooled.official_test[index])
        group.append(np.full(len(idx), g, dtype=np.int64))
    grouped = replace(
        pooled,
        targets=torch.cat(labels),
        inputs=None if pooled.inputs is None else torch.cat(inputs),
        texts=None if pooled.texts is None else texts,
        official_test=None if pooled.official_test is None else torch.cat(official),
        groups=None,
    )
    return grouped, np.concatenate(group)


def _deal_by_label(targets: np.ndarray, groups: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Split sample indices into G groups: each class's samples shuffled and dealt in turn,
    starting from a random group, so every group gets floor or ceil of n_c / G of class c."""
    out: list[list[np.ndarray]] = [[] for _ in range(groups)]
    for c in np.unique(targets):
        idx = rng.permutation(np.flatnonzero(targets == c))
        start = int(rng.integers(groups))
        for j in range(groups):
            out[(start + j) % groups].append(idx[j::groups])
    return [np.sort(np.concatenate(parts)) for parts in out]
