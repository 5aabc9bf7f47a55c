"""Command-line entry point: ``python -m fedfew.train [hydra overrides]`` (``make train``)."""
from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from fedfew.checkpoint import load_checkpoint, resolve_resume
from fedfew.config import validate_config

class SetupError(Exception):
    """A problem the user fixes (bad config value, missing data, impossible partition, unknown
    name, unreadable checkpoint), raised before any training; printed as one line, exit code 2."""


def make_fabric(cfg: DictConfig, run_dir: Path):
    """Lightning Fabric from ``cfg.trainer`` with the loggers and callbacks of a run."""
    from lightning.fabric import Fabric

    from fedfew.callbacks import ConsoleReport, LoggerBridge, PlotFiles, ResultFiles
    from fedfew.loggers import build_loggers
    from fedfew.monitoring import WandbMonitor
    from fedfew.partition_report import PartitionReport

    t = cfg.trainer
    return Fabric(
        accelerator=t.accelerator, devices=t.devices, num_nodes=t.num_nodes, strategy=t.strategy,
        precision=t.precision, loggers=build_loggers(cfg.logger, run_dir),
        callbacks=[ResultFiles(run_dir), PlotFiles(run_dir), WandbMonitor(), PartitionReport(run_dir), LoggerBridge(), ConsoleReport()],
    )


def run(cfg: DictConfig, run_dir: Path) -> dict[str, Any]:
    """Validate, load the data, launch Fabric and train; returns the results dict.

    Raises:
        SetupError: (from ConfigError, DataNotFoundError, PartitionError, an unknown name or a
            bad checkpoint) before any training.
    """
    try:
        validate_config(cfg)
        import torch

        from fedfew.data.federated import build_federated_data
        from fedfew.simulation import Simulation

        if cfg.trainer.get("threads"):
            torch.set_num_threads(int(cfg.trainer.threads))
        data = build_federated_data(cfg)  # fails fast on missing files / impossible partitions
        resume_from = resolve_resume(cfg.get("resume"), run_dir)
        fabric = make_fabric(cfg, run_dir)
        fabric.launch()
        sim = Simulation(cfg, fabric, run_dir, data=data)
        if resume_from is not None:
            sim.load_state_dict(load_checkpoint(resume_from))
            if fabric.global_rank == 0:
                print(f"resumed from {resume_from} at round {sim.start_round}", flush=True)
    except (ValueError, FileNotFoundError) as err:  # ConfigError, DataNotFoundError, PartitionError, ...
        raise SetupError(str(err)) from err
    return sim.fit()  # errors from here on are bugs or crashes: full traceback


def _only_hydra_files(run_dir: Path) -> bool:
    return all(p.name == ".hydra" or p.suffix == ".log" for p in run_dir.iterdir())


def _discard_if_unstarted(run_dir: Path, fresh: bool) -> None:
    """Remove a run directory we created when the run failed before its first round."""
    if fresh and not any((run_dir / f).exists() for f in ("results.json", "metrics.csv", "checkpoints")):
        shutil.rmtree(run_dir, ignore_errors=True)


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    fresh = _only_hydra_files(run_dir)
    try:
        results = run(cfg, run_dir)
        if results.get("interrupted"):
            print(f"stopped by signal {results['signal']} after round {results['round']}; checkpoint in "
                  f"{run_dir / 'checkpoints'}; continue with: python -m fedfew.train <same overrides> "
                  f"hydra.run.dir={run_dir} resume=auto", file=sys.stderr, flush=True)
            sys.exit(128 + int(results["signal"] or 15))
    except SetupError as err:
        _discard_if_unstarted(run_dir, fresh)
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except BaseException:
        _discard_if_unstarted(run_dir, fresh)
        raise


if __name__ == "__main__":
    main()
