"""What a run read, by content: the data fingerprint, and the check that a run folder was made
from the data a new invocation would read.

A run is the same experiment as another when their configs match up to keys that do not change
results (:data:`fedfew.core.keys.RESULT_NEUTRAL`, ``data_dir`` among them: it is where the files
lie, not what they hold) **and** they read the same data. The data is identified by
:func:`data_fingerprint`: a sha256 of the dataset as its loader returns it (every sample's
input or text, its label, its official-split mark and natural group, plus the normalisation of
images), before any partition. So the same files copied to another folder, a symlinked data
directory, or the same samples in another file layout (AG News from the CSV release or from the
Hugging Face copy) give one fingerprint; a changed label, text or pixel gives another.

Every run records it: ``results.json`` and its checkpoints hold ``data_fingerprint`` (beside
``partition_hash``, the hash of the client index sets, which says which samples each client
holds but not what they contain). ``make compare`` and ``make tune`` check a run folder before
reusing it (:class:`DataCheck`, :func:`fedfew.core.run_folders.data_mismatch`); a run made before the
fingerprint was recorded is checked by its ``partition_hash``, recomputed on the new data.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

#: PooledDataset / ImageDataset fields that name or describe the data without changing what a
#: run computes (and ``cache_hit``, which says where the pixels came from)
NEUTRAL_FIELDS = ("name", "class_names", "group_names", "cache_hit")
_VERSION = b"fedfew-data-v1"


def _update(h: "hashlib._Hash", name: str, value: Any) -> None:
    h.update(f"\0{name}:".encode())
    if value is None:
        h.update(b"none")
    elif hasattr(value, "detach") and hasattr(value, "dtype"):  # a torch tensor (possibly memory mapped)
        array = np.ascontiguousarray(value.detach().cpu().numpy())
        h.update(f"tensor {array.dtype.str} {list(array.shape)}\n".encode())
        h.update(memoryview(array).cast("B"))
    elif isinstance(value, (list, tuple)) and value and all(isinstance(v, str) for v in value):
        h.update(f"texts {len(value)}\n".encode())
        for text in value:
            b = text.encode("utf-8", "surrogatepass")
            h.update(len(b).to_bytes(8, "little"))
            h.update(b)
    else:  # numbers, shapes, per-channel means
        h.update(json.dumps(value, sort_keys=True, default=str).encode())


def data_fingerprint(pooled: Any) -> str:
    """sha256 hex digest of a loaded dataset's content (see the module docstring).

    Hashes, field by field in name order, every field of the :class:`fedfew.data.base.PooledDataset`
    (or subclass) but :data:`NEUTRAL_FIELDS`: tensors as dtype, shape and bytes, texts as their
    UTF-8 bytes, anything else as JSON. No path enters it. Cost: one pass over the data (AG News'
    127,600 texts or CIFAR-10's pixels: well under a second).

    Args:
        pooled: what a dataset loader returned (before client groups or partitions).
    Returns:
        64-character hex string.
    """
    h = hashlib.sha256(_VERSION)
    for f in sorted(dataclasses.fields(pooled), key=lambda f: f.name):
        if f.name not in NEUTRAL_FIELDS:
            _update(h, f.name, getattr(pooled, f.name))
    return h.hexdigest()


def short(digest: str | None) -> str:
    """The first 12 hex digits of a fingerprint or hash, as messages show them ("none" for none)."""
    return digest[:12] if digest else "none"


class DataCheck:
    """The data one invocation of ``make compare`` / ``make tune`` would read from ``data_dir``,
    loaded at most once per dataset config, to check a recorded run against it.

    Args:
        data_dir: the data directory the new runs get (their config's ``data_dir``).
    """

    def __init__(self, data_dir: str | Path):
        from fedfew.data.base import resolve_data_dir

        self.data_dir = resolve_data_dir(data_dir)
        self._pooled: dict[str, tuple[Any, str]] = {}
        self._partitions: dict[str, str] = {}

    def _config(self, config: dict[str, Any]):
        """A recorded run's config (results.json ``config``) reading this data directory."""
        from omegaconf import OmegaConf

        return OmegaConf.create({**config, "data_dir": str(self.data_dir)})

    def _load(self, config: dict[str, Any]) -> tuple[Any, str]:
        """(the pooled dataset, its fingerprint) for a run config's ``dataset`` node."""
        key = json.dumps(config.get("dataset"), sort_keys=True, default=str)
        if key not in self._pooled:
            from fedfew.data.federated import load_pooled

            pooled = load_pooled(self._config(config))
            self._pooled[key] = (pooled, data_fingerprint(pooled))
        return self._pooled[key]

    def fingerprint(self, config: dict[str, Any]) -> str:
        """:func:`data_fingerprint` of the data a run of ``config`` (a recorded, resolved run
        config) reads from :attr:`data_dir`.

        Raises:
            fedfew.data.base.DataNotFoundError: the dataset's files are not there.
        """
        return self._load(config)[1]

    def partition_hash(self, config: dict[str, Any]) -> str:
        """The partition hash a run of ``config`` gets on the data in :attr:`data_dir` (for runs
        recorded before ``data_fingerprint`` was).

        Raises:
            fedfew.data.base.DataNotFoundError: the dataset's files are not there.
            fedfew.data.partition.PartitionError: the partition cannot be made on this data.
        """
        key = json.dumps({k: config.get(k) for k in ("dataset", "partition", "num_clients", "seed")},
                         sort_keys=True, default=str)
        if key not in self._partitions:
            from fedfew.data.federated import split_clients
            from fedfew.data.partition import partition_hash

            _, clients = split_clients(self._config(config), self._load(config)[0])
            self._partitions[key] = partition_hash(clients)
        return self._partitions[key]

    @staticmethod
    def recorded(record: dict[str, Any]) -> bool:
        """Whether a run's record (results.json, a checkpoint's state) says what data it read: a
        ``data_fingerprint``, or a ``partition_hash`` with its ``config``."""
        return bool(record.get("data_fingerprint") or (record.get("partition_hash") and record.get("config")))

    def mismatch(self, recorded: dict[str, Any]) -> str | None:
        """Why a recorded run did not read this data, or None when it did.

        Args:
            recorded: the run's record: ``config`` (resolved) and ``data_fingerprint`` and/or
                ``partition_hash`` (results.json, or a checkpoint's state). Its
                ``data_fingerprint`` is compared when present, else its ``partition_hash``
                (a run made before the fingerprint was recorded).
        Returns:
            e.g. ``"data fingerprint 0123456789ab recorded, 5a6b7c8d9e0f in /data"``; or
            ``"no data fingerprint or partition hash recorded"`` when there is nothing to compare.
        Raises:
            fedfew.data.base.DataNotFoundError: the dataset's files are not in :attr:`data_dir`.
        """
        config = recorded.get("config") or {}
        if recorded.get("data_fingerprint"):
            now = self.fingerprint(config)
            if now != recorded["data_fingerprint"]:
                return f"data fingerprint {short(recorded['data_fingerprint'])} recorded, {short(now)} in {self.data_dir}"
            return None
        if recorded.get("partition_hash") and config:
            now = self.partition_hash(config)
            if now != recorded["partition_hash"]:
                return (f"partition hash {short(recorded['partition_hash'])} recorded (no data fingerprint: a run made "
                        f"before it was recorded), {short(now)} on the data in {self.data_dir}")
            return None
        return "no data fingerprint or partition hash recorded"


_CHECKS: dict[Path, DataCheck] = {}


def data_check(data_dir: str | Path) -> DataCheck:
    """The process's :class:`DataCheck` of ``data_dir`` (one per resolved folder, so the data is
    loaded once however many runs are checked). It keeps what it loaded: a process that changes
    the files in between (a test) calls :func:`forget_data` first."""
    check = DataCheck(data_dir)
    return _CHECKS.setdefault(check.data_dir, check)


def forget_data() -> None:
    """Drop every :func:`data_check` (the next one loads the data again)."""
    _CHECKS.clear()
