"""Command-line entry point: ``python -m fedfew.train [hydra overrides]`` (``make train``)."""
from __future__ import annotations

import logging
import shutil
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from fedfew.core.checkpoint import check_resume_config, checkpoint_path, load_checkpoint, resolve_resume
from fedfew.config.rules import validate_config
from fedfew.experiments.run_folders import python_command, register_resolvers

register_resolvers()  # ${fedfew.run_suffix:...} in hydra.run.dir (run folder names)

class SetupError(Exception):
    """A problem the user fixes (bad config value, missing data, impossible partition, unknown
    name, unreadable checkpoint), raised before any training; printed as one line, exit code 2."""


def make_fabric(cfg: DictConfig, run_dir: Path):
    """Lightning Fabric from ``cfg.trainer`` with the loggers and callbacks of a run."""
    from lightning.fabric import Fabric

    from fedfew.reporting.callbacks import ConsoleReport, LoggerBridge, PlotFiles, ResultFiles
    from fedfew.reporting.collapse_watch import CollapseWatch
    from fedfew.reporting.loggers import build_loggers
    from fedfew.reporting.wandb_monitor import WandbMonitor
    from fedfew.reporting.partition_report import PartitionReport

    t = cfg.trainer
    return Fabric(
        accelerator=t.accelerator, devices=t.devices, num_nodes=t.num_nodes, strategy=t.strategy,
        precision=t.precision, loggers=build_loggers(cfg.logger, run_dir),
        callbacks=[CollapseWatch(), ResultFiles(run_dir), PlotFiles(run_dir), WandbMonitor(), PartitionReport(run_dir), LoggerBridge(), ConsoleReport()],
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
        _quiet_console()  # imports Lightning (and torch): seconds
        import torch

        from fedfew.data.federated import build_federated_data
        from fedfew.core.simulation import Simulation

        if cfg.trainer.get("threads"):
            torch.set_num_threads(int(cfg.trainer.threads))
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
        sim.preset = _preset(cfg)
        if sim.preset is not None and sim.preset["note"] and fabric.global_rank == 0:
            # only now: a run that stops on bad input never reaches its preset; once, from rank 0
            logging.getLogger(__name__).warning(sim.preset["note"])
    except (ValueError, FileNotFoundError) as err:  # ConfigError, DataNotFoundError, PartitionError, ...
        raise SetupError(str(err)) from err
    return sim.fit()  # errors from here on are bugs or crashes: full traceback


def _preset(cfg: DictConfig) -> dict[str, Any] | None:
    """The tuned preset the run composed, for results.json's ``preset``: ``tuned`` (Hydra's choice,
    e.g. ``digits_fedfew``, or None under ``~tuned``, where make compare and make tune pass a
    preset's values as overrides instead), ``tuned_for_this_setup`` (bool, or None when the preset
    records no setup or there is none) and ``note`` (:func:`fedfew.tune.preset_note`: what differs
    when the preset was tuned for another setup or method; :func:`run` logs it as a warning once
    every check has passed). None outside Hydra."""
    from fedfew.tune import TUNED_DIR, preset_matches, preset_note

    try:
        choice = HydraConfig.get().runtime.choices.get("tuned")
    except ValueError:  # not under Hydra
        return None
    path = TUNED_DIR / f"{choice}.yaml" if choice else None
    exists = path is not None and path.is_file()
    note = preset_note(choice, cfg)
    return {"tuned": choice if exists else None,
            "tuned_for_this_setup": preset_matches(path, cfg) if exists else None, "note": note}


def _continue_command(run_dir: Path) -> str:
    """The command that resumes this run: this interpreter (:func:`fedfew.experiments.run_folders.python_command`),
    the run's own overrides, its folder and ``resume=auto``."""
    import shlex

    try:
        task = list(HydraConfig.get().overrides.task)
    except ValueError:  # not under Hydra
        task = []
    keep = [o for o in task if not o.lstrip("+~").startswith(("hydra.run.dir=", "resume="))]
    return " ".join([python_command("fedfew.train"), *map(shlex.quote, keep), shlex.quote(f"hydra.run.dir={run_dir}"),
                     "resume=auto"])


def _only_hydra_files(run_dir: Path) -> bool:
    return all(p.name == ".hydra" or p.suffix == ".log" for p in run_dir.iterdir())


def _discard_if_unstarted(run_dir: Path, fresh: bool) -> None:
    """Remove a run directory we created when the run failed before its first round."""
    if fresh and not any((run_dir / f).exists() for f in ("results.json", "metrics.csv", "checkpoints")):
        shutil.rmtree(run_dir, ignore_errors=True)


def _quiet_console() -> None:
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


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    fresh = _only_hydra_files(run_dir)
    try:
        results = run(cfg, run_dir)
        if results.get("summary", {}).get("verdict") == "diverged":
            from fedfew.core.nonfinite import DIVERGED_EXIT

            print(f"error: the run diverged (every client non-finite; results.json summary.verdict=diverged): "
                  f"{run_dir}", file=sys.stderr, flush=True)
            sys.exit(DIVERGED_EXIT)
        if results.get("interrupted"):
            signum = int(results["signal"] or signal.SIGTERM)
            print(f"stopped by {signal.Signals(signum).name} after round {results['round']}; checkpoint "
                  f"{checkpoint_path(run_dir)}; continue with: {_continue_command(run_dir)}", file=sys.stderr, flush=True)
            sys.exit(128 + signum)
    except SetupError as err:
        _discard_if_unstarted(run_dir, fresh)
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:  # a second Ctrl-C during a round, or Ctrl-C outside the round loop
        _discard_if_unstarted(run_dir, fresh)
        saved = checkpoint_path(run_dir)
        where = (f"the last checkpoint is {saved}; continue with: {_continue_command(run_dir)}" if saved.is_file()
                 else "no checkpoint was saved")
        print(f"aborted by Ctrl-C; {where}", file=sys.stderr, flush=True)
        sys.exit(128 + signal.SIGINT)
    except BaseException:
        _discard_if_unstarted(run_dir, fresh)
        raise


def cli() -> None:
    """``python -m fedfew.train`` / ``fedfew-train``: reject keys that no config defines
    (:mod:`fedfew.config.overrides`, exit 2), then run Hydra's :func:`main`."""
    from fedfew.config.overrides import main_check

    main_check(sys.argv[1:])
    main()


if __name__ == "__main__":
    cli()
