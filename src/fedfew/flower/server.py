"""The fedfew ServerApp: the simulator's round loop with the client step replaced by messages.

:class:`FlowerSimulation` is a :class:`fedfew.simulator.simulation.Simulation` (the same K-model set,
algorithm object, evaluation settings, callbacks, result files and budget) whose
:meth:`~FlowerSimulation.run_round` and :meth:`~FlowerSimulation.evaluate` send Flower messages
instead of calling ``client_update`` and ``evaluate_clients`` in process::

    state = alg.state_dict(); alg.begin_round(round, participants)        (server)
    -> "train" message to each participant's SuperNode: K state vectors, state, round, ...
    <- its rows (FedFew: K losses) and its accumulator calls (FedFew: K log weights, K deltas)
    -> replay the calls into the server's accumulators in client order     (= the all-reduce)
    -> alg.end_round(round, answered, rows)                                (STCH-Set, server step)
    -> callbacks: metrics.csv, history.json.gz, plots, W&B; every eval_every rounds and at the
       end an "evaluate" message to every client: its pick and scores -> the evaluation table

Why its own loop rather than Flower's ``Strategy.start()``: a stock strategy carries one
``ArrayRecord`` (one model) between rounds and aggregates replies itself; fedfew's methods keep
K models, per-round algorithm state (FedFew's mu, K=auto's streaks) and aggregate with their own
``end_round``. Driving ``grid.send_and_receive`` from the simulator's loop keeps one
implementation of every method.

The server never holds client data: it learns each client's sizes and label counts from a
``query`` message (:meth:`Federation.connect`) and builds a label-only
:class:`~fedfew.data.base.FederatedData` from them (:func:`catalog`), for the partition report,
the per-client tables and the algorithms' sample weights n_i.

Faults: a client whose node does not answer within ``round_timeout`` seconds, answers with an
error, or has no node is left out of the round (one line on the console and in
``<run_dir>/flower.log``); the round is aggregated over the clients that answered (FedFew:
alpha and w over them). A node that joins later (a restarted SuperNode) is asked who it is at
the next round and takes part again.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from omegaconf import DictConfig, OmegaConf

from fedfew.algorithms.round_log import check_round_log
from fedfew.data.base import ClientSplit, FederatedData
from fedfew.flower.client import accumulators
from fedfew.flower.records import from_record, pack, to_record
from fedfew.simulator.simulation import Simulation, select_participants

#: algorithms the Flower app runs, and those it refuses with the reason
REFUSED = {
    "fedamp": "its server writes each client's own personalized cloud model u_i into that client's state after "
              "every round (a per-client broadcast of server-side per-client state)",
    "oracle": "every client must know every other client's true group (an oracle, not a federated method)",
}


class FederationError(RuntimeError):
    """The federation cannot run: clients missing after the connect timeout, or disagreeing
    about the partition. The message names the clients, their nodes and the errors they sent."""


def check_supported(cfg: DictConfig) -> None:
    """Raise ValueError for what the Flower app cannot run (named with the reason): a refused
    algorithm (:data:`REFUSED`), ``resume`` / ``checkpoint_every`` (per-client state lives on
    the nodes, so a server checkpoint cannot hold it), more than one device, the vmap engine."""
    name = str(cfg.algorithm.name)
    if name in REFUSED:
        raise ValueError(f"algorithm={name} does not run as a Flower app: {REFUSED[name]} (docs/flower.md)")
    if cfg.get("resume") or int(cfg.get("checkpoint_every") or 0):
        raise ValueError("resume and checkpoint_every are not available under Flower: per-client state lives on the "
                         "SuperNodes, a server checkpoint cannot hold it (docs/flower.md)")
    if int(cfg.trainer.devices) != 1 or int(cfg.trainer.num_nodes) != 1:
        raise ValueError("trainer.devices and trainer.num_nodes must be 1 under Flower: each SuperNode trains its "
                         "own client, the server trains nothing")
    if str(cfg.get("engine", "loop")) != "loop":
        raise ValueError("engine=vmap is not available under Flower (one client per node: engine=loop)")


# ---- transports ------------------------------------------------------------------------------

class Transport:
    """How the server reaches the nodes: :class:`GridTransport` (Flower's Grid: the simulation
    engine or a SuperLink) or :class:`LocalTransport` (the ClientApp called in this process)."""

    def nodes(self) -> list[int]:
        """Ids of the nodes connected now."""
        raise NotImplementedError

    def exchange(self, requests: dict[int, tuple[str, RecordDict]], timeout: float | None,
                 group: str) -> dict[int, RecordDict | str]:
        """Send ``{node: (message type, content)}``; returns ``{node: reply content or error text}``
        for the nodes that answered within ``timeout`` seconds (None: wait for all)."""
        raise NotImplementedError


class GridTransport(Transport):
    """Messages through Flower's :class:`flwr.serverapp.Grid` (``grid.send_and_receive``)."""

    def __init__(self, grid: Any) -> None:
        self.grid = grid

    def nodes(self) -> list[int]:
        return sorted(int(n) for n in self.grid.get_node_ids())

    def exchange(self, requests, timeout, group):
        messages = [Message(content, dst_node_id=node, message_type=kind, group_id=group)
                    for node, (kind, content) in requests.items()]
        out: dict[int, RecordDict | str] = {}
        for reply in self.grid.send_and_receive(messages, timeout=timeout):
            node = int(reply.metadata.src_node_id)
            out[node] = reply.error.reason if reply.has_error() else reply.content
        return out


class LocalTransport(Transport):
    """The ClientApp called directly in this process, one Flower ``Context`` per node (tests:
    the same messages and records as a deployment, without processes).

    Args:
        app: the ClientApp. node_configs: node id -> node config (``partition-id`` ...).
    """

    def __init__(self, app: Any, node_configs: dict[int, dict[str, Any]]) -> None:
        from flwr.app import Context
        from flwr.supercore.task_identity import TaskIdentity

        TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0  # what a ServerApp process has
        self.app = app
        self.contexts = {n: Context(run_id=1, node_id=n, node_config=dict(c), state=RecordDict(), run_config={})
                         for n, c in node_configs.items()}

    def nodes(self) -> list[int]:
        return sorted(self.contexts)

    def exchange(self, requests, timeout, group):
        out: dict[int, RecordDict | str] = {}
        for node, (kind, content) in requests.items():
            message = Message(content, dst_node_id=node, message_type=kind, group_id=group)
            try:
                reply = self.app(message, self.contexts[node])
            except Exception as err:  # noqa: BLE001  (Flower turns it into the reply's error)
                out[node] = f"{type(err)}:<'{err}'>"
                continue
            out[node] = reply.error.reason if reply.has_error() else reply.content
        return out


# ---- the federation: which node serves which client ---------------------------------------

@dataclass
class Federation:
    """The nodes of a run and the clients they serve.

    Args:
        transport: how to reach the nodes.
        cfg: the run config (sent with every message as YAML).
        round_timeout: seconds the server waits for a round's replies (None: for every reply).
        connect_timeout: seconds :meth:`connect` waits for every client to have a node.
        say: where lines about nodes go (console and ``flower.log``).
    """

    transport: Transport
    cfg: DictConfig
    round_timeout: float | None = None
    connect_timeout: float = 120.0
    say: Callable[[str], None] = print
    node_of: dict[int, int] = field(default_factory=dict)        # client id -> node id
    described: dict[int, dict[str, Any]] = field(default_factory=dict)  # client id -> its description
    failed: dict[int, str] = field(default_factory=dict)          # node id -> why it is not used
    bytes_log: list[dict[str, Any]] = field(default_factory=list)  # per exchange: bytes down and up per client

    def __post_init__(self) -> None:
        self.run_config = OmegaConf.to_yaml(self.cfg, resolve=True)

    def config(self, **values: Any) -> ConfigRecord:
        """The ConfigRecord every message carries: the run config and ``values``."""
        return ConfigRecord({"run_config": self.run_config, **values})

    def discover(self, label: str) -> None:
        """Ask every node not seen before which client it serves; a node that answers with an
        error is reported (one line) and not used; a client served by a newer node moves to it."""
        known = set(self.node_of.values()) | set(self.failed)
        new = [n for n in self.transport.nodes() if n not in known]
        if not new:
            return
        request = RecordDict({"config": self.config()})
        replies = self.transport.exchange({n: ("query", request) for n in new}, self.round_timeout, label)
        for node in new:
            reply = replies.get(node)
            if reply is None:
                continue  # asked again next time
            if isinstance(reply, str):
                self.failed[node] = reply
                self.say(f"{label}: node {node} failed: {reply}")
                continue
            info = json.loads(str(reply["reply"]["describe"]))
            cid = int(info["client_id"])
            if cid in self.node_of and self.node_of[cid] != node:
                self.say(f"{label}: client {cid} now on node {node} (was node {self.node_of[cid]})")
            elif cid in self.described:
                self.say(f"{label}: client {cid} rejoined on node {node}")
            self.node_of[cid] = node
            self.described[cid] = info

    def connect(self) -> None:
        """Wait until every one of the run's clients has a node (asking new nodes who they are).

        Raises:
            FederationError: after ``connect_timeout`` seconds with clients still missing (named,
                with every node's error), or nodes that disagree on the partition.
        """
        M = int(self.cfg.num_clients)
        deadline = time.monotonic() + self.connect_timeout
        while True:
            self.discover("connect")
            missing = [c for c in range(M) if c not in self.node_of]
            if not missing:
                break
            everyone_there = len(self.transport.nodes()) >= M
            if time.monotonic() > deadline or (self.failed and everyone_there):
                errors = "; ".join(f"node {n}: {why}" for n, why in self.failed.items()) or "none reported"
                raise FederationError(f"clients {missing} have no working SuperNode "
                                      f"({len(self.node_of)} of {M} connected); node errors: {errors}")
            time.sleep(0.5)
        hashes = {info["partition_hash"] for info in self.described.values()}
        if len(hashes) > 1:
            raise FederationError("the SuperNodes hold pieces of different partitions (partition hashes "
                                  f"{sorted(h[:12] for h in hashes)}); export every data directory from one config")

    def exchange(self, kind: str, label: str, contents: dict[int, RecordDict]) -> dict[int, RecordDict]:
        """Send ``contents[client]`` to each client's node; returns the replies of the clients that
        answered. Every client left out (no node, no reply within the timeout, an error) gets one
        line naming it, its node and why."""
        self.discover(label)  # nodes that (re)joined since the last exchange
        requests, asked = {}, {}
        for cid, content in contents.items():
            node = self.node_of.get(cid)
            if node is None:
                self.say(f"{label}: client {cid} left out: no SuperNode serves it")
                continue
            requests[node] = (kind, content)
            asked[node] = cid
        replies = self.transport.exchange(requests, self.round_timeout, label)
        out: dict[int, RecordDict] = {}
        for node, cid in asked.items():
            reply = replies.get(node)
            if isinstance(reply, RecordDict):
                out[cid] = reply
                continue
            why = f"no reply within {self.round_timeout:g} s" if reply is None else reply
            self.say(f"{label}: client {cid} (node {node}) left out of this {kind}: {why}")
            self.failed[node] = why
            if self.node_of.get(cid) == node:
                del self.node_of[cid]
        down = {c: _bytes(contents[c]) for c in out}
        up = {c: _bytes(r) for c, r in out.items()}
        self.bytes_log.append({"exchange": label, "kind": kind, "bytes_down": down, "bytes_up": up})
        return out


def _bytes(content: RecordDict) -> int:
    """Payload bytes of a message: its arrays' data, and its scalars at 8 bytes each (strings and
    bytes at their length). Flower's own ``ConfigRecord.count_bytes`` fails on an empty list."""
    def size(value: Any) -> int:
        if isinstance(value, (list, tuple)):
            return sum(size(v) for v in value)
        if isinstance(value, (str, bytes)):
            return len(value)
        return 8

    total = 0
    for record in content.values():
        if isinstance(record, ArrayRecord):
            total += int(record.count_bytes())
        else:
            total += sum(size(v) for v in record.values())
    return total


def catalog(described: dict[int, dict[str, Any]], M: int) -> FederatedData:
    """The server's label-only view of the federation: M clients with their clients' sizes, label
    counts (sorted labels stand in for the samples) and groups, no inputs (0 samples of the
    clients' input shape), the partition's hash and fingerprint."""
    first = described[0]
    targets, clients, start = [], [], 0
    for cid in range(M):
        info = described[cid]
        parts = []
        for key in ("train_counts", "test_counts", "val_counts"):
            labels = np.repeat(np.arange(len(info[key])), info[key]).astype(np.int64)
            parts.append(np.arange(start, start + len(labels), dtype=np.int64))
            targets.append(labels)
            start += len(labels)
        group = int(info["group"])
        clients.append(ClientSplit(cid, parts[0], parts[1], parts[2], None if group < 0 else group))
    vocab = int(first["vocab_size"])
    return FederatedData(inputs=torch.zeros((0, *first["input_shape"])),
                         targets=torch.as_tensor(np.concatenate(targets)), num_classes=int(first["num_classes"]),
                         clients=clients, vocab_size=None if vocab < 0 else vocab,
                         partition_hash=str(first["partition_hash"]), data_fingerprint=str(first["data_fingerprint"]),
                         name=str(first["name"]))


def table_row(entry: dict[str, Any]) -> torch.Tensor:
    """One client's row of the evaluation table (:data:`fedfew.simulator.evaluation._COLUMNS`) from its
    per-client dict (:func:`fedfew.simulator.evaluation.summarize`'s ``clients`` entry): counts are
    recovered exactly (acc x n_test rounds back to the integer count)."""
    n = int(entry["n_test"])
    correct = round(entry["acc"] * n) if n else 0
    majority = round(entry["majority_acc"] * n) if n else 0
    return torch.tensor([entry["model"], entry["selection_loss"], correct, n, majority, entry["n_train"],
                         entry["model"], entry.get("group", -1), entry.get("balanced_acc", float("nan")),
                         entry.get("macro_f1", float("nan"))], dtype=torch.float64)


class FlowerSimulation(Simulation):
    """A :class:`fedfew.simulator.simulation.Simulation` whose clients are Flower nodes (module docstring).

    Args:
        cfg: the run config. fabric: a Fabric with the run's callbacks. run_dir: the run folder.
        federation: the connected federation (:meth:`Federation.connect` done).
    """

    def __init__(self, cfg: DictConfig, fabric: Any, run_dir: Path, federation: Federation) -> None:
        check_supported(cfg)
        self.federation = federation
        super().__init__(cfg, fabric, run_dir, data=catalog(federation.described, int(cfg.num_clients)))

    def _broadcast(self, rnd: int, state: dict[str, Any], participants: list[int]) -> Callable[[int], RecordDict]:
        """The content of a round's messages: the K server models' state vectors, the
        algorithm's server state, the round, the participants and every client's n_i."""
        from fedfew.core.model_set import flat_state

        models = to_record({str(k): flat_state(m) for k, m in enumerate(self.module.models)})
        config = self.federation.config(round=rnd, participants=list(participants),
                                        num_train=self.num_train.tolist(), model_ids=list(self.module.model_ids),
                                        algorithm_state=pack(state))
        return lambda cid: RecordDict({"models": models, "config": config})

    def run_round(self, rnd: int) -> dict[str, Any]:
        """One round over the nodes (module docstring); logs as the simulator's, over the
        clients that answered."""
        from fedfew.core.distributed import gather_rows
        from fedfew.core.model_set import round_lr

        start = time.perf_counter()
        alg, device = self.algorithm, self.fabric.device
        participants = select_participants(self.cfg, rnd, self.num_clients)
        self.module.lr = round_lr(self.cfg.optim, rnd, int(self.cfg.rounds))
        self.nonfinite.begin_round(rnd)
        state = alg.state_dict()  # as it was before begin_round: the clients run begin_round themselves
        alg.begin_round(rnd, participants)
        content = self._broadcast(rnd, state, participants)
        replies = self.federation.exchange("train", f"round {rnd}", {c: content(c) for c in participants})
        answered = [c for c in participants if c in replies]
        sums = accumulators(alg)
        rows: dict[str, dict[int, torch.Tensor]] = {}
        steps = 0
        for j, cid in enumerate(answered):  # client order: the simulator's order of additions
            reply = replies[cid]
            calls, deltas = reply["reply"], list(from_record(reply["deltas"]).values())
            for name, k, weight, delta in zip(calls["add_attr"], calls["add_k"], calls["add_weight"], deltas):
                sums[str(name)].add(int(k), float(weight), delta.to(device))
            for what in calls["nonfinite"]:
                self.nonfinite.report(cid, str(what))
            for name, value in from_record(reply["rows"]).items():
                rows.setdefault(name, {})[j] = value.to(device)
            steps += int(reply["metrics"]["local-steps"])
        gathered = {name: gather_rows(rows.get(name, {}), len(answered),
                                      torch.zeros(shape(self.module.K), dtype=torch.float64, device=device))
                    for name, shape in alg.row_shapes.items()}
        models = alg.model_count  # before end_round, which may retire one (K=auto)
        logs = alg.end_round(rnd, answered, gathered)
        check_round_log(alg, logs, len(answered), models)
        reported = sorted(self.nonfinite.reported_this_round())
        self.nonfinite.end_round(answered, set(reported))
        logs.update(round=rnd, participants=answered, round_time_s=time.perf_counter() - start,
                    lr=self.module.lr, nonfinite_clients=reported)
        logs.update(self._spent(len(answered), steps, models))
        return logs

    def evaluate(self, rnd: int) -> dict[str, Any]:
        """Every client picks its model and is scored on its node; the table and its summary are
        :func:`fedfew.simulator.evaluation.summarize`'s, as in the simulator (clients that did not answer
        are left out of the table and named in ``summary.clients_missing``)."""
        from fedfew.simulator.evaluation import OPTIMISTIC, summarize

        content = self._broadcast(rnd, self.algorithm.state_dict(), [])
        replies = self.federation.exchange("evaluate", f"evaluation {rnd}", {c: content(c) for c in range(self.num_clients)})
        answered = sorted(replies)
        if not answered:
            raise RuntimeError(f"evaluation of round {rnd}: no client answered")
        entries = {c: json.loads(str(replies[c]["reply"]["evaluation"])) for c in answered}
        candidates = int(replies[answered[0]]["reply"]["num_candidates"])
        settings = self.eval_settings
        results = {}
        for protocol in settings.protocols:
            table = torch.stack([table_row(entries[c][protocol]) for c in answered])
            result = summarize(table, num_candidates=candidates,
                               num_models=getattr(self.module, "initial_K", self.module.K))
            for entry, cid in zip(result["clients"], answered):
                entry["id"] = cid
            result["summary"].update(protocol=protocol, eval_split=settings.split, optimistic=protocol in OPTIMISTIC)
            if len(answered) < self.num_clients:
                result["summary"]["clients_missing"] = [c for c in range(self.num_clients) if c not in replies]
            results[protocol] = result
        result = results[settings.protocol]
        if settings.also:
            result["also"] = {p: results[p] for p in settings.also}
        result["round"] = rnd
        self.remember_best(result)
        return result

    def save_checkpoint(self, rnd: int) -> None:
        """No checkpoints under Flower: per-client state lives on the nodes (:func:`check_supported`)."""
        self.federation.say(f"round {rnd}: no checkpoint under Flower (per-client state lives on the SuperNodes)")
