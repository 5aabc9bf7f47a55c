"""From a dataset config to :class:`FederatedData`: load, partition, split, encode.

Materialisation (done once per run, never per round):

* **images** -- loaders return uint8 pixels (decoded and resized once, then read from the
  on-disk cache, :mod:`fedfew.data.cache`); they are normalised here into one float32 tensor,
  from which batches are drawn by index.
* **text** -- token ids are built once from the clients' train texts (vocabulary without test
  texts) and cached on disk under a key of the texts, the train indices and the tokenizer
  settings; batches are cut to their longest sequence (:meth:`FederatedData.batch`).
* **too large for memory** -- ``dataset.in_memory`` (``auto`` default, ``true``, ``false``):
  with ``auto``, images whose float32 tensor would take more than half of the available RAM
  stay uint8 (memory mapped from the cache file when cached) and each batch is gathered,
  normalised and moved to the device on the fly (:class:`StreamedData`). The same happens in
  :func:`to_device` when the float32 tensor does not fit in the accelerator's free memory.
  Batches are identical either way.
"""
from __future__ import annotations

import hashlib
import logging
import os
import time
import warnings
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig

from fedfew.data.base import FederatedData, PooledDataset, resolve_data_dir
from fedfew.data.cache import TensorCache, cache_key, files_identity
from fedfew.data.datasets import DATASETS
from fedfew.data.fingerprint import data_fingerprint
from fedfew.data.groups import check_groups, make_groups
from fedfew.data.images import ImageDataset, normalize
from fedfew.data.partition import partition_clients, partition_hash
from fedfew.core.seeding import derive_seed

log = logging.getLogger(__name__)

#: share of the available host memory a float32 image tensor may take with ``in_memory: auto``
HOST_MEMORY_SHARE = 0.5
#: share of the accelerator's free memory the pooled inputs may take in :func:`to_device`
DEVICE_MEMORY_SHARE = 0.6


def partition_seed(cfg: DictConfig) -> int:
    """The partition's own stream: ``partition.seed`` when set, else derived from ``seed``."""
    explicit = cfg.partition.get("seed", None)
    return int(explicit) if explicit is not None else derive_seed(cfg.seed, "partition")


@dataclass
class StreamedData(FederatedData):
    """:class:`FederatedData` whose ``inputs`` stay on the host (uint8 pixels, possibly memory
    mapped, or float32) and are gathered, normalised and moved to ``device`` batch by batch.

    Attributes:
        mean, std: normalisation of uint8 inputs (see :func:`fedfew.data.images.normalize`).
        device: where :meth:`batch` puts its tensors (``targets`` already live there).
    """

    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    def batch(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B,) indices (any device) -> (float32 inputs, int64 targets) on ``device``."""
        x = self.inputs[index.cpu()]
        if x.dtype == torch.uint8:
            x = normalize(x, self.mean, self.std)
        if self.device.type != "cpu":
            x = x.pin_memory().to(self.device, non_blocking=True)
        return x, self.targets[index.to(self.targets.device)]


def available_memory() -> int:
    """Bytes of host memory available to new allocations (``MemAvailable``), or total RAM."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 1 << 62


def _in_memory(cfg: Any, pooled: ImageDataset) -> bool:
    """Whether the float32 tensor of ``pooled`` is materialised (see module doc)."""
    setting = cfg.get("in_memory", "auto") if hasattr(cfg, "get") else "auto"
    if setting is None or str(setting).lower() == "auto":
        need = pooled.inputs.numel() * 4
        budget = HOST_MEMORY_SHARE * available_memory()
        if need > budget:
            log.warning("%s: float32 inputs would take %.1f GiB (> %.0f%% of available memory): batches are "
                        "normalised on the fly from uint8", pooled.name, need / 2**30, HOST_MEMORY_SHARE * 100)
            return False
        return True
    if isinstance(setting, bool):
        return setting
    raise ValueError(f"dataset.in_memory must be auto, true or false, got {setting!r}")


def _check_classes(cfg: DictConfig, pooled: PooledDataset) -> None:
    expected = cfg.dataset.get("num_classes", None)
    if expected is not None and int(expected) != pooled.num_classes:
        raise ValueError(
            f"dataset {cfg.dataset.name}: the files hold {pooled.num_classes} classes but dataset.num_classes="
            f"{expected}; check the data directory (wrong dataset?) or set dataset.num_classes"
        )
    if pooled.groups is not None and cfg.partition.name not in ("natural", "clustered"):
        warnings.warn(
            f"dataset {cfg.dataset.name} has a natural partition (one client per writer/centre) but "
            f"partition={cfg.partition.name}; use `partition=natural` for the standard setting",
            UserWarning, stacklevel=3,
        )


def load_pooled(cfg: DictConfig) -> PooledDataset:
    """``cfg.dataset`` as its loader returns it from ``cfg.data_dir`` (every sample, before
    client groups and partitions).

    Raises:
        DataNotFoundError: the dataset's files are missing (message names path and setting).
        ValueError: the files hold another number of classes than ``dataset.num_classes``, or
            ``partition=clustered`` settings that cannot work (checked before the load).
    """
    loader = DATASETS.get(cfg.dataset.name)
    if cfg.partition.name == "clustered":
        check_groups(cfg.partition, cfg.num_clients)  # before the (possibly slow) load
    pooled = loader(cfg.dataset, resolve_data_dir(cfg.data_dir))
    _check_classes(cfg, pooled)
    return pooled


def split_clients(cfg: DictConfig, pooled: PooledDataset) -> tuple[PooledDataset, list]:
    """The clients of ``cfg.partition`` on ``pooled`` (:func:`load_pooled`).

    Returns:
        (the pooled data the clients index: ``pooled`` itself, or with ``partition=clustered``
        each group's transformed copy or share of it; the :class:`ClientSplit` of every client).
    Raises:
        PartitionError: the partition cannot satisfy its constraints.
    """
    groups = None if pooled.groups is None else pooled.groups.numpy()
    if cfg.partition.name == "clustered":  # each group's transformed copy (or share) of the data
        pooled, groups = make_groups(pooled, cfg.partition, int(cfg.num_clients), partition_seed(cfg))
    clients = partition_clients(
        pooled.targets.numpy(),
        None if cfg.num_clients is None else int(cfg.num_clients),  # None: natural, every group
        cfg.partition,
        seed=partition_seed(cfg),
        groups=groups,
        official_test=None if pooled.official_test is None else pooled.official_test.numpy(),
    )
    return pooled, clients


def build_federated_data(cfg: DictConfig) -> FederatedData:
    """Load ``cfg.dataset`` from ``cfg.data_dir`` (:func:`load_pooled`; the content's
    :func:`fedfew.data.fingerprint.data_fingerprint` is kept as ``data_fingerprint``), partition
    it over ``cfg.num_clients`` clients with ``cfg.partition`` (:func:`split_clients`), and
    encode text with a vocabulary built from the clients' train splits only.

    Returns:
        :class:`FederatedData` on the CPU (:class:`StreamedData` for images too large for
        memory, see module doc).
    Raises:
        DataNotFoundError: the dataset's files are missing (message names path and setting).
        PartitionError: the partition cannot satisfy its constraints.
        ValueError: the files hold another number of classes than ``dataset.num_classes``.
    """
    start = time.perf_counter()
    data_dir = resolve_data_dir(cfg.data_dir)
    pooled = load_pooled(cfg)
    fingerprint = data_fingerprint(pooled)
    loaded = time.perf_counter()
    pooled, clients = split_clients(cfg, pooled)
    if cfg.partition.name == "natural" and pooled.groups is not None:
        log.info("%s", natural_clients_line(pooled, clients, cfg))
    common = dict(targets=pooled.targets.long(), num_classes=pooled.num_classes, clients=clients,
                  partition_hash=partition_hash(clients), data_fingerprint=fingerprint, name=pooled.name)
    if pooled.texts is not None:
        train_index = np.concatenate([c.train for c in clients])
        inputs, lengths, vocab_size = encode_texts_cached(pooled, train_index, cfg.dataset, data_dir)
        data = FederatedData(inputs=inputs, lengths=lengths, vocab_size=vocab_size,
                             group_by_length=bool(cfg.dataset.get("group_by_length", False)), **common)
    elif isinstance(pooled, ImageDataset):
        if _in_memory(cfg.dataset, pooled):
            data = FederatedData(inputs=pooled.normalized(), **common)
        else:
            data = StreamedData(inputs=pooled.inputs, mean=pooled.mean, std=pooled.std, **common)
    else:
        data = FederatedData(inputs=pooled.inputs, **common)
    log.info("data %s: %d samples, %d clients, inputs %s; load %.2f s, partition + materialise %.2f s",
             pooled.name, len(pooled), len(clients), tuple(data.inputs.shape), loaded - start,
             time.perf_counter() - loaded)
    return data


def natural_clients_line(pooled: PooledDataset, clients: list, cfg: DictConfig) -> str:
    """One line on a natural partition: groups (writers/centres) found, how many are clients and
    which (all; the first N in sorted id order, named by the first and last; or the seeded sample,
    every name listed)."""
    groups, names = pooled.groups.numpy(), pooled.group_names or []
    found = len(np.unique(groups))
    first = [int(groups[np.concatenate([c.train, c.test, c.val])[0]]) for c in clients]  # each client's group
    used = [names[g] if 0 <= g < len(names) else str(g) for g in first]
    cap = "null" if cfg.num_clients is None else cfg.num_clients
    head = f"{pooled.name}: natural partition, {found} groups (writers/centres) found, {len(used)} used as clients"
    if len(used) == found:
        return f"{head} (every group; num_clients={cap})"
    how = str(cfg.partition.get("client_sample", None) or "first")
    if how == "first":
        return (f"{head} (num_clients={cap} caps them; partition.client_sample=first: the first "
                f"{len(used)} in sorted id order, {used[0]} .. {used[-1]})")
    return (f"{head} (num_clients={cap} caps them; partition.client_sample={how}, partition seed "
            f"{partition_seed(cfg)}): {', '.join(used)}")


def _texts_digest(texts: list[str]) -> str:
    h = hashlib.sha256(b"fedfew-texts-v1")
    for t in texts:
        b = t.encode("utf-8", "surrogatepass")
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.hexdigest()


def encode_texts_cached(
    pooled: PooledDataset, train_index: np.ndarray, cfg: Any, data_dir: Path
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """:func:`fedfew.data.text.encode_texts`, cached on disk (``dataset.cache: false`` skips it).

    The key holds the texts themselves (a digest), the train indices (they define the
    ``basic_english`` vocabulary), the tokenizer settings and, for BERT, the vocabulary file's
    identity; so a different partition or tokenizer never reads another's ids.
    """
    from fedfew.data.text import BERT_VOCAB_RELPATH, encode_texts

    def encode() -> dict[str, Any]:
        tokens, lengths, vocab = encode_texts(pooled.texts, train_index, cfg, data_dir)
        small = torch.int32 if vocab < 2**31 else torch.int64
        return {"inputs": tokens.to(small), "lengths": lengths, "vocab_size": int(vocab)}

    use = bool(cfg.get("cache", True)) if hasattr(cfg, "get") else True
    cache = TensorCache(data_dir=data_dir) if use else TensorCache(None, use_default=False)
    if not cache.enabled:
        entry = encode()
    else:
        tokenizer = str(cfg.get("tokenizer", None) or "basic_english")
        vocab_file = Path(data_dir) / BERT_VOCAB_RELPATH
        settings = {
            "tokenizer": tokenizer,
            "max_vocab": int(cfg.get("max_vocab", None) or 32000),
            "max_length": int(cfg.get("max_length", None) or 200),
            "vocab_file": files_identity([vocab_file]) if tokenizer != "basic_english" and vocab_file.is_file() else None,
            "train_index": hashlib.sha256(np.ascontiguousarray(train_index, dtype="<i8").tobytes()).hexdigest(),
        }
        key = cache_key(f"{pooled.name}-tokens", _texts_digest(pooled.texts), settings)
        entry, _ = cache.get(f"{pooled.name}-tokens", key, encode)
    return entry["inputs"].long(), entry["lengths"].long(), int(entry["vocab_size"])


def to_device(data: FederatedData, device: torch.device) -> FederatedData:
    """A copy of ``data`` whose tensors live on ``device`` (moved once per run).

    Inputs too large for the accelerator's free memory (or already host-streamed) stay on the
    host as :class:`StreamedData`; targets, lengths and indices always move.
    """
    device = torch.device(device)
    values = {f.name: getattr(data, f.name) for f in fields(FederatedData)}
    values["targets"] = data.targets.to(device)
    values["lengths"] = None if data.lengths is None else data.lengths.to(device)
    if isinstance(data, StreamedData) or (data.lengths is None and not _fits_device(data.inputs, device)):
        mean = getattr(data, "mean", None)
        std = getattr(data, "std", None)
        return StreamedData(**values, mean=mean, std=std, device=device)
    values["inputs"] = data.inputs.to(device)
    return FederatedData(**values)


def _fits_device(x: torch.Tensor, device: torch.device) -> bool:
    if device.type != "cuda":
        return True
    free, _ = torch.cuda.mem_get_info(device)
    fits = x.numel() * x.element_size() <= DEVICE_MEMORY_SHARE * free
    if not fits:
        log.warning("inputs of %.1f GiB do not fit in %.0f%% of the free accelerator memory (%.1f GiB): batches "
                    "are moved from the host one at a time", x.numel() * x.element_size() / 2**30,
                    DEVICE_MEMORY_SHARE * 100, free / 2**30)
    return fits
