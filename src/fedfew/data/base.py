"""Containers shared by every dataset loader, the partitions and the simulator.

A loader returns a :class:`PooledDataset` (every sample of the dataset in one place, the
official train/test origin of each sample kept as a mask). A partition turns it into
:class:`ClientSplit` index sets; :class:`FederatedData` is what the round loop consumes:
the pooled tensors plus the per-client index sets.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch


class DataNotFoundError(FileNotFoundError):
    """A dataset's files are neither in the data directory nor downloadable.

    The message names the expected path, the download source and the setting to change
    (``data_dir=...`` or the ``FEDFEW_DATA_DIR`` environment variable).
    """


class DataFormatError(ValueError):
    """A dataset file is there but malformed: cut off (an interrupted download or copy), a row
    with the wrong number of fields, a label out of range, records that disagree...

    Raised while the files are read, before any training. The message names the file and the
    row (``<file>:<line>: ...``) or record (``<file>: user '<id>': ...``), says what is wrong and
    where to get a good copy.
    """


@dataclass
class PooledDataset:
    """Every sample of one dataset, before partitioning.

    Attributes:
        targets: (N,) int64 class labels in ``[0, num_classes)``.
        num_classes: number of classes.
        inputs: (N, ...) float32 tensor for image/tabular data (already decoded and
            normalised), or ``None`` for text data.
        texts: list of N raw strings for text data (tokenised after partitioning, so the
            vocabulary is built from client train splits only), or ``None``.
        official_test: (N,) bool, True where the sample comes from the dataset's official
            test split; ``None`` when the dataset has no such split.
        groups: (N,) int64 natural client ids (writer, centre) for the ``natural``
            partition; ``None`` when the dataset has none.
        class_names: optional human-readable class names (length ``num_classes``).
        name: dataset name (the config value).
        image_shape: (H, W) when flat (N, H*W) inputs are images (digits: (8, 8)), so that
            image transforms (``partition.group_transform=rotate``) apply; else ``None``.
    """

    targets: torch.Tensor
    num_classes: int
    inputs: torch.Tensor | None = None
    texts: list[str] | None = None
    official_test: torch.Tensor | None = None
    groups: torch.Tensor | None = None
    class_names: list[str] | None = None
    name: str = ""
    image_shape: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        n = len(self.targets)
        if (self.inputs is None) == (self.texts is None):
            raise ValueError("PooledDataset needs exactly one of `inputs` (tensors) or `texts` (strings)")
        size = len(self.inputs) if self.inputs is not None else len(self.texts)
        if size != n:
            raise ValueError(f"PooledDataset: {size} inputs but {n} targets")
        for name in ("official_test", "groups"):
            value = getattr(self, name)
            if value is not None and len(value) != n:
                raise ValueError(f"PooledDataset: `{name}` has length {len(value)}, expected {n}")

    def __len__(self) -> int:
        return len(self.targets)


@dataclass
class ClientSplit:
    """The samples of one client, as indices into the pooled dataset.

    Attributes:
        id: client index in ``[0, M)``.
        train: (n_train,) int64 indices used for local training.
        test: (n_test,) int64 held-out indices used for personalized accuracy.
        val: (n_val,) int64 indices used for model selection instead of ``train`` when
            a validation split is configured; empty otherwise.
        group: the client's true group on ``partition=clustered`` (in ``[0, G)``), else None.
    """

    id: int
    train: np.ndarray
    test: np.ndarray
    val: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    group: int | None = None

    @property
    def selection(self) -> np.ndarray:
        """Indices used to pick the client's model (validation split if any, else train)."""
        return self.val if len(self.val) else self.train


@dataclass
class FederatedData:
    """Pooled, preprocessed tensors and the client index sets (what the simulator reads).

    Attributes:
        inputs: (N, ...) float32 images/features, or (N, L_max) int64 token ids padded with 0.
        targets: (N,) int64 labels.
        num_classes: number of classes.
        clients: one :class:`ClientSplit` per client, ``clients[i].id == i``.
        lengths: (N,) int64 number of real tokens per text (batches are cut to the longest
            sequence they contain), ``None`` for non-text data.
        vocab_size: vocabulary size for text data (``None`` otherwise).
        partition_hash: stable hash of the client index sets (same seed -> same hash).
        data_fingerprint: sha256 of the loaded dataset's content, not its path
            (:func:`fedfew.data.fingerprint.data_fingerprint`; "" when not computed).
        group_by_length: text only: :meth:`epoch_order` puts texts of similar length in the
            same batch (``dataset.group_by_length``), so batches carry less padding.
    """

    inputs: torch.Tensor
    targets: torch.Tensor
    num_classes: int
    clients: list[ClientSplit]
    lengths: torch.Tensor | None = None
    vocab_size: int | None = None
    partition_hash: str = ""
    data_fingerprint: str = ""
    name: str = ""
    group_by_length: bool = False

    @property
    def num_clients(self) -> int:
        return len(self.clients)

    def epoch_order(self, index: torch.Tensor, batch_size: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """One local epoch's visiting order of a client's samples; consecutive slices of
        ``batch_size`` are its batches (the last one may be partial).

        Default: a uniform random permutation of ``index``. With ``group_by_length`` (text), the
        permuted samples are sorted by length (longest first, ties in random order), cut into
        batches, and the full batches are visited in a random order, the partial batch (the
        shortest texts) last: the length-grouped sampling of HF ``group_by_length`` with one
        group per client (a client holds a few dozen batches at most). Every sample is still
        visited exactly once per epoch.

        Args:
            index: (n,) int64 sample indices (on the data's device).
            batch_size: B >= 1.
            generator: random stream (default: torch's global one).
        Returns:
            (n,) int64, a permutation of ``index``.
        """
        n = index.numel()
        order = index[torch.randperm(n, generator=generator, device=index.device)]
        if not (self.group_by_length and self.lengths is not None) or n <= batch_size:
            return order
        by_length = order[torch.sort(self.lengths[order], descending=True, stable=True).indices]
        full = n // batch_size
        batches = torch.randperm(full, generator=generator, device=index.device)
        head = by_length[: full * batch_size].view(full, batch_size)[batches].reshape(-1)
        return torch.cat([head, by_length[full * batch_size :]])

    def batch(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather a batch by sample indices; text is cut to its longest sequence
        (rounded up to a multiple of 8).

        Args:
            index: (B,) int64 indices into the pooled tensors (same device as the data).
        Returns:
            (inputs (B, ...), targets (B,)).
        """
        x = self.inputs[index]
        if self.lengths is not None:
            # round the cut up to a multiple of 8: few distinct shapes keep the conv
            # kernels' caches warm (oneDNN/cuDNN plan per shape); the extra columns are padding
            longest = int(self.lengths[index].max())
            x = x[:, : min(x.shape[1], max(8, -(-longest // 8) * 8))]
        return x, self.targets[index]


def resolve_data_dir(data_dir: str | Path) -> Path:
    """Absolute data directory; relative paths are taken from the launch directory."""
    return Path(data_dir).expanduser().resolve()
