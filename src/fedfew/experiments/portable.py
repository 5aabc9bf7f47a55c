"""Finished run folders as committed text: no absolute path of the machine that made them.

A run records where it ran: its ``data_dir`` (config.yaml, results.json, ``.hydra/``), the
checkout (``hydra.run.dir``, Hydra's ``cwd`` and config search path, the interpreter in a log's
command line) and the home folder (the data cache named in train.log). None of it is part of
what the run computed (the data is identified by its fingerprint, :mod:`fedfew.data.fingerprint`),
and committed results must name no machine's folders (issue 35, item 4). :func:`make_portable`
rewrites a finished run's text files with each such path replaced by a mark:

============================  ==================
the run's ``data_dir``        ``<data_dir>``
the checkout (``CHECKOUT``)   ``<checkout>``
the home folder               ``~``
============================  ==================

``make compare`` and ``make tune`` apply it to every run they finish
(:func:`fedfew.experiments.launch.tidy`); for folders made before::

    python -m fedfew.experiments.portable results/agnews/compare_stable results/agnews/tune_stable

A run's own ``make train`` folder keeps its real paths (it is the user's record of that machine).
Binary files (checkpoints, study databases, PNGs) are left as they are.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path
from typing import Iterable, Sequence

from fedfew.core.io import atomic_write_bytes
from fedfew.core.run_folders import CHECKOUT, RUNNING_WINDOW_S, python_command

#: the files rewritten (text); anything else is left as it is
TEXT_SUFFIXES = (".yaml", ".yml", ".json", ".log", ".csv", ".md", ".txt")
DATA_DIR_MARK = "<data_dir>"
CHECKOUT_MARK = "<checkout>"
HOME_MARK = "~"
# a path ends where a path character does not follow (so /data does not match /database)
_END = r"(?![A-Za-z0-9._-])"


def recorded_data_dir(run_dir: str | Path) -> str | None:
    """The absolute ``data_dir`` a finished run read (its results.json's config, else config.yaml),
    or None when neither records an absolute one (already portable, or never set)."""
    run_dir = Path(run_dir)
    value = None
    try:
        if (run_dir / "results.json").is_file():
            value = json.loads((run_dir / "results.json").read_text()).get("config", {}).get("data_dir")
        elif (run_dir / "config.yaml").is_file():
            from omegaconf import OmegaConf

            value = OmegaConf.to_container(OmegaConf.load(run_dir / "config.yaml")).get("data_dir")
    except (OSError, ValueError):
        return None
    return str(value) if isinstance(value, str) and value.startswith("/") else None


def replacements(data_dirs: Iterable[str | Path] = ()) -> list[tuple[re.Pattern, str]]:
    """(pattern, mark) for each machine path, the longest first (a data folder inside the
    checkout becomes ``<data_dir>``, not ``<checkout>/data``). Each path is matched as given and
    with its symlinks resolved."""
    marks: dict[str, str] = {}
    for path, mark in [*((d, DATA_DIR_MARK) for d in data_dirs), (CHECKOUT, CHECKOUT_MARK), (Path.home(), HOME_MARK)]:
        path = Path(path)
        if not path.is_absolute() or path == Path(path.anchor):
            continue  # a relative path names no machine's folder; "/" would match everything
        for text in (str(path), str(path.resolve())):
            marks.setdefault(text.rstrip("/"), mark)
    ordered = sorted(marks.items(), key=lambda item: -len(item[0]))
    return [(re.compile(re.escape(text) + _END), mark) for text, mark in ordered]


def portable_text(text: str, rules: Sequence[tuple[re.Pattern, str]]) -> str:
    """``text`` with every machine path of ``rules`` (:func:`replacements`) replaced by its mark.

    >>> portable_text("cwd: /work/x/main", [(re.compile(re.escape("/work/x/main") + _END), "<checkout>")])
    'cwd: <checkout>'
    """
    for pattern, mark in rules:
        text = pattern.sub(mark, text)
    return text


def _in_finished_run(path: Path) -> bool:
    return any((parent / "results.json").is_file() for parent in path.parents)


def make_portable(folder: str | Path, data_dirs: Iterable[str | Path] = (), extra_files: Iterable[str | Path] = ()) -> list[Path]:
    """Rewrite every text file under ``folder`` (and ``extra_files``, e.g. the run's log kept
    elsewhere) with the machine paths replaced (:func:`replacements`): ``data_dirs``, the run
    folders' recorded ``data_dir`` (:func:`recorded_data_dir`), the checkout and the home folder.
    Each file is replaced atomically, and only when its text changes; JSON stays valid (the marks
    hold no quote or backslash). Left as they are: the files of a run folder without results.json
    (still training, or cut short: it would go on writing to the replaced files) and, outside
    finished runs, a log written in the last :data:`~fedfew.core.run_folders.RUNNING_WINDOW_S`
    seconds (a running run's log, next to the run folders in make compare's ``logs/``).

    Returns: the files rewritten.
    Raises:
        FileNotFoundError: ``folder`` does not exist.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is not a folder: name a run folder, or a make compare / make tune output folder")
    # a run still training (or cut short) is left alone: it appends to its files, and a file
    # replaced under it would lose what it writes next; so is a log written to recently
    # (a run folder: Hydra writes .hydra/ first, config.yaml a moment later)
    unfinished = [p.parent for p in [*folder.rglob(".hydra"), *folder.rglob("config.yaml")]
                  if p.parent.name != ".hydra" and not (p.parent / "results.json").exists()]
    now = time.time()
    files = [p for p in sorted(folder.rglob("*")) if p.is_file() and p.suffix in TEXT_SUFFIXES
             and not any(p.is_relative_to(u) for u in unfinished)
             and not (p.suffix == ".log" and not _in_finished_run(p) and now - p.stat().st_mtime < RUNNING_WINDOW_S)]
    files += [Path(p) for p in extra_files if Path(p).is_file()]
    run_dirs = {p.parent for p in folder.rglob("results.json")}
    run_dirs |= {p.parent for p in folder.rglob("config.yaml") if p.parent.name != ".hydra"}
    found = {d for run_dir in run_dirs if (d := recorded_data_dir(run_dir))}  # one record read per run
    rules = replacements([*data_dirs, *sorted(found)])
    changed = []
    for path in files:
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue  # not text after all
        new = portable_text(text, rules)
        if new != text:
            atomic_write_bytes(path, new.encode())
            changed.append(path)
    return changed


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=python_command("fedfew.experiments.portable"),
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="+", help="run folders, or make compare / make tune output folders")
    parser.add_argument("--data-dir", action="append", default=[],
                        help="another data folder to replace by <data_dir> (the runs' recorded one is found by itself)")
    args = parser.parse_args(argv)
    missing = [f for f in args.folders if not Path(f).is_dir()]
    if missing:
        parser.error(f"not a folder: {', '.join(missing)}")
    for folder in args.folders:
        changed = make_portable(folder, args.data_dir)
        print(f"{folder}: {len(changed)} file(s) rewritten")
    return 0


if __name__ == "__main__":
    sys.exit(main())
