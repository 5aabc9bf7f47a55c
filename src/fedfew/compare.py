"""``python -m fedfew.compare`` (``make compare``): run several algorithms on the same partitions and
seeds and tabulate them.

    python -m fedfew.compare --dataset digits --algorithms fedfew fedavg ifca --seeds 0 1 2 \\
        -- rounds=20 data_dir=/path/to/data     # -> outputs/compare/digits_rounds-20

What a comparison runs, reuses and writes: :mod:`fedfew.experiments.comparison` and docs/compare.md.
"""
from __future__ import annotations

import argparse
import sys
from typing import Sequence

from fedfew.core.run_folders import python_command
from fedfew.experiments.comparison import compare
from fedfew.experiments.comparison_table import CompareError
from fedfew.experiments.launch import Busy


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    argv = list(argv)
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    parser = argparse.ArgumentParser(prog=python_command("fedfew.compare"), description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", default="digits", help="dataset config value (default digits)")
    parser.add_argument("--algorithms", nargs="+", default=None,
                        help="algorithm config values (default: every registered one that can run on the setup)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0], help="seeds (default 0)")
    parser.add_argument("--out", default=None,
                        help="output folder (default $FEDFEW_OUTPUT_DIR or outputs, then compare/<dataset>, plus the extra "
                             "overrides as in a run folder's name, e.g. outputs/compare/digits_partition-dirichlet)")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time (default 1)")
    parser.add_argument("--presets", default=None,
                        help="folder of <dataset>_<algorithm>.yaml presets to use instead of conf/tuned "
                             "(make tune's <out>/presets), or 'none' for the config defaults")
    parser.add_argument("--reference", default="fedfew",
                        help="the method every other is paired against (default fedfew; absent: the first algorithm)")
    args = parser.parse_args(argv)
    args.extra = [e for e in extra if e.strip()]
    # one string with spaces (make ALGORITHMS="a b") is accepted as well as separate words
    if args.algorithms is not None:
        args.algorithms = [a for item in args.algorithms for a in item.split()]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    return compare(args, argv)


if __name__ == "__main__":
    from fedfew.experiments.launch import pass_signals_on, stopped_exit_code

    pass_signals_on()
    try:
        sys.exit(main())
    except (CompareError, Busy, ValueError) as err:  # stale results, a busy folder, unknown names
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt as err:  # Ctrl-C, SIGINT, SIGTERM or SIGHUP: passed on to the runs
        print("\ncomparison stopped: the finished runs are kept and the running ones saved a checkpoint; run "
              "the same command again to continue", file=sys.stderr)
        sys.exit(stopped_exit_code(err))
