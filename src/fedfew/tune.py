"""``python -m fedfew.tune`` (``make tune``): tune every method the same way, on validation data, and
write presets.

    python -m fedfew.tune --dataset digits --algorithms fedfew fedavg fedrep --trials 12 --jobs 2 \\
        -- trainer.threads=1

The procedure (trials, tuning seeds, confirmation, stability margin, outputs, resuming):
:mod:`fedfew.experiments.tuning` and docs/tuning.md.
"""
from __future__ import annotations

import argparse
import sys
from typing import Callable, Sequence

from fedfew.experiments.launch import (Busy, pass_signals_on, stopped_exit_code)
from fedfew.core.run_folders import python_command
import shlex
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from fedfew.config import presets
from fedfew.config.presets import PresetError, describe_setup, preset_overrides, setup_changing
from fedfew.core.io import atomic_write_text
from fedfew.experiments.launch import exclusive
from fedfew.experiments.preset_files import _write_preset, tuning_seconds
from fedfew.experiments.studies import Slots, open_study, tune_algorithm
from fedfew.experiments.tune_errors import TrialInterrupted, TuneError
from fedfew.experiments.tuning import OBJECTIVES, TRAIN_COMMAND, _echo, plans, setup_presets_dir


# -- command line -----------------------------------------------------------------------------

def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    argv = list(argv)
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    parser = argparse.ArgumentParser(prog=python_command("fedfew.tune"), description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", default="digits", help="dataset config value (default digits)")
    parser.add_argument("--algorithms", nargs="+", required=False, default=None,
                        help="algorithm config values (default: every registered one that can run on the setup)")
    parser.add_argument("--trials", type=int, default=12, help="finished trials per algorithm (default 12)")
    parser.add_argument("--jobs", type=int, default=1, help="trials at a time (default 1)")
    parser.add_argument("--seeds", nargs="*", type=int, default=[0, 1],
                        help="tuning seeds: every trial runs on the first; the best candidate is confirmed on the others "
                             "(default 0 1; a candidate that goes non-finite there is rejected)")
    parser.add_argument("--stability", type=float, default=1.5,
                        help="the chosen values are also run at this multiple of their lr, to report how close to the "
                             "edge of stability the preset sits (default 1.5; > 1)")
    parser.add_argument("--val-fraction", type=float, default=0.2,
                        help="partition.val_fraction of the trials (default 0.2; must be in (0, 1))")
    parser.add_argument("--objective", choices=OBJECTIVES, default="last3",
                        help="last3: mean validation acc of the last 3 evaluations (default) | final")
    parser.add_argument("--sampler-seed", type=int, default=0, help="seed of the TPE sampler (default 0)")
    parser.add_argument("--startup", type=int, default=4,
                        help="random trials before TPE starts modelling (default 4)")
    parser.add_argument("--out", default=None,
                        help="output folder (default $FEDFEW_OUTPUT_DIR or outputs, then tune/<dataset>, plus the "
                             "extra overrides as in a run folder's name, e.g. outputs/tune/digits_partition-pathological)")
    parser.add_argument("--install", choices=("auto", "yes", "no"), default="auto",
                        help="also write the presets to conf/tuned (auto, the default; yes is the same): to "
                             "conf/tuned/<dataset><setup>/ when the extra overrides change the setup | no")
    parser.add_argument("--print-overrides", metavar="PRESET", default=None,
                        help="print a preset file's values as overrides and exit (apply with ~tuned)")
    args = parser.parse_args(argv)
    args.extra = [e for e in extra if e.strip()]
    if args.algorithms is not None:
        args.algorithms = [a for item in args.algorithms for a in item.split()]
    return args


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
        start = time.perf_counter()
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
            table = ["# tune: " + args.dataset, "", f"command: `{command_line}`", "",
                     "| algorithm | best validation acc | confirmed on | values | config defaults' validation acc | "
                     f"sampled trials | at {args.stability:g}x its lr | trials' wall time, summed (min) | "
                     "at a range edge (the range may bind) |",
                     "|---|---|---|---|---|---|---|---|---|",
                     *lines, "", f"total wall time of this invocation: {(time.perf_counter() - start) / 60:.1f} min; "
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


def main(argv: Sequence[str] | None = None, command: Sequence[str] = TRAIN_COMMAND,
         echo: Callable[[str], None] = _echo) -> int:
    """``python -m fedfew.tune``; ``command`` is what runs a trial (``python -m fedfew.train``)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.print_overrides:
        print(" ".join(["~tuned", *preset_overrides(args.print_overrides)]))
        return 0
    return tune_all(args, argv, command, echo)


if __name__ == "__main__":
    pass_signals_on()
    try:
        sys.exit(main())
    except (TuneError, PresetError, Busy) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt as err:  # Ctrl-C, or SIGTERM / SIGHUP passed on to the runs
        print("\ntune stopped: the finished trials are kept and the running ones saved a checkpoint; run the "
              "same command again to continue", file=sys.stderr)
        sys.exit(stopped_exit_code(err))
