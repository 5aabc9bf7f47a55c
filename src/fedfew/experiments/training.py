"""What one ``python -m fedfew.train`` does between its command line and its exit code: the checks
before any data is read (:func:`preflight`), Fabric with the run's loggers and callbacks
(:func:`make_fabric`), and the run itself (:func:`run`). Also used by ``python -m fedfew.check`` and
the Flower app, so that every way of starting a run checks and reports the same."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from fedfew.config.rules import validate_config
from fedfew.core.checkpoint import check_resume_config, load_checkpoint, resolve_resume
from fedfew.core.precision import slow_precision_note
from fedfew.core.threads import apply_threads


class SetupError(Exception):
    """A problem the user fixes (bad config value, missing data, impossible partition, unknown
    name, unreadable checkpoint), raised before any training; printed as one line, exit code 2."""


def make_fabric(cfg: DictConfig, run_dir: Path):
    """Lightning Fabric from ``cfg.trainer`` with the loggers and callbacks of a run."""
    from lightning.fabric import Fabric

    from fedfew.reporting.callbacks import ConsoleReport, LoggerBridge, PlotFiles, ResultFiles
    from fedfew.reporting.collapse_watch import CollapseWatch
    from fedfew.reporting.loggers import build_loggers
    from fedfew.reporting.partition_report import PartitionReport
    from fedfew.reporting.wandb_monitor import WandbMonitor

    t = cfg.trainer
    result_files = ResultFiles(run_dir)
    return Fabric(
        accelerator=t.accelerator, devices=t.devices, num_nodes=t.num_nodes, strategy=t.strategy,
        precision=t.precision, loggers=build_loggers(cfg.logger, run_dir),
        callbacks=[CollapseWatch(), result_files, PlotFiles(run_dir, source=result_files), WandbMonitor(), PartitionReport(run_dir),
                   LoggerBridge(), ConsoleReport()],
    )


def check_registered(kind: str, package: str, name: str) -> None:
    """Whether ``name`` is registered in ``package``'s registry (:mod:`fedfew.core.registry`), read
    from the sources without importing them (importing every algorithm pulls in Lightning, seconds
    on a login node): by the project's rule the implementation of ``name`` is the module
    ``<package>/<name>.py`` and registers itself with ``register("<name>")``.

    Raises:
        ValueError: unknown name; the message names the closest and lists the available ones, as
            ``Registry.get`` does (:func:`fedfew.core.registry.unknown_name`).
    """
    from fedfew.core.registry import registered_names, unknown_name

    available = registered_names(package)
    if name not in available:
        raise ValueError(unknown_name(kind, name, available))


@dataclass
class Preflight:
    """What :func:`preflight` found: the checkpoint to resume from (path and content) and the
    line to log when the resume extends ``rounds``."""

    resume_from: Path | None = None
    state: dict[str, Any] | None = None
    note: str | None = None


def preflight(cfg: DictConfig, run_dir: Path | None) -> Preflight:
    """Every check of a run that needs no data: :func:`fedfew.config.rules.validate_config`, the
    dataset, model and algorithm names against their registries, and, when resuming, the
    checkpoint's existence and its stored config against ``cfg``
    (:func:`fedfew.core.checkpoint.check_resume_config`). ``make train`` runs it before loading
    data, ``make slurm`` (:mod:`fedfew.check`) before ``sbatch``.

    Args:
        cfg: the composed run config.
        run_dir: the run directory (for ``resume=auto``); ``None`` before a Slurm job exists,
            when only an explicit checkpoint path is checked.
    Raises:
        ConfigError, ResumeError, FileNotFoundError, ValueError (unknown name): each a
        problem the user fixes, named in the message.
    """
    validate_config(cfg)
    for kind, package, name in (("dataset", "fedfew.data.datasets", cfg.dataset.name),
                                ("model", "fedfew.models", cfg.model.name),
                                ("algorithm", "fedfew.algorithms", cfg.algorithm.name)):
        check_registered(kind, package, name)
    resume = cfg.get("resume")
    if run_dir is None and resume == "auto":
        return Preflight()  # the job's own run folder: nothing there yet
    resume_from = resolve_resume(resume, run_dir)
    if resume_from is None:
        return Preflight()
    state = load_checkpoint(resume_from)
    return Preflight(resume_from, state, check_resume_config(state, cfg, resume_from))


def run(cfg: DictConfig, run_dir: Path) -> dict[str, Any]:
    """Check (:func:`preflight`), load the data, launch Fabric and train; returns the results dict.

    Raises:
        SetupError: (from ConfigError, DataNotFoundError, PartitionError, ResumeError, an
            unknown name or a bad checkpoint) before any training.
    """
    try:
        checked = preflight(cfg, run_dir)  # before any data is loaded, and before torch is imported (< 2 s)
        quiet_console()  # imports Lightning (and torch): seconds

        from fedfew.data.federated import build_federated_data
        from fedfew.simulator.simulation import Simulation

        apply_threads(cfg)  # this process is the run's: data loading too (fit holds it as well)
        slow = slow_precision_note(cfg)
        if slow:
            logging.getLogger(__name__).warning(slow)  # before any data is read (each process of the run says it)
        data = build_federated_data(cfg)  # fails fast on missing files / impossible partitions
        fabric = make_fabric(cfg, run_dir)
        fabric.launch()
        sim = Simulation(cfg, fabric, run_dir, data=data)
        if checked.state is not None:
            sim.load_state_dict(checked.state)
            if fabric.global_rank == 0:
                print(f"resumed from {checked.resume_from} at round {sim.start_round}", flush=True)
                if checked.note:
                    print(checked.note, flush=True)
        sim.preset = preset_record(cfg)
        if sim.preset is not None and sim.preset["note"] and fabric.global_rank == 0:
            # only now: a run that stops on bad input never reaches its preset; once, from rank 0
            logging.getLogger(__name__).warning(sim.preset["note"])
    except (ValueError, FileNotFoundError) as err:  # ConfigError, DataNotFoundError, PartitionError, ...
        raise SetupError(str(err)) from err
    return sim.fit()  # errors from here on are bugs or crashes: full traceback


def preset_record(cfg: DictConfig) -> dict[str, Any] | None:
    """The tuned preset the run composed, for results.json's ``preset``: ``tuned`` (Hydra's choice,
    e.g. ``digits_fedfew``, or None under ``~tuned``, where make compare and make tune pass a
    preset's values as overrides instead), ``tuned_for_this_setup`` (bool, or None when the preset
    records no setup or there is none) and ``note`` (:func:`fedfew.config.presets.preset_note`: what differs
    when the preset was tuned for another setup or method; :func:`run` logs it as a warning once
    every check has passed). None outside Hydra."""
    from fedfew.config import presets
    from fedfew.config.presets import preset_matches, preset_note

    try:
        choice = HydraConfig.get().runtime.choices.get("tuned")
    except ValueError:  # not under Hydra
        return None
    path = presets.TUNED_DIR / f"{choice}.yaml" if choice else None
    exists = path is not None and path.is_file()
    note = preset_note(choice, cfg)
    return {"tuned": choice if exists else None,
            "tuned_for_this_setup": preset_matches(path, cfg) if exists else None, "note": note}


def quiet_console() -> None:
    """One copy of each message per run: Lightning's own stderr handler goes (Hydra's handlers
    already print to stdout and <run_dir>/<job>.log), processes other than rank 0 log warnings
    only (no second set of banners), and outside a Slurm allocation Lightning's warning that
    `srun` exists but is not used is dropped (we launch the processes ourselves; inside an
    allocation it stays)."""
    import os
    import warnings

    import lightning  # noqa: F401  (adds its handler on import: remove it after)

    if logging.getLogger().handlers:
        for handler in list(logging.getLogger("lightning").handlers):
            logging.getLogger("lightning").removeHandler(handler)
    if any(os.environ.get(name, "0") not in ("", "0") for name in ("RANK", "LOCAL_RANK", "NODE_RANK", "SLURM_PROCID")):
        for handler in logging.getLogger().handlers:  # every logger reaches the console through these
            handler.setLevel(logging.WARNING)
    if "SLURM_JOB_ID" not in os.environ:
        warnings.filterwarnings("ignore", message=r"The `srun` command is available on your system but is not used")
