"""On-disk cache of materialised dataset tensors (decoded images, encoded texts).

A cache entry is one ``torch.save`` file holding a dict of tensors and plain metadata. Its
name derives from a **key**: the sha256 of the dataset name, the identity of the source files
(path, size and modification time of every file read) and the preprocessing settings that
shape the tensors (image size, channels, tokenizer, ...). Change any file or setting and the
key changes, so a stale entry is never read; the old file simply stays until removed.

Where: ``$FEDFEW_CACHE_DIR``, else ``~/.cache/fedfew``. The cache is never put inside the data
directory (which may be read-only and shared) nor directly into the working directory: such a
setting disables caching with a warning. ``FEDFEW_CACHE_DIR=off`` (or ``0``/``none``) disables
it too. Files are written atomically (temporary file in the same folder, then ``os.replace``),
so concurrent runs and crashes never leave a half-written entry under the final name; an
unreadable entry is rebuilt. Runs that miss the same entry at once (``make compare JOBS=2``) build
it once: the first holds an inter-process lock (``<cache>/.locks/<entry>.lock``, the ``filelock``
library; released by the system if the process dies), the others wait for it and then read its file.

Entries are loaded with ``torch.load(mmap=True, weights_only=True)``: the tensors are memory
mapped, so a cache hit costs page-ins, not a copy, and a dataset larger than memory can be
read batch by batch.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
import warnings
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock, Timeout

__all__ = ["CACHE_ENV", "FORMAT_VERSION", "TensorCache", "cache_key", "default_cache_dir", "files_identity"]

log = logging.getLogger(__name__)

CACHE_ENV = "FEDFEW_CACHE_DIR"
"""Environment variable naming the cache directory (``off`` disables the cache)."""
FORMAT_VERSION = 1
"""Bumped when the layout of cache entries changes (part of every key)."""
_OFF = {"", "0", "off", "none", "false", "no"}


def default_cache_dir() -> Path | None:
    """``$FEDFEW_CACHE_DIR`` (``None`` when set to off/0/none), else ``~/.cache/fedfew``."""
    raw = os.environ.get(CACHE_ENV)
    if raw is not None:
        if raw.strip().lower() in _OFF:
            return None
        return Path(raw).expanduser().resolve()
    return (Path.home() / ".cache" / "fedfew").resolve()


def _is_within(path: Path, parent: Path) -> bool:
    try:
        path.relative_to(parent)
        return True
    except ValueError:
        return False


def files_identity(files: Iterable[str | Path]) -> str:
    """sha256 over ``(absolute path, size, mtime_ns)`` of every file, in the given order.

    Args:
        files: the source files a loader reads (their order is part of the identity).
    Returns:
        64-character hex digest; cost is one ``stat`` per file (60,000 files: ~0.1 s).
    Raises:
        FileNotFoundError: a file does not exist.
    """
    h = hashlib.sha256(b"fedfew-files-v1")
    for f in files:
        p = os.path.abspath(f)
        st = os.stat(p)
        h.update(f"{p}\0{st.st_size}\0{st.st_mtime_ns}\n".encode("utf-8", "surrogateescape"))
    return h.hexdigest()


def cache_key(name: str, sources: str, preprocessing: dict[str, Any]) -> str:
    """sha256 of dataset name + source identity + preprocessing settings (JSON, sorted keys)."""
    blob = json.dumps(
        {"format": FORMAT_VERSION, "dataset": name, "sources": sources, "preprocessing": preprocessing},
        sort_keys=True, default=str,
    )
    return hashlib.sha256(blob.encode()).hexdigest()


class TensorCache:
    """A folder of cache entries.

    Args:
        root: cache directory; ``None`` (or a forbidden place) disables caching: ``get`` then
            always builds.
        data_dir: the data directory; a cache root inside it is refused (disabled).
    """

    def __init__(self, root: str | Path | None = None, data_dir: str | Path | None = None, *, use_default: bool = True):
        if root is None and use_default:
            root = default_cache_dir()
        self.root: Path | None = None if root is None else Path(root).expanduser().resolve()
        self.reason = "disabled" if self.root is None else ""
        if self.root is not None:
            cwd = Path.cwd().resolve()
            if data_dir is not None and _is_within(self.root, Path(data_dir).expanduser().resolve()):
                self._disable(f"cache directory {self.root} lies inside the data directory {data_dir}; "
                              f"set {CACHE_ENV} to a folder outside it")
            elif self.root == cwd:
                self._disable(f"cache directory {self.root} is the working directory; set {CACHE_ENV} "
                              f"to a dedicated folder (default ~/.cache/fedfew)")

    def _disable(self, why: str) -> None:
        warnings.warn(f"dataset cache disabled: {why}", UserWarning, stacklevel=3)
        self.root, self.reason = None, why

    @property
    def enabled(self) -> bool:
        return self.root is not None

    def path(self, name: str, key: str) -> Path | None:
        """File of the entry ``key`` of dataset ``name`` (``None`` when disabled)."""
        return None if self.root is None else self.root / f"{name}-{key[:24]}.pt"

    def load(self, name: str, key: str) -> dict[str, Any] | None:
        """The entry, memory mapped; ``None`` when absent, disabled or unreadable."""
        path = self.path(name, key)
        if path is None or not path.is_file():
            return None
        try:
            entry = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        except Exception as err:  # noqa: BLE001 - a damaged entry is rebuilt, never fatal
            warnings.warn(f"ignoring unreadable cache entry {path}: {type(err).__name__}: {err}", UserWarning,
                          stacklevel=2)
            return None
        if not isinstance(entry, dict) or entry.get("__key__") != key:
            return None
        return entry

    def save(self, name: str, key: str, entry: dict[str, Any]) -> Path | None:
        """Write ``entry`` atomically; returns its path, or ``None`` (disabled / not writable,
        which only warns)."""
        path = self.path(name, key)
        if path is None:
            return None
        tmp = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
            os.close(fd)
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o666 & ~umask)  # mkstemp's 0600 would hide a shared cache from other users
            torch.save({**entry, "__key__": key}, tmp)
            os.replace(tmp, path)
            return path
        except OSError as err:
            warnings.warn(f"could not write the dataset cache {path}: {err}", UserWarning, stacklevel=2)
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)
            return None

    @contextlib.contextmanager
    def lock(self, name: str) -> Iterator[None]:
        """Hold the inter-process lock ``<root>/.locks/<name>.lock`` for the block, so that one run
        builds what several would otherwise build at once; the others wait (logged) and then find it
        built. A no-op when the cache is disabled or its folder is not writable (the runs then build
        in parallel, each atomically, as before)."""
        if self.root is None:
            yield
            return
        try:
            folder = self.root / ".locks"
            folder.mkdir(parents=True, exist_ok=True)
            lock = FileLock(str(folder / f"{name}.lock"))
            try:
                lock.acquire(timeout=0)
            except Timeout:
                log.info("waiting for another run building %s (lock %s)", name, lock.lock_file)
                lock.acquire()
        except OSError:
            yield
            return
        try:
            yield
        finally:
            lock.release()

    def get(self, name: str, key: str, build: Callable[[], dict[str, Any]]) -> tuple[dict[str, Any], bool]:
        """The entry ``key``: loaded when present, else ``build()``, saved and returned. Concurrent
        misses of one entry build it once (:meth:`lock`).

        Returns:
            ``(entry, hit)``; after a miss the returned entry is re-read memory mapped from the
            file just written when possible (so both paths give the same tensors). A run that waited
            for another's build reports a hit.
        """
        entry = self.load(name, key)
        if entry is None:
            with self.lock(f"{name}-{key[:24]}"):
                entry = self.load(name, key)  # built by another run while this one waited
                if entry is None:
                    return self._build(name, key, build)
        log.info("%s: cache hit %s", name, self.path(name, key))
        return entry, True

    def _build(self, name: str, key: str, build: Callable[[], dict[str, Any]]) -> tuple[dict[str, Any], bool]:
        entry = build()
        path = self.save(name, key, entry)
        if path is not None:
            log.info("%s: cached into %s", name, path)
            mapped = self.load(name, key)
            if mapped is not None:
                del entry
                return mapped, False
        entry.pop("__key__", None)
        return entry, False
