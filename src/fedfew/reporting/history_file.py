"""A run's history file: where it is, how it is written, how it is read.

A run writes its history (every round's logs and every evaluation's per-client accuracy, the
content of :func:`fedfew.reporting.callbacks.build_history`) gzip-compressed, as
``<run_dir>/history.json.gz``: at M = 1,000 clients and 200 rounds the plain JSON is 4 MiB
(every round holds alpha, w and L of its 50 participants), compressed under 1 MiB. Runs made
before 2026-12-07 have a plain ``history.json``; every reader goes through :func:`load_history`,
which takes either. Read one by hand with ``zcat history.json.gz | jq``.

The bytes are deterministic (gzip header without time or name), so the same run writes the same
file.
"""
from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

from fedfew.core.io import atomic_write_bytes, to_jsonable

#: the file a run writes
HISTORY_FILE = "history.json.gz"
#: the file runs made before 2026-12-07 wrote (read, never written)
PLAIN_HISTORY_FILE = "history.json"


def history_path(run_dir: str | Path) -> Path | None:
    """The history file of ``run_dir``: ``history.json.gz``, else a plain ``history.json``
    (older runs), else None."""
    run_dir = Path(run_dir)
    for name in (HISTORY_FILE, PLAIN_HISTORY_FILE):
        if (run_dir / name).is_file():
            return run_dir / name
    return None


def load_history(run_dir: str | Path) -> dict[str, Any]:
    """The history of a run directory, from either form.

    Raises:
        FileNotFoundError: ``run_dir`` has neither ``history.json.gz`` nor ``history.json``
            (not a run folder, or the run stopped before its first evaluation).
        ValueError: the file is not gzip-compressed JSON (or plain JSON); the message names it.
    """
    path = history_path(run_dir)
    if path is None:
        raise FileNotFoundError(f"{Path(run_dir) / HISTORY_FILE} not found: is {run_dir} a fedfew run folder "
                                "(a run writes its history at its first evaluation)?")
    try:
        raw = gzip.decompress(path.read_bytes()) if path.name.endswith(".gz") else path.read_bytes()
        return json.loads(raw)
    except (OSError, EOFError, ValueError) as err:
        raise ValueError(f"{path} cannot be read as {'gzip-compressed ' if path.name.endswith('.gz') else ''}"
                         f"JSON ({type(err).__name__}: {err}); rerun the run, or delete the file") from err


def write_history(run_dir: str | Path, history: dict[str, Any]) -> Path:
    """Write ``history`` (tensors allowed) to ``<run_dir>/history.json.gz`` atomically, and
    remove a plain ``history.json`` left by an older version of the run (a resumed run), so a
    folder never holds two histories that disagree. Returns the path written."""
    run_dir = Path(run_dir)
    payload = json.dumps(to_jsonable(history)).encode("utf-8")
    path = atomic_write_bytes(run_dir / HISTORY_FILE, gzip.compress(payload, compresslevel=6, mtime=0))
    (run_dir / PLAIN_HISTORY_FILE).unlink(missing_ok=True)
    return path
