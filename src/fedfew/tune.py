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

from fedfew.config.presets import PresetError, preset_overrides
from fedfew.core.run_folders import python_command
from fedfew.experiments.launch import Busy, pass_signals_on, stopped_exit_code
from fedfew.experiments.tune_errors import TuneError
from fedfew.experiments.tune_session import tune_all
from fedfew.experiments.tuning import OBJECTIVES, TRAIN_COMMAND, _echo

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
    except KeyboardInterrupt as err:  # Ctrl-C, SIGINT, SIGTERM or SIGHUP: passed on to the runs
        print("\ntune stopped: the finished trials are kept and the running ones saved a checkpoint; run the "
              "same command again to continue", file=sys.stderr)
        sys.exit(stopped_exit_code(err))
