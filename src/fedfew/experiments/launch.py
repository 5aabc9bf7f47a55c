"""Training subprocesses of ``make compare`` and ``make tune``: one ``python -m fedfew.train`` per
run, checkpointed so that a run cut short continues where it stopped.

A comparison or a tune of AG News runs for hours. When it is killed (a closed session, a
pre-empted node, Ctrl-C), a finished run is reused, and since a run written by these tools
saves ``checkpoints/last.ckpt`` every :data:`CHECKPOINT_EVERY` rounds, an unfinished one resumes
from its last checkpoint on the next invocation instead of starting again at round 1. A resumed
run gives the figures of an uninterrupted one (:mod:`fedfew.core.checkpoint`; ``checkpoint_every``
and ``resume`` never change results, :data:`fedfew.core.keys.RESULT_NEUTRAL`). The checkpoint is
deleted once the run has written ``results.json`` (an AG News Ditto checkpoint, 21 TextCNNs,
is about 0.25 GB), unless the user set ``checkpoint_every`` themselves.

A run folder is picked up only when it was made with the same overrides, up to those that do
not change results (:func:`fedfew.core.run_folders.result_overrides`); the callers decide what to do with
one that was not (compare refuses, the tune starts the trial afresh).

Two tools never write into one folder at once: each holds :data:`LOCK_FILE` of its output folder
while it runs (:func:`exclusive`), and :func:`launch` refuses a run folder that a live process
still trains (one left behind by a tool killed with SIGKILL, which cannot pass the signal on).
"""
from __future__ import annotations

import fcntl
import os
import shlex
import shutil
import signal
import subprocess
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence

from fedfew.core.checkpoint import checkpoint_path
from fedfew.core.nonfinite import DIVERGED_EXIT

#: rounds between the checkpoints of a run launched here (about 2.5 min of AG News, at most that
#: is lost per interrupted run)
CHECKPOINT_EVERY = 5

RESULTS = "results.json"
#: where :func:`launch` moves the results.json of a run that then failed (kept to read, never reused)
FAILED_RESULTS = "results.failed.json"
#: held (``flock``) in a tool's output folder while ``make compare`` or ``make tune`` writes there;
#: it holds the holder's description
LOCK_FILE = ".fedfew.lock"


class Busy(RuntimeError):
    """Another process writes into the folder: a tool holds its :data:`LOCK_FILE`, or a live
    process trains the run folder."""


@contextmanager
def exclusive(folder: Path, tool: str) -> Iterator[None]:
    """Hold ``folder``'s :data:`LOCK_FILE` while the block runs (the folder is created).

    The lock is an ``flock``, so the system releases it when the holder ends, even when killed;
    a leftover file locks nothing.

    Args:
        tool: what holds it, for the message of the one refused (``make compare``).
    Raises:
        Busy: another process holds it (the message names that process and how to go on).
    """
    import socket

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    handle = (folder / LOCK_FILE).open("a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise Busy(f"{folder} is in use by {holder}: two tools writing into one folder would spoil each "
                   f"other's runs; wait for it to end, stop it, or use another output folder") from None
    try:
        handle.seek(0)
        handle.truncate()
        handle.write(f"{tool} (host {socket.gethostname()}, pid {os.getpid()}, since "
                     f"{time.strftime('%Y-%m-%d %H:%M:%S')})\n")
        handle.flush()
        yield
    finally:
        handle.close()  # releases the lock


def check_not_training(run_dir: Path) -> None:
    """Raise :class:`Busy` when a live process on this host trains ``run_dir``
    (:data:`fedfew.core.run_folders.PID_FILE`), e.g. a run whose tool was killed with SIGKILL."""
    from fedfew.core.run_folders import live_trainer

    holder = live_trainer(run_dir)
    if holder:
        pid = holder.split()[-1]
        raise Busy(f"{run_dir} is being trained by process {pid} on {holder.split()[0]} (left running by an "
                   f"earlier, killed tool?); wait for it to end or stop it (kill {pid}, it saves a checkpoint), "
                   f"then run the same command again")


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def recorded_overrides(run_dir: Path) -> list[str] | None:
    """The task overrides a run was started with (``.hydra/overrides.yaml``; None when absent)."""
    path = Path(run_dir) / ".hydra" / "overrides.yaml"
    if not path.exists():
        return None
    from omegaconf import OmegaConf

    return [str(o) for o in OmegaConf.load(path)]


def progress(run_dir: Path, overrides: Sequence[str]) -> str:
    """How far ``run_dir`` got with the run of ``overrides``.

    Returns:
        ``"done"`` (it holds results.json), ``"checkpoint"`` (it holds checkpoints/last.ckpt but no
        results), ``"none"`` (neither), or ``"stale"`` (results or a checkpoint, but recorded with
        overrides that change results: another experiment's). Folders without a record of their
        overrides count as this run's.
    """
    from fedfew.core.run_folders import result_overrides

    run_dir = Path(run_dir)
    if (run_dir / RESULTS).exists():
        state = "done"
    elif checkpoint_path(run_dir).is_file():
        state = "checkpoint"
    else:
        return "none"
    recorded = recorded_overrides(run_dir)
    wanted = [o for o in overrides if not _key(o).startswith("hydra.")]
    if recorded is not None:
        from fedfew.experiments.portable import portable_text, replacements

        rules = replacements()  # a finished run's record names the checkout as <checkout> (tidy)
        if [portable_text(o, rules) for o in result_overrides(recorded)] != \
                [portable_text(o, rules) for o in result_overrides(wanted)]:
            return "stale"
    return state


def interrupted(code: int) -> bool:
    """Whether a run's exit code says a signal stopped it (``128 + signum`` after fedfew.train saved
    a checkpoint on Ctrl-C / SIGTERM / SIGUSR1, or ``-signum`` when the signal killed it), rather
    than that it failed: run again, it continues from its checkpoint."""
    return code < 0 or code > 128


def outcome(code: int, run_dir: Path) -> str:
    """A launched run's end: ``done`` (exit 0 and results.json), ``diverged`` (it stopped early
    because every client went non-finite, exit :data:`fedfew.core.nonfinite.DIVERGED_EXIT`, with its
    results.json: an outcome, not a crash), ``interrupted`` (a signal stopped it,
    :func:`interrupted`: its checkpoint is kept) or ``failed``."""
    if code in (0, DIVERGED_EXIT) and (Path(run_dir) / RESULTS).exists():
        return "done" if code == 0 else "diverged"
    return "interrupted" if interrupted(code) else "failed"


def refused_checkpoint(log_path: Path) -> bool:
    """Whether the last run logged to ``log_path`` stopped because fedfew.train refused to resume
    from the checkpoint (a config that differs in a key that changes results, e.g. one added by a
    newer fedfew): its ``ResumeError`` messages start with ``resume``, printed as ``error: resume``."""
    try:
        text = Path(log_path).read_text(errors="replace")
    except OSError:
        return False
    return "\nerror: resume" in text[max(0, text.rfind("\n$ ")):]  # the last launch's output only


def checkpointing(overrides: Sequence[str]) -> bool:
    """Whether :func:`launch` adds ``checkpoint_every`` (the user did not set it)."""
    return not any(_key(o) == "checkpoint_every" for o in overrides)


def launch(overrides: Sequence[str], run_dir: Path, log_path: Path,
           command: Sequence[str]) -> tuple[int, float, float, bool]:
    """Train one run in a subprocess, its output to ``log_path`` (overwritten; appended to when
    the run continues from a checkpoint).

    The run gets ``checkpoint_every=CHECKPOINT_EVERY`` unless ``overrides`` set it, and
    ``resume=<run_dir>/checkpoints/last.ckpt`` when that file exists (check it is this run's with
    :func:`progress` first). After a successful run the checkpoint is deleted if it was added here;
    a run that fails after writing results.json has it renamed to :data:`FAILED_RESULTS`, so that
    no later invocation takes it for a finished run.

    Args:
        overrides: the run's Hydra overrides, ``hydra.run.dir=<run_dir>`` among them.
        command: the program, e.g. ``(sys.executable, "-m", "fedfew.train")``.
    Returns:
        (exit code, wall seconds, CPU seconds of the subprocess (user + system), whether it
        resumed from a checkpoint).
    Raises:
        Busy: a live process already trains ``run_dir`` (:func:`check_not_training`).
    """
    global _launched
    run_dir = Path(run_dir)
    # One check of the stop flag, under the lock that the signal handler takes: a stop that came
    # first starts nothing and leaves a queued run's folder and log as they were; a stop that comes
    # after finds the run in _RUNNING and signals it.
    with _LOCK:
        if _STOPPING.is_set():
            return 128 + signal.SIGTERM, 0.0, 0.0, False
        check_not_training(run_dir)
        extra = [f"checkpoint_every={CHECKPOINT_EVERY}"] if checkpointing(overrides) else []
        resumed = checkpoint_path(run_dir).is_file()
        if resumed:
            extra.append(f"resume={checkpoint_path(run_dir)}")
        argv = [*command, *overrides, *extra]
        log_path.parent.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        with log_path.open("a" if resumed else "w") as log:  # a continued run's log keeps its first part
            log.write("$ " + " ".join(shlex.quote(a) for a in argv) + "\n")
            log.flush()
            # the child gets its own copy of the log's descriptor, so closing ours here is fine
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        _RUNNING.add(proc)
        _launched += 1
    try:
        _, status, usage = os.wait4(proc.pid, 0)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    finally:
        with _LOCK:
            _RUNNING.discard(proc)
    code = os.waitstatus_to_exitcode(status)
    if code in (0, DIVERGED_EXIT):  # finished, or stopped early as diverged (an outcome with its results)
        tidy(run_dir, overrides, log_path)
        (run_dir / FAILED_RESULTS).unlink(missing_ok=True)  # an earlier attempt's, now superseded
    elif not interrupted(code) and (run_dir / RESULTS).exists():
        # it failed after writing its results (plots, W&B, ...): failed now, so failed on every rerun
        # too, instead of being reused as finished next time
        (run_dir / RESULTS).replace(run_dir / FAILED_RESULTS)
    return code, time.perf_counter() - start, usage.ru_utime + usage.ru_stime, resumed


def tidy(run_dir: Path, overrides: Sequence[str], log_path: Path | None = None) -> None:
    """For a finished run (results.json exists; also one found finished, e.g. by a process left
    running by a killed tool): delete its checkpoint when :func:`launch` added the checkpointing
    (not the user), and rewrite its folder and log without the machine's paths
    (:func:`fedfew.experiments.portable.make_portable`: its ``data_dir``, the checkout and the home
    folder become ``<data_dir>``, ``<checkout>`` and ``~``), since make compare and make tune
    write results meant to be committed."""
    from fedfew.experiments.portable import make_portable

    if not (Path(run_dir) / RESULTS).exists():
        return
    if checkpointing(overrides):
        shutil.rmtree(Path(run_dir) / "checkpoints", ignore_errors=True)
    make_portable(run_dir, extra_files=[log_path] if log_path is not None else [])


# -- signals ------------------------------------------------------------------------------------

_LOCK = threading.Lock()
_RUNNING: set[subprocess.Popen] = set()
_STOPPING = threading.Event()
_launched = 0  # runs started by launch() in this process, counted under _LOCK


def launched() -> int:
    """How many training runs :func:`launch` has started in this process (a tool compares it
    before and after to tell whether an invocation trained anything, or only reused finished runs)."""
    with _LOCK:
        return _launched


class Stopped(KeyboardInterrupt):
    """SIGTERM, SIGHUP or SIGINT reached the tool (raised in its main thread, like Ctrl-C's
    KeyboardInterrupt). ``signum``: the signal."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def pass_signals_on() -> None:
    """In the tool's main thread: on SIGTERM, SIGHUP or SIGINT (a ``kill``, Slurm's pre-emption, a
    closed terminal, Ctrl-C or ``kill -INT``), send SIGTERM to every running training run, so each
    saves a checkpoint at the end of its round and stops, start no new run, and raise
    :class:`Stopped`. Without this the runs would train on with no parent, a rerun would race them
    for their folders, and (SIGINT to the tool alone) a worker thread could start the next queued
    run after the tool said it stopped. A run that also got Ctrl-C from the terminal takes the
    extra SIGTERM as the same request (:class:`fedfew.core.checkpoint.StopSignal`). SIGINT is left
    alone where it was ignored at start (a job started with ``nohup ... &`` from a script)."""

    def handler(signum, frame):
        with _LOCK:
            _STOPPING.set()
            running = list(_RUNNING)
        for proc in running:
            try:
                proc.send_signal(signal.SIGTERM)
            except OSError:  # already gone
                pass
        raise Stopped(signum)

    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        if signum == signal.SIGINT and signal.getsignal(signum) is signal.SIG_IGN:
            continue
        signal.signal(signum, handler)


def stopped_exit_code(err: KeyboardInterrupt) -> int:
    """The tool's exit code after :class:`Stopped` (128 + signum; 130 for Ctrl-C), or 130 for a
    KeyboardInterrupt raised before :func:`pass_signals_on` was installed."""
    return 128 + (err.signum if isinstance(err, Stopped) else signal.SIGINT)
