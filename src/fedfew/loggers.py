"""Experiment loggers for Fabric, chosen by ``logger.name`` (none | csv | wandb).

W&B never blocks or crashes a run: without an API key it runs offline (and says how to
``wandb sync``); any error while creating it falls back to no W&B logger with a warning.
"""
from __future__ import annotations

import netrc
import os
import warnings
from pathlib import Path
from typing import Callable

from omegaconf import DictConfig


def _none(cfg: DictConfig, run_dir: Path) -> list:
    return []


def _csv(cfg: DictConfig, run_dir: Path) -> list:
    from lightning.pytorch.loggers import CSVLogger  # the Fabric one cannot log hyperparameters

    return [CSVLogger(save_dir=str(run_dir), name="logs", version="")]


def has_wandb_credentials() -> bool:
    """True when an API key is in the environment or ~/.netrc (no network access)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False


def wandb_mode(cfg: DictConfig) -> str:
    """``logger.mode`` if set (online/offline/disabled), else WANDB_MODE, else online when
    credentials exist and offline otherwise."""
    mode = cfg.get("mode") or os.environ.get("WANDB_MODE")
    if mode:
        return str(mode)
    return "online" if has_wandb_credentials() else "offline"


def _wandb(cfg: DictConfig, run_dir: Path) -> list:
    try:
        from lightning.pytorch.loggers import WandbLogger

        mode = wandb_mode(cfg)
        if mode == "offline":
            print(f"W&B: no API key, logging offline into {run_dir}/wandb; upload later with "
                  f"`wandb sync {run_dir}/wandb/offline-run-*`")
        return [WandbLogger(
            project=cfg.get("project", "fedfew"), entity=cfg.get("entity"), group=cfg.get("group"),
            tags=list(cfg.get("tags") or []), name=cfg.get("run_name"), save_dir=str(run_dir), mode=mode,
            settings=None,
        )]
    except Exception as err:  # W&B must never stop a run
        warnings.warn(f"W&B logger disabled: {err}")
        return []


LOGGERS: dict[str, Callable[[DictConfig, Path], list]] = {"none": _none, "csv": _csv, "wandb": _wandb}


def build_loggers(cfg: DictConfig, run_dir: Path) -> list:
    """Fabric loggers for ``cfg`` (the ``logger`` node).

    Raises:
        ValueError: unknown ``logger.name``.
    """
    if cfg.name not in LOGGERS:
        raise ValueError(f"logger={cfg.name!r}; allowed: {', '.join(LOGGERS)}")
    return LOGGERS[cfg.name](cfg, run_dir)
