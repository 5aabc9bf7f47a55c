"""``python -m fedfew.flower [--round-timeout S] [hydra overrides]`` (``make flower``): a run in
Flower's simulation engine (``flwr.simulation.run_simulation``, Ray), one virtual SuperNode per
client, with the run folder, files and console of ``python -m fedfew.train`` (same overrides,
same run folder naming) plus flower.log and flower.json (:mod:`fedfew.flower.serve`).

Each virtual node's ClientApp builds the run's partition and keeps its own client
(:func:`fedfew.flower.client.partition_for`); ``trainer.threads`` sets the torch threads of the
server and of every worker; ``--workers N`` runs N ClientApps at a time (default: the CPU count).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from fedfew.core.run_folders import register_resolvers

register_resolvers()
_OPTIONS = {"round_timeout": 0.0, "workers": 0}


def simulate(cfg: DictConfig, run_dir: Path, *, workers: int = 0, round_timeout: float = 0.0,
             preset: dict | None = None) -> dict:
    """Run ``cfg`` in Flower's simulation engine with ``num_clients`` virtual SuperNodes; returns
    the results dict (results.json).

    Raises:
        ValueError: a setting the Flower app does not run (before anything starts; a bf16 run on a CPU
            without native bf16 is warned about there too); RuntimeError: the ServerApp failed
            (the engine logs its traceback) or never finished.
    """
    import logging

    from flwr.simulation import run_simulation

    from fedfew.core.precision import slow_precision_note
    from fedfew.flower.client import app as client_app
    from fedfew.flower.serve import serve
    from fedfew.flower.server import GridTransport, check_supported

    check_supported(cfg)
    slow = slow_precision_note(cfg)
    if slow:  # every virtual SuperNode trains on this machine's CPU: said before any data is read
        print(f"warning: {slow}", file=sys.stderr, flush=True)
    from flwr.serverapp import ServerApp

    out: dict = {}
    server_app = ServerApp()

    @server_app.main()
    def _main(grid, context) -> None:
        try:
            out["results"] = serve(GridTransport(grid), cfg, run_dir, round_timeout=round_timeout or None,
                                   preset=preset, engine="simulation")
        except BaseException as err:  # noqa: BLE001  (re-raised below, outside the engine's thread)
            out["error"] = err
            raise

    cpus = workers or os.cpu_count() or 1
    os.environ.setdefault("OMP_NUM_THREADS", str(int(cfg.trainer.get("threads") or 1)))  # the workers inherit it
    for name in ("flwr", "alembic"):  # the engine's banners and its database migrations
        logging.getLogger(name).setLevel(logging.WARNING)
    run_simulation(server_app, client_app, num_supernodes=int(cfg.num_clients), backend_config={
        "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
        "init_args": {"num_cpus": cpus, "include_dashboard": False, "logging_level": "ERROR",
                      "log_to_driver": True}})
    if "error" in out:
        raise out["error"]
    if "results" not in out:
        raise RuntimeError("the Flower simulation ended without results (see the engine's log above)")
    return out["results"]


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from fedfew.core.threads import apply_threads
    from fedfew.experiments.training import SetupError, preflight, preset_record, quiet_console

    quiet_console()
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        preflight(cfg, run_dir)
        apply_threads(cfg)  # the server process's own work; each client runs under run_threads too
        simulate(cfg, run_dir, workers=int(_OPTIONS["workers"]), round_timeout=float(_OPTIONS["round_timeout"]),
                 preset=preset_record(cfg))
    except (ValueError, FileNotFoundError, SetupError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


def cli() -> None:
    """Strip ``--round-timeout S`` / ``--workers N``, check the overrides as ``make train`` does,
    and run :func:`main`."""
    from fedfew.config.overrides import main_check

    argv = sys.argv[1:]
    for flag, key, kind in (("--round-timeout", "round_timeout", float), ("--workers", "workers", int)):
        if flag in argv:
            i = argv.index(flag)
            _OPTIONS[key] = kind(argv[i + 1])
            del argv[i:i + 2]
    sys.argv[1:] = argv
    main_check(argv)
    main()


if __name__ == "__main__":
    cli()
