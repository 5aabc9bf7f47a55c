"""From a dataset config to :class:`FederatedData`: load, partition, split, encode."""
from __future__ import annotations

import numpy as np
import torch
from omegaconf import DictConfig

from fedfew.data.base import FederatedData, resolve_data_dir
from fedfew.data.datasets import DATASETS
from fedfew.data.partition import partition_clients, partition_hash
from fedfew.seeding import derive_seed


def partition_seed(cfg: DictConfig) -> int:
    """The partition's own stream: ``partition.seed`` when set, else derived from ``seed``."""
    explicit = cfg.partition.get("seed", None)
    return int(explicit) if explicit is not None else derive_seed(cfg.seed, "partition")


def build_federated_data(cfg: DictConfig) -> FederatedData:
    """Load ``cfg.dataset`` from ``cfg.data_dir``, partition it over ``cfg.num_clients``
    clients with ``cfg.partition``, and encode text with a vocabulary built from the clients'
    train splits only.

    Returns:
        :class:`FederatedData` on the CPU.
    Raises:
        DataNotFoundError: the dataset's files are missing (message names path and setting).
        PartitionError: the partition cannot satisfy its constraints.
    """
    loader = DATASETS.get(cfg.dataset.name)
    pooled = loader(cfg.dataset, resolve_data_dir(cfg.data_dir))
    targets = pooled.targets.numpy()
    clients = partition_clients(
        targets,
        int(cfg.num_clients),
        cfg.partition,
        seed=partition_seed(cfg),
        groups=None if pooled.groups is None else pooled.groups.numpy(),
        official_test=None if pooled.official_test is None else pooled.official_test.numpy(),
    )
    lengths, vocab_size = None, None
    if pooled.texts is not None:
        from fedfew.data.text import encode_texts

        train_index = np.concatenate([c.train for c in clients])
        inputs, lengths, vocab_size = encode_texts(pooled.texts, train_index, cfg.dataset, resolve_data_dir(cfg.data_dir))
    else:
        inputs = pooled.inputs
    return FederatedData(
        inputs=inputs,
        targets=pooled.targets.long(),
        num_classes=pooled.num_classes,
        clients=clients,
        lengths=lengths,
        vocab_size=vocab_size,
        partition_hash=partition_hash(clients),
        name=pooled.name,
    )


def to_device(data: FederatedData, device: torch.device) -> FederatedData:
    """A copy of ``data`` whose tensors live on ``device`` (moved once per run)."""
    return FederatedData(
        inputs=data.inputs.to(device),
        targets=data.targets.to(device),
        num_classes=data.num_classes,
        clients=data.clients,
        lengths=None if data.lengths is None else data.lengths.to(device),
        vocab_size=data.vocab_size,
        partition_hash=data.partition_hash,
        name=data.name,
    )
