"""``python -m fedfew.check [hydra overrides]``: the checks ``python -m fedfew.train`` makes before it
loads any data, without training, in a few seconds.

The same steps, in the same order: command-line keys that no config defines
(:func:`fedfew.overrides.check_overrides`), Hydra's composition of ``conf/config.yaml`` with the
overrides (unknown groups and options, bad syntax), then :func:`fedfew.train.preflight` (the value
rules of :mod:`fedfew.config`, the dataset/model/algorithm names, and an explicit ``resume=<path>``'s
checkpoint and its config). ``resume=auto`` is checked by the job itself: its run folder does not
exist yet.

``make slurm`` runs it (through ``scripts/slurm/render.py --check``) with the job's exact overrides
before ``sbatch``, so a bad value fails on the login node instead of after hours in the queue.

Exit status 0 with one ``config ok: ...`` line on stdout, or 2 with ``error: ...`` on stderr.
"""
from __future__ import annotations

import sys
from pathlib import Path

from omegaconf import DictConfig

#: the configs of ``python -m fedfew.train`` (conf/, linked into the package)
CONFIG_DIR = Path(__file__).resolve().parent / "conf"


def compose(overrides: list[str]) -> DictConfig:
    """The run config of ``python -m fedfew.train <overrides>`` (Hydra's compose API; no run
    folder is made).

    Raises:
        ValueError: Hydra cannot compose it (its message: unknown group option, bad override...).
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException

    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            return hydra_compose(config_name="config", overrides=list(overrides))
    except HydraException as err:
        raise ValueError(str(err)) from err
    finally:
        GlobalHydra.instance().clear()


def check(overrides: list[str]) -> DictConfig:
    """Run every pre-data check of ``python -m fedfew.train <overrides>``; returns the config.

    Raises:
        ValueError: the first failing stage's error (unknown keys, composition, ConfigError,
            unknown name, ResumeError); FileNotFoundError: an explicit ``resume`` path without
            a checkpoint.
    """
    from fedfew.overrides import check_overrides
    from fedfew.train import preflight

    check_overrides(list(overrides))
    cfg = compose(overrides)
    preflight(cfg, None)
    return cfg


def main(argv: list[str] | None = None) -> int:
    """CLI entry: exit status 0 (config ok) or 2 (the error on stderr)."""
    overrides = list(sys.argv[1:] if argv is None else argv)
    try:
        cfg = check(overrides)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 2
    M = "every writer/centre" if cfg.num_clients is None else cfg.num_clients
    print(f"config ok: dataset={cfg.dataset.name} algorithm={cfg.algorithm.name} model={cfg.model.name} "
          f"num_clients={M} rounds={cfg.rounds} seed={cfg.seed}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
