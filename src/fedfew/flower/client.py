"""The fedfew ClientApp: one client's side of a round, with fedfew's own algorithm objects.

A SuperNode serves one client: ``partition-id`` (and ``num-partitions``) in its node config
name it. On each message it builds (or, in Flower's simulation engine, reuses) a
:class:`ClientRuntime`: a :class:`fedfew.simulator.simulation.Simulation` over a FederatedData in which
only its own client holds samples (:mod:`fedfew.flower.partitions`), so the algorithm object,
the K-model set, the local training and the evaluation are the simulator's, unchanged.

Messages (``flwr.app.Message``; payloads: :mod:`fedfew.flower.records`):

- ``query``: the client's description (sizes, label counts, input shape, classes, partition
  hash); the server builds its view of the federation from these.
- ``train``: the broadcast (the K server models' state vectors, the algorithm's server state,
  the round, the participants and their train sizes) -> the algorithm's ``begin_round`` and
  ``client_update`` for this client -> the rows it returns (``row_shapes``: FedFew's K losses)
  and every call it made to the round's accumulators (FedFew's
  :class:`~fedfew.core.aggregation.LogWeightedSum`, the averaging methods'
  :class:`~fedfew.algorithms._averaging.WeightedSum`): ``(k, weight, delta)``, i.e. FedFew's K
  log weights and K deltas, an averaging client's n_i and delta. The server replays those calls
  in client order into its own accumulators (:mod:`fedfew.flower.server`), which is what the
  simulator's one process does, so the sums are the same bit for bit.
- ``evaluate``: the broadcast -> the client picks its model among its candidates and is scored,
  as :func:`fedfew.simulator.evaluation.evaluate_clients` does for it -> its row of the evaluation table.

Per-client state (personal models, heads, BatchNorm statistics under FedBN, APFL's alpha_i)
lives in Flower's ``Context.state`` (an ArrayRecord ``fedfew.host``) between messages: on the
node, never on the server.

Errors (a missing data directory, a partition that is not the node's) are raised as
:class:`~fedfew.flower.partitions.PartitionError`; Flower returns them to the server as the
message's error, whose text names the partition id and the data directory.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from omegaconf import DictConfig, OmegaConf

from fedfew.core.precision import runs_on_cpu
from fedfew.core.threads import run_threads
from fedfew.flower.partitions import Partition, PartitionError, cut, load
from fedfew.flower.records import from_record, to_record, unpack

#: the record in ``Context.state`` holding this client's host state (name -> tensor)
HOST_STATE = "fedfew.host"
#: accumulator types whose ``add(k, weight, delta)`` calls a client records for the server
_ACCUMULATORS: tuple[type, ...] | None = None


def accumulator_types() -> tuple[type, ...]:
    """The accumulators the algorithms sum client contributions into (imported lazily)."""
    global _ACCUMULATORS
    if _ACCUMULATORS is None:
        from fedfew.core.aggregation import LogWeightedSum
        from fedfew.algorithms._averaging import WeightedSum

        _ACCUMULATORS = (LogWeightedSum, WeightedSum)
    return _ACCUMULATORS


def accumulators(algorithm: Any) -> dict[str, Any]:
    """The algorithm's accumulators after ``begin_round``: attribute name -> object."""
    types = accumulator_types()
    return {name: value for name, value in vars(algorithm).items() if isinstance(value, types)}


class Recorder:
    """Stands in for an accumulator on the client: records every ``add(k, weight, delta)``
    (weight as given: FedFew's log weight a_ik, an averaging method's n_i) and passes it on."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls: list[tuple[int, float, torch.Tensor]] = []

    def add(self, k: int, weight: float, delta: torch.Tensor) -> None:
        self.calls.append((int(k), float(weight), delta.detach().to("cpu", copy=True)))
        self.inner.add(k, weight, delta)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def node_partition(node_config: dict[str, Any]) -> tuple[int, int | None, str | None]:
    """(partition id, number of partitions or None, data directory or None) from a node config.

    Raises:
        PartitionError: no ``partition-id`` (or one that is not an integer).
    """
    try:
        pid = int(node_config["partition-id"])
    except (KeyError, TypeError, ValueError) as err:
        raise PartitionError(f"the SuperNode's node config {dict(node_config)} has no integer partition-id; start it "
                             "with --node-config \"partition-id=<i> num-partitions=<M> data-dir=<dir>\"") from err
    total = node_config.get("num-partitions")
    data_dir = node_config.get("data-dir")
    return pid, None if total is None else int(total), None if data_dir in (None, "") else str(data_dir)


# ---- the runtime of one client ------------------------------------------------------------

_DATA: dict[str, Any] = {}  # run config (YAML) -> FederatedData, for nodes without a data-dir
_RUNTIMES: dict[tuple, "ClientRuntime"] = {}


def partition_for(cfg: DictConfig, pid: int, total: int | None, data_dir: str | None) -> Partition:
    """The node's partition: read from its data directory, or (no ``data-dir``: Flower's
    simulation engine, one machine) cut from the data the run config builds.

    Raises:
        PartitionError: see :func:`fedfew.flower.partitions.load`; a ``num-partitions`` other
            than the run's ``num_clients``.
    """
    if data_dir is not None:
        return load(data_dir, pid, total, cfg)
    M = int(cfg.num_clients)
    if total is not None and total != M:
        raise PartitionError(f"SuperNode partition-id={pid}: num-partitions={total}, but the run has num_clients={M}")
    key = OmegaConf.to_yaml(cfg)
    if key not in _DATA:
        from fedfew.data.federated import build_federated_data

        _DATA.clear()  # one run's data per process
        _DATA[key] = build_federated_data(cfg)
    return cut(_DATA[key], pid, cfg)


@dataclass(frozen=True)
class OneCPUProcess:
    """What a client's :class:`~fedfew.simulator.simulation.Simulation` reads of a Fabric when it runs
    on the CPU in full precision: one process (rank 0 of 1) on the CPU. The client never calls
    the round loop, so no callbacks, loggers or collectives are needed."""

    device: torch.device = torch.device("cpu")
    global_rank: int = 0
    world_size: int = 1


def client_fabric(cfg: DictConfig) -> Any:
    """The Fabric of a client's runtime: :class:`OneCPUProcess` for ``trainer.accelerator=cpu``
    (or ``auto`` on a machine without a GPU) in 32-bit precision, else Lightning's (device choice, autocast). Why: a SuperNode starts a
    new process for every message, and importing Lightning costs ~3 s of CPU each time (it
    imports torchmetrics, which imports transformers, torchvision and scipy), more than a
    client's round on the digits; the results are the same bit for bit (tests/test_flower.py)."""
    if runs_on_cpu(cfg) and str(cfg.trainer.precision) in ("32", "32-true"):
        return OneCPUProcess()
    from lightning.fabric import Fabric

    return Fabric(accelerator=cfg.trainer.accelerator, devices=1, precision=cfg.trainer.precision)


class ClientRuntime:
    """A :class:`fedfew.simulator.simulation.Simulation` holding one client's partition (its algorithm,
    K-model set, context), driven by the server's messages.

    Args:
        cfg: the run config (sent by the server).
        partition: this client's data.
    """

    def __init__(self, cfg: DictConfig, partition: Partition) -> None:
        from fedfew.simulator.simulation import Simulation

        self.cfg, self.partition = cfg, partition
        with run_threads(cfg):  # as every call below: the simulator's thread count (fedfew.core.threads)
            self.sim = Simulation(cfg, client_fabric(cfg), Path("."), data=partition.data())
        self.client = self.sim.host_data.clients[partition.client_id]

    @property
    def cid(self) -> int:
        return self.partition.client_id

    def receive(self, content: RecordDict, state: RecordDict) -> int:
        """Load the broadcast and this client's host state; returns the round."""
        from fedfew.core.model_set import assign_state_, round_lr
        from fedfew.core.nonfinite import NonFiniteLog

        config = content["config"]
        rnd = int(config["round"])
        sim, module = self.sim, self.sim.module
        sim.num_train.copy_(torch.tensor(list(config["num_train"]), dtype=torch.int64))  # every client's n_i
        if list(module.model_ids) != list(config["model_ids"]):
            module.keep_models_(list(config["model_ids"]))  # models K=auto retired
        for k, vector in enumerate(from_record(content["models"]).values()):
            assign_state_(module.models[k], vector.to(sim.fabric.device))
        module.lr = round_lr(self.cfg.optim, rnd, int(self.cfg.rounds))
        sim.algorithm.load_state_dict(unpack(config["algorithm_state"]))
        sim.ctx.host_state.clear()
        if HOST_STATE in state:
            sim.ctx.host_state[self.cid] = from_record(state[HOST_STATE])
        sim.nonfinite = sim.ctx.nonfinite = NonFiniteLog(fatal=bool(self.cfg.get("fail_on_nonfinite", False)))
        sim.nonfinite.begin_round(rnd)
        return rnd

    def keep_state(self, state: RecordDict) -> None:
        """Store this client's host state in the node's ``Context.state``."""
        saved = self.sim.ctx.host_state.get(self.cid)
        if saved:
            state[HOST_STATE] = to_record(saved)

    def train(self, content: RecordDict, state: RecordDict) -> RecordDict:
        """One round of local work (see the module docstring); returns the reply's records."""
        with run_threads(self.cfg):
            return self._train(content, state)

    def _train(self, content: RecordDict, state: RecordDict) -> RecordDict:
        from fedfew.core.budget import StepCounter

        start = time.perf_counter()
        rnd = self.receive(content, state)
        participants = [int(c) for c in content["config"]["participants"]]
        alg = self.sim.algorithm
        alg.begin_round(rnd, participants)
        recorders = {name: Recorder(value) for name, value in accumulators(alg).items()}
        for name, recorder in recorders.items():
            setattr(alg, name, recorder)
        with StepCounter() as steps:
            rows = alg.client_update(self.client, rnd)
        self.keep_state(state)
        calls = [(name, *call) for name, recorder in recorders.items() for call in recorder.calls]
        record = self.sim.nonfinite.clients.get(self.cid)
        reply = ConfigRecord({
            "client": self.cid, "add_attr": [c[0] for c in calls], "add_k": [c[1] for c in calls],
            "add_weight": [c[2] for c in calls], "nonfinite": list(record.what) if record else [],
        })
        return RecordDict({
            "rows": to_record(rows), "deltas": to_record({str(j): c[3] for j, c in enumerate(calls)}),
            "reply": reply,
            "metrics": MetricRecord({"num-examples": len(self.client.train), "local-steps": int(steps.count),
                                     "seconds": time.perf_counter() - start}),
        })

    def evaluate(self, content: RecordDict, state: RecordDict) -> RecordDict:
        """Selection and scores of this client under every protocol of the run (its row of
        :func:`fedfew.simulator.evaluation.evaluate_clients`' table, as that function's per-client dict)."""
        with run_threads(self.cfg):
            return self._evaluate(content, state)

    def _evaluate(self, content: RecordDict, state: RecordDict) -> RecordDict:
        from fedfew.simulator.evaluation import EvalSettings, evaluate_clients

        rnd = self.receive(content, state)
        result = evaluate_clients(self.sim.algorithm, self.sim.ctx, [self.client], self.cid + 1, rnd)
        settings = EvalSettings.from_config(self.cfg)
        rows = {settings.protocol: result["clients"][self.cid]}
        rows.update({p: r["clients"][self.cid] for p, r in result.get("also", {}).items()})
        self.keep_state(state)
        return RecordDict({"reply": ConfigRecord({
            "client": self.cid, "evaluation": json.dumps(rows),
            "num_candidates": len(self.sim.algorithm.candidates(self.client))})})


def runtime_for(message: Message, context: Context) -> ClientRuntime:
    """This node's runtime for the message's run config (cached per process: Flower's
    simulation engine keeps its workers between messages; a SuperNode starts a new process)."""
    cfg = OmegaConf.create(str(message.content["config"]["run_config"]))
    pid, total, data_dir = node_partition(context.node_config)
    key = (context.run_id, pid, data_dir, OmegaConf.to_yaml(cfg))
    if key not in _RUNTIMES:
        if len(_RUNTIMES) > 64:
            _RUNTIMES.clear()
        _RUNTIMES[key] = ClientRuntime(cfg, partition_for(cfg, pid, total, data_dir))
    return _RUNTIMES[key]


app = ClientApp()


@app.query()
def query(message: Message, context: Context) -> Message:
    """The client's description (:meth:`fedfew.flower.partitions.Partition.describe`)."""
    runtime = runtime_for(message, context)
    return Message(RecordDict({"reply": ConfigRecord({"describe": json.dumps(runtime.partition.describe())})}),
                   reply_to=message)


@app.train()
def train(message: Message, context: Context) -> Message:
    """One round of local training (:meth:`ClientRuntime.train`)."""
    return Message(runtime_for(message, context).train(message.content, context.state), reply_to=message)


@app.evaluate()
def evaluate(message: Message, context: Context) -> Message:
    """Selection and personalized accuracy (:meth:`ClientRuntime.evaluate`)."""
    return Message(runtime_for(message, context).evaluate(message.content, context.state), reply_to=message)
