"""``python -m fedfew.check [--data-on-nodes] [hydra overrides]``: the checks ``python -m fedfew.train``
makes before it loads any data, and that the dataset's files are on this machine, without
training, in a few seconds.

The same steps, in the same order: command-line keys that no config defines
(:func:`fedfew.config.overrides.check_overrides`), Hydra's composition of ``conf/config.yaml`` with the
overrides (unknown groups and options, bad syntax), then :func:`fedfew.experiments.training.preflight` (the value
rules of :mod:`fedfew.config.rules`, the dataset/model/algorithm names, and an explicit ``resume=<path>``'s
checkpoint and its config). ``resume=auto`` is checked by the job itself: its run folder does not
exist yet. Then :func:`check_data`: the dataset's files under ``data_dir`` exist (found as the loader
finds them, nothing read), unless ``--data-on-nodes`` says they exist only where the job runs.

``make slurm`` runs it (through ``scripts/slurm/render.py --check``) with the job's exact overrides
before ``sbatch``, so a bad value fails on the login node instead of after hours in the queue.

Exit status 0 with one ``config ok: ...`` line on stdout, or 2 with ``error: ...`` on stderr.
"""
from __future__ import annotations

import sys
from pathlib import Path

from omegaconf import DictConfig

from fedfew.config.compose import compose

#: the flag that skips :func:`check_data` (``make slurm DATA_ON_NODES=1``)
DATA_ON_NODES = "--data-on-nodes"


def check(overrides: list[str]) -> DictConfig:
    """Run every pre-data check of ``python -m fedfew.train <overrides>``; returns the config.

    Raises:
        ValueError: the first failing stage's error (unknown keys, composition, ConfigError,
            unknown name, ResumeError); FileNotFoundError: an explicit ``resume`` path without
            a checkpoint.
    """
    from fedfew.config.overrides import check_overrides
    from fedfew.experiments.training import preflight

    check_overrides(list(overrides))
    cfg = compose(overrides)
    preflight(cfg, None)
    return cfg


def check_data(cfg: DictConfig) -> list[Path]:
    """The files ``cfg.dataset`` needs exist under ``cfg.data_dir`` on this machine (only looked
    up, not read): the dataset module's ``find_files(cfg.dataset, data_dir)`` when it has one (it
    names the expected files; ``[]``: none needed, e.g. ``digits``), else the data directory.

    Returns:
        the files found (the data directory itself for a dataset without ``find_files``).
    Raises:
        DataNotFoundError: a file or the data directory is missing; the message names the
            expected paths and how to point at the data or skip this check.
        ValueError: from ``find_files`` (e.g. several candidate folders).
    """
    import importlib

    from fedfew.core.run_folders import python_command
    from fedfew.data.base import DataNotFoundError, resolve_data_dir

    name = cfg.dataset.name
    data_dir = resolve_data_dir(cfg.data_dir)
    find_files = getattr(importlib.import_module(f"fedfew.data.datasets.{name}"), "find_files", None)
    try:
        if find_files is not None:
            return list(find_files(cfg.dataset, data_dir))
        if data_dir.is_dir():
            return [data_dir]
        raise DataNotFoundError(f"{name}: the data directory {data_dir} does not exist")
    except DataNotFoundError as err:
        missing = "" if find_files is None or data_dir.is_dir() else \
            f" (the data directory {data_dir} does not exist here)"
        raise DataNotFoundError(
            f"{err}\nThe job would not find its data{missing}. With make slurm, DATA_DIR=<folder> names "
            f"the data directory ({python_command('fedfew.check')}: data_dir=<folder>). If the files exist only "
            f"on the compute nodes, or the job downloads them, skip this check: make slurm DATA_ON_NODES=1 "
            f"({DATA_ON_NODES} for scripts/slurm/render.py and {python_command('fedfew.check')})."
        ) from err


def main(argv: list[str] | None = None) -> int:
    """CLI entry: exit status 0 (config ok) or 2 (the error on stderr). ``--data-on-nodes``
    anywhere in ``argv`` skips :func:`check_data`."""
    args = list(sys.argv[1:] if argv is None else argv)
    overrides = [a for a in args if a != DATA_ON_NODES]
    try:
        cfg = check(overrides)
        files = None if DATA_ON_NODES in args else check_data(cfg)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 2
    M = "every writer/centre" if cfg.num_clients is None else cfg.num_clients
    if files is None:
        data = f"not checked ({DATA_ON_NODES})"
    else:
        data = f"{len(files)} file(s) found" if files else "none needed"
    print(f"config ok: dataset={cfg.dataset.name} algorithm={cfg.algorithm.name} model={cfg.model.name} "
          f"num_clients={M} rounds={cfg.rounds} seed={cfg.seed}; data: {data}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
