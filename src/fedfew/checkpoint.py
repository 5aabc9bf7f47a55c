"""Checkpoints of a run and pre-emption signals.

A checkpoint holds everything a later round depends on: the K server models, the algorithm's
server state, the per-client host state, the RNG states, the round and the logged history. All
per-round randomness is drawn from streams derived from (seed, round, client, model), so rounds
after a resume are identical to those of an uninterrupted run.

SLURM sends SIGTERM (or the signal given with ``--signal``, often SIGUSR1) before pre-empting a
job: :class:`StopSignal` turns it into a flag that the round loop checks after each round, so the
run saves a checkpoint at a round boundary and exits cleanly.
"""
from __future__ import annotations

import random
import signal
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedfew.io import atomic_torch_save

CHECKPOINT_NAME = "last.ckpt"


def checkpoint_path(run_dir: Path) -> Path:
    """``<run_dir>/checkpoints/last.ckpt``."""
    return Path(run_dir) / "checkpoints" / CHECKPOINT_NAME


def rng_states() -> dict[str, Any]:
    """Python, numpy and torch (CPU and CUDA) generator states."""
    states = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict[str, Any]) -> None:
    """Restore :func:`rng_states`."""
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def save_checkpoint(path: Path, state: dict[str, Any]) -> Path:
    """Write ``state`` atomically (a crash mid-write leaves the previous checkpoint intact)."""
    return atomic_torch_save(path, state)


def load_checkpoint(path: Path) -> dict[str, Any]:
    """Read a checkpoint written by :func:`save_checkpoint`.

    Raises:
        FileNotFoundError: with the path and how to start fresh instead.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}; use resume=null to start a new run")
    return torch.load(path, map_location="cpu", weights_only=False)


def resolve_resume(resume: str | None, run_dir: Path) -> Path | None:
    """The checkpoint to resume from: ``None`` (fresh run), ``"auto"`` (the run directory's own
    checkpoint if there is one), or an explicit path (a checkpoint file or a run directory)."""
    if resume in (None, "", "null", False):
        return None
    if resume == "auto":
        path = checkpoint_path(run_dir)
        return path if path.is_file() else None
    path = Path(str(resume)).expanduser().resolve()
    return checkpoint_path(path) if path.is_dir() else path


class StopSignal:
    """Records SIGTERM/SIGUSR1 so the loop can checkpoint at the next round boundary.

    Installed only in the main thread of the process; ``requested`` is True once a signal came.
    """

    SIGNALS = ("SIGTERM", "SIGUSR1")

    def __init__(self) -> None:
        self.requested = False
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def _handler(self, signum, frame) -> None:
        self.requested = True
        self.signum = signum

    def install(self) -> "StopSignal":
        import threading

        if threading.current_thread() is threading.main_thread():
            for name in self.SIGNALS:
                sig = getattr(signal, name, None)
                if sig is not None:
                    self._previous[sig] = signal.signal(sig, self._handler)
        return self

    def uninstall(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()
