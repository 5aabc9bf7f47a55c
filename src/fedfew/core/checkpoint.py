"""Checkpoints of a run and pre-emption signals.

A checkpoint holds everything a later round depends on: the K server models, the algorithm's
server state, the per-client host state, the RNG states, the round and the logged history. All
per-round randomness is drawn from streams derived from (seed, round, client, model), so rounds
after a resume are identical to those of an uninterrupted run.

SLURM sends SIGTERM (or the signal given with ``--signal``, often SIGUSR1) before pre-empting a
job, and Ctrl-C sends SIGINT: :class:`StopSignal` turns each into a flag that the round loop
checks after each round, so the run saves a checkpoint at a round boundary and exits cleanly. A
second Ctrl-C aborts at once (KeyboardInterrupt, no new checkpoint).

A checkpoint also holds the run's resolved config. A resume compares it with the new run's
(:func:`check_resume_config`) and refuses any difference in a key that changes results, naming
every such key with both values; only the keys that :mod:`fedfew.core.keys` marks free on resume may differ, and
``rounds`` only upwards with ``resume_extend_rounds=true`` (docs/resume.md).
"""
from __future__ import annotations

import os
import random
import signal
from pathlib import Path
from typing import Any, Mapping

import numpy as np
from omegaconf import DictConfig, OmegaConf

from fedfew.core.io import atomic_torch_save
from fedfew.core.keys import RESUME_FREE_KEYS, free_on_resume

CHECKPOINT_NAME = "last.ckpt"

#: keys added to the config since checkpoints were first written, with the value that does what
#: fedfew did before: a checkpoint without the key counts as having that value (so an upgrade
#: does not make every saved run unresumable)
ADDED_KEYS: dict[str, Any] = {"eval.also": [], "optim.clip_norm": None}
_ABSENT = object()


class ResumeError(ValueError):
    """A checkpoint that this run cannot continue (another config, too few rounds, no stored
    config); the message says what differs and how to proceed."""


def checkpoint_path(run_dir: Path) -> Path:
    """``<run_dir>/checkpoints/last.ckpt``."""
    return Path(run_dir) / "checkpoints" / CHECKPOINT_NAME


def rng_states() -> dict[str, Any]:
    """Python, numpy and torch (CPU and CUDA) generator states."""
    import torch  # here, not at import: `python -m fedfew.check` stays light

    states = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict[str, Any]) -> None:
    """Restore :func:`rng_states`."""
    import torch

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
    import torch

    return torch.load(path, map_location="cpu", weights_only=False)


def resolve_resume(resume: str | None, run_dir: Path) -> Path | None:
    """The checkpoint to resume from: ``None`` (fresh run), ``"auto"`` (the run directory's own
    checkpoint if there is one), or an explicit path (a checkpoint file or a run directory).

    Raises:
        ResumeError: ``"auto"`` in a run directory that holds results but no checkpoint (a
            fresh start there would overwrite them).
    """
    if resume in (None, "", "null", False):
        return None
    if resume == "auto":
        path = checkpoint_path(run_dir)
        if path.is_file():
            return path
        done = [name for name in ("results.json", "metrics.csv") if (Path(run_dir) / name).exists()]
        if done:
            raise ResumeError(
                f"resume=auto: {run_dir} holds a run ({', '.join(done)}) but no checkpoint ({path}), so there is "
                "nothing to continue from and a fresh start would overwrite it; start new runs in another "
                "hydra.run.dir (checkpoint_every=N makes a run resumable after a crash)"
            )
        return None
    path = Path(str(resume)).expanduser().resolve()
    return checkpoint_path(path) if path.is_dir() else path


def flatten_config(cfg: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted key -> leaf value of a (resolved) config; lists are leaves."""
    if isinstance(cfg, DictConfig):
        cfg = OmegaConf.to_container(cfg, resolve=True)
    out: dict[str, Any] = {}
    for key, value in cfg.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flatten_config(value, f"{name}."))
        else:
            out[name] = value
    return out


def _free(key: str) -> bool:
    return free_on_resume(key)


def _show(value: Any) -> str:
    return "(absent)" if value is _ABSENT else "null" if value is None else repr(value)


def check_resume_config(state: Mapping[str, Any], cfg: DictConfig | Mapping[str, Any],
                        source: Any = "the checkpoint") -> str | None:
    """Refuse to continue ``state`` (a checkpoint) under a config that changes results.

    Every key of the checkpoint's stored config and of ``cfg`` is compared, except the keys of
    :data:`RESUME_FREE_KEYS`; a key of :data:`ADDED_KEYS` that the checkpoint lacks counts as
    having its listed value. ``rounds`` may only grow, and only with
    ``resume_extend_rounds=true``; it can never fall below the checkpoint's round.

    Args:
        state: a checkpoint (:meth:`fedfew.simulator.simulation.Simulation.state_dict`): ``config`` (the
            resolved config of the run that wrote it) and ``round``.
        cfg: the new run's config.
        source: how the message names the checkpoint (its path).
    Returns:
        ``None``, or a line to log when ``rounds`` was extended (old -> new rounds).
    Raises:
        ResumeError: naming every differing key with the checkpoint's and the new value (and
            how to proceed), or the checkpoint has no stored config.
    """
    saved = state.get("config")
    if saved is None:
        raise ResumeError(
            f"resume: {source} stores no config (written by an older fedfew), so this run's config cannot be "
            "checked against it; start a new run (resume=null, another hydra.run.dir)"
        )
    old, new = flatten_config(saved), flatten_config(cfg)
    extend = bool(new.get("resume_extend_rounds", False))
    problems, note = [], None
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key, ADDED_KEYS.get(key, _ABSENT)), new.get(key, _ABSENT)
        if _free(key) or a == b:
            continue
        if key == "rounds" and isinstance(a, int) and isinstance(b, int):
            if extend and b > a:
                note = (f"resume: rounds extended from {a} to {b} (resume_extend_rounds=true); the checkpoint is at "
                        f"round {state.get('round')}")
                if new.get("optim.schedule") == "cosine":
                    note += "; optim.schedule=cosine now anneals over the new number of rounds"
                continue
            hint = (f"resume_extend_rounds=true only extends: use rounds >= {a}" if extend
                    else "to run more rounds than the checkpoint's run, add resume_extend_rounds=true")
            problems.append(f"  rounds: checkpoint {a}, now {b} ({hint})")
            continue
        problems.append(f"  {key}: checkpoint {_show(a)}, now {_show(b)}")
    if problems:
        raise ResumeError(
            f"resume: this run's config differs from the one {source} was written with, in keys that change "
            "results:\n" + "\n".join(problems) + "\nResume with the checkpoint's values (the differing keys on the "
            "command line), or start a new run in another hydra.run.dir. Keys a resume may change: "
            + ", ".join(RESUME_FREE_KEYS) + " (docs/resume.md)."
        )
    return note


class StopSignal:
    """Records SIGTERM/SIGUSR1/SIGINT so the loop can checkpoint at the next round boundary.

    Installed only in the main thread of the process; ``requested`` is True once a signal came,
    ``signum`` is the first one. The first Ctrl-C (SIGINT) prints one line saying so (when
    ``announce``); a second Ctrl-C raises :class:`KeyboardInterrupt` at once (no checkpoint).

    Args:
        announce: print the Ctrl-C line (rank 0 only in a multi-process run).
    """

    SIGNALS = ("SIGTERM", "SIGUSR1", "SIGINT")

    def __init__(self, announce: bool = True) -> None:
        self.requested = False
        self.signum: int | None = None
        self.announce = announce
        self._interrupts = 0
        self._previous: dict[int, Any] = {}

    def _handler(self, signum, frame) -> None:
        if signum == signal.SIGINT:
            self._interrupts += 1
            if self._interrupts > 1:
                raise KeyboardInterrupt("second Ctrl-C")
            if self.announce:  # os.write: no buffered IO inside a signal handler
                os.write(2, b"\nCtrl-C: stopping after this round with a checkpoint "
                            b"(press Ctrl-C again to abort at once, without one)\n")
        self.requested = True
        if self.signum is None:
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
