"""``python -m fedfew.runs [ROOT ...]`` (``make runs``): the table of past runs, newest first
(:mod:`fedfew.experiments.run_list`)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fedfew.core.run_folders import python_command
from fedfew.experiments.run_list import default_roots, find_runs, runs_table


def main(argv: list[str] | None = None) -> int:
    """``python -m fedfew.runs [ROOT ...] [--limit N | --all]``: the table of past runs."""
    parser = argparse.ArgumentParser(prog=python_command("fedfew.runs"), description="List fedfew runs, newest first.")
    parser.add_argument("roots", nargs="*", help="folders to search (default: $FEDFEW_OUTPUT_DIR, else outputs and multirun)")
    parser.add_argument("--limit", type=int, default=30, help="newest N runs (default 30)")
    parser.add_argument("--all", action="store_true", help="every run")
    args = parser.parse_args(argv)
    roots = [Path(r) for r in args.roots] or default_roots()
    missing = [str(r) for r in roots if not r.is_dir()]
    if args.roots and missing:
        print(f"error: not a folder: {', '.join(missing)}", file=sys.stderr)
        return 2
    runs = find_runs(roots)
    if not runs:
        print(f"no runs under {', '.join(str(r) for r in roots)} (a run folder holds config.yaml or results.json)")
        return 0
    shown = runs if args.all else runs[: max(args.limit, 0)]
    from rich.console import Console

    table = runs_table(shown, title=f"runs under {', '.join(str(r) for r in roots)} (newest first)")
    # a terminal folds long cells; a file or pipe gets the whole table, unwrapped
    width = None if sys.stdout.isatty() else Console(width=10_000).measure(table).maximum
    console = Console(width=width)
    console.print(table)
    if len(shown) < len(runs):
        console.print(f"{len(runs) - len(shown)} older run(s) not shown (--all)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
