"""Atomic result files: written to a temporary file in the same folder, then renamed, so a
reader (or a crash) never sees a half-written file.

File modes: ``tempfile.mkstemp`` creates its file with mode 0600 whatever the umask; the
functions here give the file the mode an ordinary ``open(path, "w")`` would, ``0666 & ~umask``
(0644 under the usual umask 022, 0664 under 002), so collaborators on a shared cluster can read
results.json, metrics.csv, compare.csv, checkpoints and plots."""
from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any


def current_umask() -> int:
    """The process's umask, read without changing it (``/proc/self/status`` on Linux >= 4.7;
    elsewhere set and restored at once with ``os.umask``)."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _mkstemp(path: Path) -> tuple[int, str]:
    """A temporary file beside ``path`` with the umask's mode (``0666 & ~umask``), not 0600."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~current_umask())
    except BaseException:
        os.close(fd)
        Path(tmp).unlink(missing_ok=True)
        raise
    return fd, tmp


def atomic_write_bytes(path: str | Path, payload: bytes) -> Path:
    """Write ``payload`` to ``path`` atomically (tmp file + fsync + os.replace), mode
    ``0666 & ~umask``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = _mkstemp(path)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def atomic_write_text(path: str | Path, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically (:func:`atomic_write_bytes`)."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def to_jsonable(obj: Any) -> Any:
    """Tensors and numpy values to plain lists/numbers, recursively."""
    torch = sys.modules.get("torch")  # not imported by this module: a tensor exists only if torch is loaded
    if torch is not None and isinstance(obj, torch.Tensor):
        return obj.detach().cpu().tolist()
    if hasattr(obj, "tolist") and not isinstance(obj, (str, bytes)):
        return obj.tolist()
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    return obj


def atomic_write_json(path: str | Path, obj: Any) -> Path:
    """Write ``obj`` (tensors allowed) as indented JSON, atomically, mode ``0666 & ~umask``."""
    return atomic_write_text(path, json.dumps(to_jsonable(obj), indent=2) + "\n")


def atomic_torch_save(path: str | Path, obj: Any) -> Path:
    """``torch.save`` atomically, mode ``0666 & ~umask``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    import torch

    fd, tmp = _mkstemp(path)
    os.close(fd)
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
