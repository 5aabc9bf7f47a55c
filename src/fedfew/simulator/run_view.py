"""What a run's callbacks see of it: a narrow view of :class:`fedfew.simulator.simulation.Simulation`.

Fabric hands each callback (result files, plots, loggers, W&B, the console, the collapse watch,
the partition report) a :class:`RunView` as ``sim``: the config, where the run writes, this
process's rank and loggers, the host data, the declared round-log keys and the run's history so
far; never the Fabric (no collectives, no launching) or the device data.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from omegaconf import DictConfig

from fedfew.algorithms.round_log import Kind
from fedfew.data.base import FederatedData

if TYPE_CHECKING:
    from fedfew.algorithms.base import Algorithm
    from fedfew.core.model_set import KModelSet


@dataclass(frozen=True)
class RunView:
    """A run as its callbacks read it.

    Attributes:
        cfg: the full resolved run config.
        run_dir: the run folder.
        rank: this process's global rank (only rank 0 writes or prints).
        loggers: the run's Fabric loggers (CSV, W&B).
        host_data: the federated data on the host (client sizes and labels).
        log_keys: every key a round log may hold -> its kind (:func:`fedfew.algorithms.round_log.declared`).
        start_round: the first round this process runs (> 1 after a resume).
        history: every round's logs so far (at ``on_fit_start``: the rounds before a resume); the
            round loop appends to it.
        evaluations: the evaluation summaries so far, likewise.
        logger_state: kept in checkpoints for the loggers (the W&B run id), written by them.
        module: the server models, read for their count and ids only (``K``, ``initial_K``,
            ``model_ids``: FedFew's K=auto retires models during a run).
        algorithm: the method, read for its declarations only (``watch_collapse``,
            ``collapse_keys``, ``collapse_hint``).
    """

    cfg: DictConfig
    run_dir: Path
    rank: int
    loggers: list
    host_data: FederatedData
    log_keys: Mapping[str, Kind]
    start_round: int
    history: list[dict[str, Any]]
    evaluations: list[dict[str, Any]]
    logger_state: dict[str, Any]
    module: KModelSet
    algorithm: Algorithm

    @property
    def num_clients(self) -> int:
        """M, every client of the run."""
        return self.host_data.num_clients
