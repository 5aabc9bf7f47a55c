"""Run folders: their names, their identity, the lines that say where a run is, and whether one is running.

**Names.** ``python -m fedfew.train`` writes into
``${FEDFEW_OUTPUT_DIR:-outputs}/<dataset>/<algorithm>/<YYYY-MM-DD_HH-MM-SS>[_<overrides>]``
(``hydra.run.dir`` in conf/config.yaml). ``<overrides>`` is :func:`run_suffix` of the
command line: each override as ``<last part of the key>-<value>`` (``algorithm.K=5`` ->
``K-5``, ``partition=pathological`` -> ``partition-pathological``), joined by ``_``, at most
:data:`MAX_SUFFIX` characters (then ``_+N`` for the N overrides left out; ``.hydra/overrides.yaml``
always holds all of them), with only ``A-Z a-z 0-9 . _ + -`` (anything else becomes ``_``), so
the folder can be pasted back as ``hydra.run.dir=...``. Overrides that do not change results
are left out (:data:`IN_PATH`: dataset and algorithm are in the path already; and the keys that
:mod:`fedfew.core.keys` marks as not changing results: data_dir,
trainer.threads, logger, resume, checkpointing).

**Identity.** Two runs are the same experiment when their overrides match up to
:data:`fedfew.core.keys.RESULT_NEUTRAL` (:func:`result_overrides`; ``data_dir`` is one: where the data lies is no
part of what a run computes) and they read the same data, compared by content
(:func:`data_mismatch`, :mod:`fedfew.data.fingerprint`). Text meant to be committed (preset
headers, compare.md) names no absolute path of a machine: :func:`portable_overrides`,
:func:`portable_command`.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
import sys
from pathlib import Path
from typing import Any, Iterable

from fedfew.core.keys import changes_results

#: overrides left out of a run folder's name besides the keys that do not change results
#: (:data:`fedfew.core.keys.RESULT_NEUTRAL`): the path already names these
IN_PATH = ("dataset", "algorithm")
#: longest ``<overrides>`` part of a run folder's name, in characters
MAX_SUFFIX = 60
#: longest setup part of make tune's and make compare's default folder names (:func:`setup_folder`)
SETUP_SUFFIX = 120
#: a run without results.json counts as running when a file of it changed this recently
RUNNING_WINDOW_S = 600.0
RESOLVER = "fedfew.run_suffix"
#: ``<host> <pid>`` of the process training a run, in its folder while it trains
PID_FILE = ".fedfew.pid"
#: the checkout this package runs from (editable install: src/fedfew -> the repository root)
CHECKOUT = Path(__file__).resolve().parents[3]
_UNSAFE = re.compile(r"[^A-Za-z0-9._+-]+")


def _excluded(key: str) -> bool:
    """Whether a folder's name leaves ``key`` out: named by the path, or no change to results."""
    return key in IN_PATH or not changes_results(key)


#: keys whose value is a place on one machine, not what a run computes: ``data_dir`` is where the
#: data lies; what it holds is compared by content instead (:mod:`fedfew.data.fingerprint`). Text
#: meant to be committed shows them as ``<key>`` (:func:`portable_overrides`).
PATH_KEYS = ("data_dir",)


def result_overrides(overrides: Iterable[str]) -> list[str]:
    """``overrides`` without the ones that do not change results (:mod:`fedfew.core.keys`), in order: what two runs must share,
    besides their data (:mod:`fedfew.data.fingerprint`), to count as the same experiment.

    >>> result_overrides(["algorithm.K=5", "trainer.threads=1", "logger=none", "data_dir=/d"])
    ['algorithm.K=5']
    """
    return [o for o in map(str, overrides) if changes_results(o.split("=", 1)[0].lstrip("+~"))]


#: how :func:`portable_path` shows the folder of an absolute path outside the checkout
ELSEWHERE = "<elsewhere>"


def portable_path(path: str | Path) -> str:
    """``path`` as text meant to be committed shows it: relative to the checkout (:data:`CHECKOUT`)
    when it lies inside it (symlinks resolved first, so ``src/fedfew/conf/tuned/x.yaml`` shows as
    ``conf/tuned/x.yaml``); an absolute path outside it as ``<elsewhere>/<its name>`` (it names
    a folder of one machine); a relative path as given.

    >>> portable_path(CHECKOUT / "results" / "agnews"), portable_path("/work/notes/tune2")
    ('results/agnews', '<elsewhere>/tune2')
    """
    path = Path(path)
    if not path.is_absolute():
        return str(path)
    for candidate in (path.resolve(), path):
        try:
            return str(candidate.relative_to(CHECKOUT))
        except ValueError:
            continue
    return f"{ELSEWHERE}/{path.name}" if path.name else ELSEWHERE


def _portable_token(token: str) -> str:
    key, eq, value = token.partition("=")
    name = key.lstrip("+~")
    if eq and name in PATH_KEYS:
        return f"{key}=<{name}>"
    if eq and value.startswith("/"):
        return f"{key}={portable_path(value)}"
    return portable_path(token) if token.startswith("/") else token


def portable_overrides(overrides: Iterable[str]) -> list[str]:
    """``overrides`` as committed text (a preset's header, compare.md) records them: a
    :data:`PATH_KEYS` value as ``<key>`` (``data_dir=<data_dir>``: the data is identified by its
    fingerprint, not its folder) and any other absolute path as :func:`portable_path` shows it
    (relative to the checkout, or ``<elsewhere>/<name>``); the rest as given.

    >>> portable_overrides(["data_dir=/work/shared/data", "trainer.threads=1"])
    ['data_dir=<data_dir>', 'trainer.threads=1']
    """
    return [_portable_token(str(o)) for o in overrides]


def portable_command(argv: str | Iterable[str]) -> str:
    """A command line (a string, split as a shell would, or its words) with
    :func:`portable_overrides` applied to every word, quoted for a shell.

    >>> portable_command("python -m fedfew.tune --out results/t -- data_dir=/data 'eval.also=[finetune]'")
    "python -m fedfew.tune --out results/t -- 'data_dir=<data_dir>' 'eval.also=[finetune]'"
    """
    import shlex

    words = shlex.split(argv) if isinstance(argv, str) else list(map(str, argv))
    return " ".join(shlex.quote(w) for w in portable_overrides(words))


def recorded_data(run_dir: str | Path) -> dict[str, Any] | None:
    """What a run folder records of the data it read: its results.json, else its checkpoint's
    state (each holds ``config``, ``partition_hash`` and, since it was recorded,
    ``data_fingerprint``); None when it has neither, or they cannot be read."""
    import pickle

    from fedfew.core.checkpoint import checkpoint_path, load_checkpoint

    run_dir = Path(run_dir)
    try:
        if (run_dir / "results.json").exists():
            return json.loads((run_dir / "results.json").read_text())
        if checkpoint_path(run_dir).is_file():
            state = load_checkpoint(checkpoint_path(run_dir))
            return {k: state.get(k) for k in ("config", "partition_hash", "data_fingerprint")}
    except (OSError, ValueError, RuntimeError, EOFError, pickle.UnpicklingError):
        return None
    return None


def data_mismatch(run_dir: str | Path, data_dir: str | Path) -> str | None:
    """Why the results or checkpoint in ``run_dir`` were not made from the data in ``data_dir``,
    or None when they were: their ``data_fingerprint`` against that of the data there (a run
    recorded before the fingerprint: its ``partition_hash`` against the partition its config gets
    on that data). The data is loaded once per process and dataset config
    (:func:`fedfew.data.fingerprint.data_check`). Check the overrides first
    (:func:`fedfew.experiments.launch.progress`: a folder of other overrides is stale whatever its data).

    Returns:
        e.g. ``"data fingerprint 0123456789ab recorded, 5a6b7c8d9e0f in /data"``, or
        ``"unreadable results or checkpoint"``.
    Raises:
        fedfew.data.base.DataNotFoundError: the dataset's files are not in ``data_dir``.
        ValueError: they cannot be read (a malformed file), or the run's partition cannot be made
            on them (a run recorded before the fingerprint).
    """
    from fedfew.data.fingerprint import data_check

    recorded = recorded_data(run_dir)
    if recorded is None:
        return "unreadable results or checkpoint"
    return data_check(data_dir).mismatch(recorded)


def _named(overrides: Iterable[str]) -> list[str]:
    """The overrides a folder's name shows: key=value ones, neither deletions nor keys :func:`_excluded` leaves out."""
    return [t for t in map(str, overrides)
            if "=" in t and not t.startswith("~") and not _excluded(t.split("=", 1)[0].lstrip("+~"))]


def run_suffix(overrides: Iterable[str], limit: int = MAX_SUFFIX) -> str:
    """``_<overrides>`` for a run folder's name from Hydra's task overrides (``""`` without any
    kept); see the module docstring. ``limit``: the longest suffix, in characters.

    >>> run_suffix(["algorithm.K=5", "partition=pathological", "data_dir=/data", "+dataset.augment=true"])
    '_K-5_partition-pathological_augment-true'
    """
    items = []
    for text in _named(overrides):
        key, _, value = text.partition("=")
        key = key.lstrip("+~")
        short = key.split("/")[-1].rsplit(".", 1)[-1]
        items.append(_UNSAFE.sub("_", f"{short}-{value}").strip("_") or short)
    kept, length = [], 0
    for i, item in enumerate(items):
        more = len(items) - i - 1
        budget = limit - (len(f"_+{more}") if more else 0)
        if length + 1 + len(item) > budget:
            break
        kept.append(item)
        length += 1 + len(item)
    left = len(items) - len(kept)
    return ("_" + "_".join(kept) if kept else "") + (f"_+{left}" if left else "")


def setup_folder(kind: str, dataset: str, extra: Iterable[str]) -> Path:
    """``<$FEDFEW_OUTPUT_DIR or outputs>/<kind>/<dataset><setup>``, the default folder of ``make
    tune`` (kind ``tune``) and ``make compare`` (kind ``compare``): the setup is named from the
    extra overrides as a run folder's name is (:func:`run_suffix`), so tunes or comparisons of
    different setups never meet each other's runs, e.g. ``outputs/compare/digits_partition-dirichlet``.
    The setup part is at most :data:`SETUP_SUFFIX` characters; when overrides are left out of it
    (``_+N``), an 8-hex digest of all of them follows (``_+2-1a2b3c4d``), so two setups still get
    two folders. Absolute (resolved against the working directory, as Hydra's run folders are)."""
    root = Path(os.environ.get("FEDFEW_OUTPUT_DIR") or "outputs")  # where runs go too (conf/config.yaml)
    suffix = run_suffix(extra, limit=SETUP_SUFFIX)
    if re.search(r"_\+\d+$", suffix):  # overrides left out of the name: a digest of all keeps setups apart
        suffix += "-" + hashlib.sha1(" ".join(_named(extra)).encode()).hexdigest()[:8]
    return (root / kind / f"{dataset}{suffix}").expanduser().resolve()


def older_setup_folder(kind: str, dataset: str, out: Path, marker: str) -> Path | None:
    """``<root>/<kind>/<dataset>`` when it holds work (a file matching ``marker``) and ``out``,
    the folder named after the setup, does not exist yet: such a folder was made before default
    folders named their setup (every setup went there), and the user may want to continue it
    with ``COMPARE_OUT=`` / ``TUNE_OUT=``. None otherwise."""
    older = setup_folder(kind, dataset, [])
    if out != older and not out.exists() and any(older.glob(marker)):
        return older
    return None


#: the make variable that chooses each kind's folder, and what its folder holds
_SETUP_KINDS = {"compare": ("COMPARE_OUT", "*/seed*/results.json"), "tune": ("TUNE_OUT", "*/study.db")}


def older_setup_note(kind: str, dataset: str, out: Path) -> str | None:
    """The line that points a user of ``make <kind>`` (``compare`` or ``tune``) to the folder of
    :func:`older_setup_folder`, or None when there is none."""
    variable, marker = _SETUP_KINDS[kind]
    older = older_setup_folder(kind, dataset, out, marker)
    if older is None:
        return None
    return (f"note: {older} holds a {kind} made before the default folder named its setup; to continue it, "
            f"pass {variable}={older} (--out)")


def register_resolvers() -> None:
    """Register ``${fedfew.run_suffix:<overrides>}`` (used by ``hydra.run.dir``) with OmegaConf;
    idempotent."""
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver(RESOLVER):
        OmegaConf.register_new_resolver(RESOLVER, lambda overrides: run_suffix(list(overrides or [])))


def python_command(module: str) -> str:
    """``<python> -m <module>``, for a command printed on the console: ``<python>`` is the running
    interpreter (:data:`sys.executable`: a bare ``python`` fails outside an activated venv),
    relative to the working directory when that is shorter (``.venv/bin/python`` in the checkout),
    quoted for a shell. Console output only: committed text (a preset's header, compare.md)
    records ``python -m ...`` (:func:`portable_command`), never a path of this machine.

    >>> python_command("fedfew.reporting.plots").endswith(" -m fedfew.reporting.plots")
    True
    """
    import shlex

    python = sys.executable or "python"
    if os.path.isabs(python):
        try:
            relative = os.path.relpath(python)
        except ValueError:  # another drive (Windows)
            relative = python
        python = min(python, relative if os.sep in relative else f".{os.sep}{relative}", key=len)
    return f"{shlex.quote(python)} -m {module}"


def display_path(path: str | Path) -> str:
    """``path`` relative to the working directory when it lies below it, else absolute."""
    path = Path(path).absolute()
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def where_lines(run_dir: str | Path, finished: bool = True) -> list[str]:
    """The lines printed at the end of a run (rank 0): its folder and the commands that open
    its notebook (a finished run only: the notebook reads results.json) and redraw its plots.
    The notebook command is ``make notebook RUN=...`` when the working directory is the
    checkout (where the Makefile is), else ``<python> -m fedfew.notebook ...``; ``<python>`` is
    the interpreter that runs (:func:`python_command`)."""
    shown = display_path(run_dir)
    lines = [f"run folder: {shown}" + ("" if finished else "   (stopped early: metrics.csv, history.json.gz and plots "
                                                           "hold the rounds so far)")]
    if finished:
        here = Path.cwd().resolve() == CHECKOUT and (CHECKOUT / "Makefile").is_file()
        command = f"make notebook RUN={shown}" if here else f"{python_command('fedfew.notebook')} {shown}"
        lines.append(f"  notebook: {command}   (writes analysis.html there)")
    lines.append(f"  plots:    {shown}/plots   (redraw: {python_command('fedfew.reporting.plots')} {shown})")
    return lines


def mark_running(run_dir: str | Path) -> None:
    """Record this process (host and pid) as the one training ``run_dir`` (:data:`PID_FILE`)."""
    import socket

    (Path(run_dir) / PID_FILE).write_text(f"{socket.gethostname()} {os.getpid()}\n")


def clear_running(run_dir: str | Path) -> None:
    """Remove :data:`PID_FILE` (the run ended or stopped)."""
    (Path(run_dir) / PID_FILE).unlink(missing_ok=True)


def live_trainer(run_dir: str | Path) -> str | None:
    """``"<host> <pid>"`` of the process training ``run_dir`` when that process still runs on this
    host (:data:`PID_FILE`); None otherwise (no file, a dead process, or another host)."""
    try:
        return (Path(run_dir) / PID_FILE).read_text().strip() if trainer_alive(Path(run_dir)) else None
    except OSError:  # the run ended meanwhile
        return None


def _runs_fedfew(pid: int) -> bool:
    """Whether live process ``pid`` runs fedfew (its command line names it), so that a pid the
    system gave to another program since (after a crash or a reboot left the file) is not taken
    for the run's; True where there is no ``/proc`` or no command line (yet) to tell."""
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return True
    return not command or b"fedfew" in command  # empty: a process between fork and exec, or a zombie


def trainer_alive(run_dir: Path) -> bool | None:
    """Whether the process in the run's :data:`PID_FILE` still runs; None when unknown (no
    file, a process on another host, or a live pid whose command line does not name fedfew: most
    likely reused by another program, or a notebook kernel training in-process; the files' age
    decides then)."""
    import socket

    try:
        host, pid = (run_dir / PID_FILE).read_text().split()
        pid = int(pid)
    except (OSError, ValueError):
        return None
    if host != socket.gethostname():
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        pass
    return True if _runs_fedfew(pid) else None


def diverged_clients(results: dict[str, Any]) -> list[int]:
    """Ids of the clients whose scored model diverged: its loss on the client's selection split
    is non-finite (``clients[i].selection_loss`` of a results.json is NaN or inf, which
    :func:`fedfew.simulator.evaluation.evaluate_clients` gives only when every candidate model of the client
    is non-finite there). Such a model predicts one class for every sample, yet a run where only
    some clients diverged can still score above the majority label, so the figure says nothing of
    it; :func:`fedfew.reporting.callbacks.summary_lines` and the comparison report it.

    Args:
        results: a run's results.json (a client without ``selection_loss`` counts as finite).
    """
    out = []
    for c in results.get("clients", []):
        loss = c.get("selection_loss")
        if loss is not None and not math.isfinite(float(loss)):
            out.append(int(c["id"]))
    return out
