"""``make tune`` from start to end: every algorithm's study on the shared workers, then the presets
and ``tune.md`` (:func:`tune_all`). The procedure: :mod:`fedfew.experiments.tuning`."""
from __future__ import annotations

import shlex
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

from fedfew.config import presets
from fedfew.config.presets import describe_setup, setup_changing
from fedfew.core.io import atomic_write_text
from fedfew.core.run_folders import portable_command, python_command
from fedfew.experiments.launch import exclusive, launched
from fedfew.experiments.preset_files import _write_preset, tuning_seconds
from fedfew.experiments.studies import Slots, open_study, tune_algorithm
from fedfew.experiments.tune_errors import TrialInterrupted, TuneError
from fedfew.experiments.tuning import TRAIN_COMMAND, _echo, plans, setup_presets_dir


def _invocation_wall(runs_started: int, seconds: float) -> str:
    """The tune.md line on this invocation: its wall time, or that it trained nothing (every
    trial had finished before: it only wrote the presets, so its "0.0 min" would read oddly).

    >>> _invocation_wall(0, 2.0), _invocation_wall(3, 90.0)
    ('this invocation trained nothing (every trial had finished; it wrote the presets)', 'total wall time of this invocation: 1.5 min')
    """
    if runs_started == 0:
        return "this invocation trained nothing (every trial had finished; it wrote the presets)"
    return f"total wall time of this invocation: {seconds / 60:.1f} min"


def tune_all(args, argv: Sequence[str], command: Sequence[str] = TRAIN_COMMAND,
             echo: Callable[[str], None] = _echo) -> int:
    """Run every algorithm's study of ``args`` (:func:`fedfew.tune.parse_args`) on shared workers, write
    the presets and ``tune.md``; ``argv`` is the command line recorded in them.

    Raises:
        TuneError: an algorithm's study failed or was interrupted (the others' presets are written).
    """
    import optuna

    from fedfew.core.run_folders import older_setup_note

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    all_plans = plans(args)
    out = all_plans[0].out
    note = None if args.out else older_setup_note("tune", args.dataset, out)
    if note:
        echo(note)
    install = None if args.install == "no" else setup_presets_dir(args.dataset, args.extra)
    command_line = " ".join(shlex.quote(a) for a in ["python", "-m", "fedfew.tune", *argv])
    with exclusive(out, "make tune"):  # one tool at a time writes into out
        for plan in all_plans:  # a folder holding another tune is refused before anything runs
            open_study(plan)
        start, launched_before = time.perf_counter(), launched()
        lines, errors, interrupted = [], [], []
        trials_wall = 0.0  # every invocation's trials: a re-run that only rewrites presets keeps the figure
        for plan in all_plans:
            echo(f"{plan.algorithm}: {plan.trials} trials on {describe_setup(plan.cfg)}; search "
                 + "; ".join(d.describe() for d in plan.space))
        # every study runs in its own thread on the shared workers (Slots), started in the listed order:
        # the earlier-listed algorithm's runs first, the next one filling any idle worker
        slots = Slots(args.jobs)
        try:
            with ThreadPoolExecutor(max_workers=len(all_plans)) as studies:
                try:
                    futures = []
                    for i, plan in enumerate(all_plans):
                        queued = threading.Event()
                        futures.append(studies.submit(tune_algorithm, plan, command, echo, slots, i, queued))
                        queued.wait()
                    for plan, future in zip(all_plans, futures):
                        try:
                            study = future.result()
                        except TuneError as err:  # the other algorithms go on; said now, raised at the end
                            echo(f"  {plan.algorithm} stopped: {str(err).splitlines()[0]}")
                            errors.append((plan.algorithm, err))
                            continue
                        except TrialInterrupted as err:
                            interrupted.append((plan.algorithm, err))
                            continue
                        lines.append(_write_preset(plan, study, out, install, command_line, echo))
                        trials_wall += tuning_seconds(study)
                except BaseException:  # Ctrl-C: start nothing new (the running trials save a checkpoint and stop)
                    slots.stop()
                    raise
        finally:
            slots.close(wait=False)
        if lines:
            table = ["# tune: " + args.dataset, "", f"command: `{portable_command(command_line)}`", "",
                     "| algorithm | best validation acc | confirmed on | values | config defaults' validation acc | "
                     f"sampled trials | at {args.stability:g}x its lr | trials' wall time, summed (min) | "
                     "at a range edge (the range may bind) |",
                     "|---|---|---|---|---|---|---|---|---|",
                     *lines, "", f"{_invocation_wall(launched() - launched_before, time.perf_counter() - start)}; "
                     f"the trials' wall time summed over every invocation: {trials_wall / 60:.1f} min "
                     f"({args.jobs} at a time)"]
            if errors or interrupted:
                table.append(f"not finished: {', '.join(a for a, _ in errors + interrupted)}")
            atomic_write_text(out / "tune.md", "\n".join(table) + "\n")
        if interrupted:
            raise TuneError(f"interrupted ({'; '.join(str(e) for _, e in interrupted)}); run the same command again to "
                            "continue: the running trials resume from their checkpoints")
        if errors:
            raise TuneError("\n\n".join(str(e) for _, e in errors)
                            + (f"\n\n(the presets of the other algorithms are written to {out / 'presets'})" if lines else ""))
        if install is None:
            echo(f"presets written to {out / 'presets'} only (--install no); use them with "
                 f"make compare PRESETS={out / 'presets'} (or {python_command('fedfew.compare')} --presets ...)")
        elif install != presets.TUNED_DIR:
            echo(f"presets installed in {install} (the overrides {setup_changing(args.extra)} change the setup): "
                 "make compare with the same overrides uses them; make train with tuned="
                 f"{install.name}/{args.dataset}_<algorithm>")
        echo(f"tune done in {(time.perf_counter() - start) / 60:.1f} min; summary {out / 'tune.md'}")
    return 0
