"""Run a federation to the end: connect, train, write the run folder (shared by both ways to run).

:func:`serve` is what the ServerApp's ``main(grid, context)`` does in Flower's simulation engine
(``python -m fedfew.flower``, :mod:`fedfew.flower.__main__`) and on a SuperLink
(:data:`app`, started by ``flwr run``, :mod:`fedfew.flower.deploy`). Besides the simulator's files
(results.json, metrics.csv, history.json.gz, partition.json, plots, loggers) the run folder gets
``flower.log`` (the lines about nodes: who joined, who was left out and why) and ``flower.json``
(the transport, the node of each client, the nodes that failed, and the bytes each exchange moved
down to and up from each client).
"""
from __future__ import annotations

import shlex
import time
from pathlib import Path
from typing import Any

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp
from omegaconf import DictConfig

from fedfew.flower.server import Federation, FlowerSimulation, GridTransport, Transport, check_supported
from fedfew.core.io import atomic_write_json

#: defaults of the ServerApp's run config (``flwr run ... --run-config 'key=value ...'``)
RUN_CONFIG = {"overrides": "", "run-dir": "", "round-timeout": 0.0, "connect-timeout": 300.0}


def serve(transport: Transport, cfg: DictConfig, run_dir: Path, *, round_timeout: float | None = None,
          connect_timeout: float = 300.0, preset: dict[str, Any] | None = None, engine: str = "flower") -> dict[str, Any]:
    """Connect to every client, run ``cfg.rounds`` rounds and write the run folder.

    Args:
        transport: the nodes (:class:`~fedfew.flower.server.GridTransport` in a ServerApp).
        cfg: the run config (as ``python -m fedfew.train`` composes it).
        run_dir: the run folder (created).
        round_timeout: seconds to wait for a round's replies (None or 0: wait for all).
        connect_timeout: seconds to wait for every client to have a node.
        preset: results.json ``preset`` (the tuned preset the config composed).
        engine: how the nodes run, recorded in flower.json (``simulation`` | ``deployment`` | ...).
    Returns:
        the results dict (results.json's content).
    Raises:
        ValueError: a setting the Flower app does not run (:func:`~fedfew.flower.server.check_supported`).
        FederationError: clients without a node after ``connect_timeout``.
    """
    from fedfew.config.rules import validate_config
    from fedfew.experiments.training import make_fabric

    validate_config(cfg)
    check_supported(cfg)
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    log = run_dir / "flower.log"

    def say(line: str) -> None:
        print(line, flush=True)
        with log.open("a", encoding="utf-8") as fh:
            fh.write(f"{time.strftime('%H:%M:%S')} {line}\n")

    federation = Federation(transport, cfg, round_timeout or None, connect_timeout, say)
    federation.connect()
    say(f"connected: {len(federation.node_of)} clients on nodes "
        f"{', '.join(f'{c}->{n}' for c, n in sorted(federation.node_of.items()))}")
    fabric = make_fabric(cfg, run_dir)
    fabric.launch()
    sim = FlowerSimulation(cfg, fabric, run_dir, federation)
    sim.preset = preset
    try:
        return sim.fit()
    finally:
        atomic_write_json(run_dir / "flower.json", {
            "engine": engine, "node_of_client": {str(c): n for c, n in sorted(federation.node_of.items())},
            "failed_nodes": {str(n): why for n, why in federation.failed.items()},
            "exchanges": federation.bytes_log})


app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """The ServerApp of a deployment (``flwr run``): the run config's ``overrides`` (Hydra
    overrides, as for ``make train``), ``run-dir`` (default
    ``$FEDFEW_OUTPUT_DIR|outputs/<dataset>/<algorithm>/<time>_flower``), ``round-timeout`` and
    ``connect-timeout`` (seconds; round-timeout 0: wait for every reply)."""
    import os

    from fedfew.config.compose import compose

    run_config = {**RUN_CONFIG, **dict(context.run_config)}
    cfg = compose(shlex.split(str(run_config["overrides"])))
    run_dir = str(run_config["run-dir"]) or os.path.join(
        os.environ.get("FEDFEW_OUTPUT_DIR", "outputs"), str(cfg.dataset.name), str(cfg.algorithm.name),
        time.strftime("%Y-%m-%d_%H-%M-%S") + "_flower")
    serve(GridTransport(grid), cfg, Path(run_dir).resolve(), round_timeout=float(run_config["round-timeout"]),
          connect_timeout=float(run_config["connect-timeout"]), engine="deployment")
