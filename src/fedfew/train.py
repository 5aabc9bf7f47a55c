"""Command-line entry point: ``python -m fedfew.train [hydra overrides]`` (``make train``)."""
from __future__ import annotations

import shutil
import signal
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from fedfew.core.checkpoint import checkpoint_path
from fedfew.core.run_folders import python_command, register_resolvers
from fedfew.experiments.training import SetupError, run

register_resolvers()  # ${fedfew.run_suffix:...} in hydra.run.dir (run folder names)


def _continue_command(run_dir: Path) -> str:
    """The command that resumes this run: this interpreter (:func:`fedfew.core.run_folders.python_command`),
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
