"""The list of past runs (``make runs``).

``python -m fedfew.runs [ROOT ...]`` (``make runs``) prints one row per run found
under ROOT (default ``$FEDFEW_OUTPUT_DIR``, else ``outputs`` and ``multirun``), newest first,
with the headline figures of its ``results.json``; a run without one is ``running`` while the
process that trains it is alive (rank 0 keeps its host and pid in :data:`PID_FILE` from the
first round to the end; on another host, or before the first round: when a file in it changed
in the last :data:`RUNNING_WINDOW_S` seconds), else ``interrupted`` (stopped by a signal, killed
or crashed; ``resumable`` when it left ``checkpoints/last.ckpt``), with the rounds it reached and
its last evaluation from ``metrics.csv``.
"""
from __future__ import annotations

import csv
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from fedfew.core.run_folders import RUNNING_WINDOW_S, display_path, trainer_alive


@dataclass
class RunInfo:
    """One run folder as :func:`find_runs` sees it."""

    path: Path
    started: float                   # seconds since the epoch (the run's first file)
    status: str                      # done | running | interrupted | resumable
    rounds: str                      # "<reached>/<total>"
    summary: dict[str, Any]          # results.json's summary, or the last evaluation of metrics.csv
    wall_time_s: float | None = None


def _is_run_dir(path: Path) -> bool:
    return (path / "results.json").is_file() or (path / "config.yaml").is_file() \
        or (path / ".hydra" / "config.yaml").is_file()


def _newest_mtime(path: Path) -> float:
    times = [p.stat().st_mtime for p in list(path.iterdir()) + list((path / ".hydra").glob("*")) if p.is_file()]
    return max(times, default=path.stat().st_mtime)


def _started(path: Path) -> float:
    for name in (".hydra/config.yaml", "config.yaml"):
        if (path / name).is_file():
            return (path / name).stat().st_mtime
    return path.stat().st_mtime


def _total_rounds(path: Path) -> int | None:
    from omegaconf import OmegaConf

    for name in ("config.yaml", ".hydra/config.yaml"):
        try:
            value = OmegaConf.load(path / name).get("rounds")
            return int(value)
        except Exception:  # missing file, unresolved interpolation (.hydra) -> try the next
            continue
    return None


def _metrics_progress(path: Path) -> tuple[int, dict[str, Any]]:
    """(last round in metrics.csv, its last evaluation's accuracy columns)."""
    try:
        with (path / "metrics.csv").open() as fh:
            rows = list(csv.DictReader(fh))
    except OSError:
        return 0, {}
    last_round = int(float(rows[-1]["round"])) if rows else 0
    evaluated = [r for r in rows if r.get("acc_mean")]
    summary = {k: float(v) for k, v in evaluated[-1].items() if k.startswith(("acc_", "majority_")) and v} if evaluated else {}
    return last_round, summary


def run_info(path: Path, now: float | None = None) -> RunInfo:
    """Status, rounds and headline figures of one run folder (see the module docstring)."""
    now = time.time() if now is None else now
    results_path = path / "results.json"
    if results_path.is_file():
        try:
            results = json.loads(results_path.read_text())
            s = results.get("summary", {})
            total = s.get("rounds")
            return RunInfo(path, _started(path), "done", f"{total}/{total}", s, results.get("wall_time_s"))
        except (OSError, ValueError):
            pass
    reached, summary = _metrics_progress(path)
    total = _total_rounds(path)
    alive = trainer_alive(path)
    if alive or (alive is None and now - _newest_mtime(path) <= RUNNING_WINDOW_S):
        status = "running"
    else:
        status = "resumable" if (path / "checkpoints" / "last.ckpt").is_file() else "interrupted"
    return RunInfo(path, _started(path), status, f"{reached}/{total if total is not None else '?'}", summary)


def find_runs(roots: Iterable[str | Path]) -> list[RunInfo]:
    """Every run folder under ``roots`` (a root may be a run folder itself), newest first.
    Folders inside a run folder (plots, checkpoints, wandb) are not searched."""
    found: dict[Path, RunInfo] = {}
    now = time.time()
    for root in roots:
        root = Path(root)
        if not root.is_dir():
            continue
        for current, dirs, _files in os.walk(root):
            here = Path(current)
            if _is_run_dir(here):
                found[here.resolve()] = run_info(here, now)
                dirs[:] = []
            else:
                dirs[:] = sorted(d for d in dirs if not d.startswith("."))
    return sorted(found.values(), key=lambda r: r.started, reverse=True)


def _fmt(value: Any, spec: str = ".4f") -> str:
    return format(value, spec) if isinstance(value, (int, float)) else "-"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds:.1f} s" if seconds < 60 else f"{seconds / 60:.1f} min" if seconds < 3600 else f"{seconds / 3600:.1f} h"


def runs_table(runs: list[RunInfo], title: str = "runs"):
    """A :class:`rich.table.Table` of ``runs`` (one row each)."""
    from rich.table import Table

    table = Table(title=title)
    table.add_column("run", overflow="fold", min_width=min(100, max((len(display_path(r.path)) for r in runs), default=3)))
    table.add_column("started")
    table.add_column("status")
    table.add_column("rounds", justify="right")
    for name in ("client-mean acc", "min", "sample-weighted", "majority", ):
        table.add_column(name, justify="right")
    table.add_column("clients per model")
    table.add_column("wall", justify="right")
    for r in runs:
        s = r.summary
        table.add_row(
            display_path(r.path), time.strftime("%Y-%m-%d %H:%M", time.localtime(r.started)), r.status, r.rounds,
            _fmt(s.get("acc_mean")), _fmt(s.get("acc_min")), _fmt(s.get("acc_weighted")), _fmt(s.get("majority_acc_mean")),
            str(s["models_served"]) if s.get("models_served") is not None else "-",
            _duration(r.wall_time_s),
        )
    return table


def default_roots() -> list[Path]:
    """``$FEDFEW_OUTPUT_DIR`` when set, else ``outputs`` and ``multirun`` (the training defaults)."""
    env = os.environ.get("FEDFEW_OUTPUT_DIR")
    return [Path(env)] if env else [Path("outputs"), Path("multirun")]
