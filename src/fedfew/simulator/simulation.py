"""The round loop on Lightning Fabric.

One round (every rank runs the same code on its own clients)::

    participants (seeded per round)  ->  this rank's clients (balanced by n_i)
    -> alg.client_update(client)  for each of them         (local training)
    -> rows gathered in client order (all-reduce of disjoint rows)
    -> alg.end_round(...)                                   (aggregation + server step; its round log is
                                                            checked against alg.log_keys: fedfew.algorithms.round_log)
    -> callbacks: on_round_end (metrics file, loggers, progress)
    -> every eval_every rounds and at the end: selection + personalized accuracy

A client whose loss, update or personal state is not finite is reported to ``ctx.nonfinite``
(:mod:`fedfew.core.nonfinite`) and left out of the round; after ``DIVERGED_ROUNDS`` rounds in a row in
which every participant was, the run stops early with ``summary.verdict = "diverged"``.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from fedfew.algorithms import ALGORITHMS
from fedfew.algorithms.base import Algorithm, Context
from fedfew.algorithms.round_log import Kind, check_round_log, declared
from fedfew.core.checkpoint import (StopSignal, check_resume_config, checkpoint_path, rng_states, save_checkpoint,
                               set_rng_states)
from fedfew.data.base import FederatedData
from fedfew.data.federated import build_federated_data, to_device
from fedfew.core.distributed import all_reduce_, gather_rows, merge_dicts
from fedfew.core.budget import StepCounter, communication
from fedfew.simulator.evaluation import OPTIMISTIC, EvalSettings, best_round, evaluate_clients, reported
from fedfew.simulator.run_view import RunView
from fedfew.core.io import atomic_torch_save
from fedfew.models import MODELS, DataInfo
from fedfew.core.model_set import KModelSet, round_lr
from fedfew.core.nonfinite import NonFiniteLog
from fedfew.core.resources import current_host_mib, peak_device_mib, peak_host_mib
from fedfew.core.seeding import derive_seed
from fedfew.core.threads import run_threads
from fedfew.engines.base import bound_host_memory

if TYPE_CHECKING:  # Lightning's import takes ~3 s (torchmetrics, transformers): a Flower client never needs it
    from lightning.fabric import Fabric


def shard_clients(client_ids: list[int], sizes: np.ndarray, world_size: int, rank: int) -> list[int]:
    """This rank's clients: greedy longest-first assignment balancing the total n_i per rank.

    Deterministic (ties broken by client id, then rank); a rank may get no client when there
    are fewer clients than ranks.

    Args:
        client_ids: participating client ids.
        sizes: (M,) train sizes n_i of all clients.
        world_size, rank: Fabric's.
    Returns:
        sorted list of client ids for ``rank``.
    """
    load = [0] * world_size
    mine: list[list[int]] = [[] for _ in range(world_size)]
    for cid in sorted(client_ids, key=lambda c: (-int(sizes[c]), c)):
        r = min(range(world_size), key=lambda j: (load[j], j))
        load[r] += int(sizes[cid])
        mine[r].append(cid)
    return sorted(mine[rank])


def select_participants(cfg: DictConfig, rnd: int, num_clients: int) -> list[int]:
    """Client ids taking part in round ``rnd``: all, or a seeded sample of
    ``max(1, round(participation * M))`` clients (``clients_per_round`` overrides)."""
    per_round = cfg.get("clients_per_round", None)
    count = int(per_round) if per_round else max(1, int(round(float(cfg.participation) * num_clients)))
    if count >= num_clients:
        return list(range(num_clients))
    rng = np.random.default_rng(derive_seed(cfg.seed, "participation", rnd))
    return sorted(rng.choice(num_clients, size=count, replace=False).tolist())


def data_info(data: FederatedData) -> DataInfo:
    """Input shape, classes and vocabulary size of the pooled data."""
    return DataInfo(tuple(data.inputs.shape[1:]), data.num_classes, data.vocab_size)


class Simulation:
    """A federated run: data, K-model set, algorithm and the round loop.

    Args:
        cfg: the full validated run config.
        fabric: a launched Fabric (its callbacks receive ``on_fit_start``, ``on_round_end``,
            ``on_interrupt`` and ``on_fit_end``, each with the run's :class:`RunView` as ``sim``).
        run_dir: where rank 0 writes results.
        data: optional prebuilt data (tests); built from ``cfg`` otherwise.
    """

    def __init__(self, cfg: DictConfig, fabric: Fabric, run_dir: Path, data: FederatedData | None = None) -> None:
        self.cfg, self.fabric, self.run_dir = cfg, fabric, Path(run_dir)
        if fabric.device.type == "cpu":
            # every CPU run, not only the engine's methods: the averaging methods' (K, D) float64 round sums
            # (28 MiB for K = 4 CIFAR CNNs) otherwise fragment glibc's heap, +27 MiB of RSS a round (FedEM and
            # IFCA at M = 1,000, 2026-12-07: 5.96 GiB after 200 rounds against FedFew's 1.8)
            bound_host_memory()
        #: the tuned preset the run composed (results.json ``preset``; set by fedfew.train), None outside it
        self.preset: dict[str, Any] | None = None
        host_data = data if data is not None else build_federated_data(cfg)
        self.host_data = host_data
        self.data = to_device(host_data, fabric.device)
        info = data_info(host_data)
        builder = MODELS.get(cfg.model.name)
        alg_cls: type[Algorithm] = ALGORITHMS.get(cfg.algorithm.name)
        self.module = KModelSet(
            lambda: builder(cfg.model, info),
            K=alg_cls.num_models(cfg.algorithm),
            init=cfg.algorithm.get("init", "independent"),
            seed=derive_seed(cfg.seed, "model"),
            lr=float(cfg.optim.lr),
            momentum=float(cfg.optim.momentum),
            weight_decay=float(cfg.optim.weight_decay),
            optimizer=str(cfg.optim.get("name", "sgd")),
            clip_norm=cfg.optim.get("clip_norm"),
        ).to(fabric.device)
        self.num_train = torch.tensor([len(c.train) for c in host_data.clients], dtype=torch.int64)
        self.nonfinite = NonFiniteLog(fatal=bool(cfg.get("fail_on_nonfinite", False)))
        self.ctx = Context(
            cfg=cfg,
            fabric=fabric,
            data=self.data,
            module=self.module,
            train_index=[torch.as_tensor(c.train, device=fabric.device) for c in host_data.clients],
            num_train=self.num_train,
            autocast=fabric.autocast if cfg.trainer.precision not in ("32", "32-true", 32) else None,
            nonfinite=self.nonfinite,
        )
        self.algorithm = alg_cls(cfg.algorithm, self.ctx)
        # per participating client per round (fedfew.core.budget); steps are not counted by the vmap engine
        self.communication = communication(alg_cls, cfg.algorithm, self.module.models[0])
        self.count_steps = str(cfg.get("engine", "loop")) != "vmap"
        self.eval_settings = EvalSettings.from_config(cfg)
        self.best_evaluation: dict[str, Any] | None = None  # eval.protocol=reference: best round so far
        self.best_also: dict[str, dict[str, Any]] = {}  # eval.also=[reference]: its best round so far
        self.history: list[dict[str, Any]] = []
        self.evaluations: list[dict[str, Any]] = []
        self.start_round = 1
        self.wall_time_s = 0.0
        self.logger_state: dict[str, Any] = {}  # e.g. the W&B run id, kept across resumes
        self.stop_signal = StopSignal(announce=fabric.global_rank == 0)
        self._owned: set[int] | None = None

    @property
    def num_clients(self) -> int:
        return self.host_data.num_clients

    @property
    def log_keys(self) -> dict[str, Kind]:
        """Every key a round log of this run may hold, with its kind: the loop's and the
        algorithm's declared ones (:func:`fedfew.algorithms.round_log.declared`); the sinks write
        each key by it."""
        return declared(self.algorithm)

    def view(self) -> RunView:
        """What the callbacks see of this run (:class:`fedfew.simulator.run_view.RunView`): it
        shares this run's history, evaluations and logger state, which grow as the rounds run."""
        return RunView(cfg=self.cfg, run_dir=self.run_dir, rank=self.fabric.global_rank, loggers=list(self.fabric.loggers),
                       host_data=self.host_data, log_keys=self.log_keys, start_round=self.start_round,
                       history=self.history, evaluations=self.evaluations, logger_state=self.logger_state,
                       module=self.module, algorithm=self.algorithm)

    def my_clients(self, participants: list[int]) -> list[int]:
        """The participants this rank trains: each client belongs to one rank for the whole run
        (balanced over all M clients), so per-client host state never changes process."""
        if self._owned is None:
            owned = shard_clients(list(range(self.num_clients)), self.num_train.numpy(),
                                  self.fabric.world_size, self.fabric.global_rank)
            self._owned = set(owned)
        return sorted(c for c in participants if c in self._owned)

    def run_round(self, rnd: int) -> dict[str, Any]:
        """Train one round; returns the algorithm's logs plus timing and participants."""
        start = time.perf_counter()
        participants = select_participants(self.cfg, rnd, self.num_clients)
        position = {cid: j for j, cid in enumerate(participants)}
        self.module.lr = round_lr(self.cfg.optim, rnd, int(self.cfg.rounds))  # every local optimizer of this round
        self.nonfinite.begin_round(rnd)
        self.algorithm.begin_round(rnd, participants)
        rows: dict[str, dict[int, torch.Tensor]] = {}
        with StepCounter() as steps:
            cohort = [self.host_data.clients[cid] for cid in self.my_clients(participants)]
            for cid, out in self.algorithm.train_clients(cohort, rnd).items():
                for name, value in out.items():
                    rows.setdefault(name, {})[position[cid]] = value.to(self.fabric.device)
        gathered = {
            name: gather_rows(rows.get(name, {}), len(participants),
                              torch.zeros(shape(self.module.K), dtype=torch.float64, device=self.fabric.device))
            for name, shape in self.algorithm.row_shapes.items()
        }
        models = self.algorithm.model_count  # before end_round, which may retire one (K=auto)
        logs = self.algorithm.end_round(rnd, participants, gathered)
        check_round_log(self.algorithm, logs, len(participants), models)
        flags = torch.tensor([1.0 if c in self.nonfinite.reported_this_round() else 0.0 for c in participants],
                             dtype=torch.float64, device=self.fabric.device)
        reported = [c for c, f in zip(participants, all_reduce_(flags, "max").tolist()) if f > 0]
        self.nonfinite.end_round(participants, set(reported))
        logs.update(round=rnd, participants=participants, round_time_s=time.perf_counter() - start,
                    lr=self.module.lr, nonfinite_clients=reported)
        logs.update(self._spent(len(participants), steps.count, models))
        return logs

    def _spent(self, num_participants: int, steps: int, models: int) -> dict[str, int]:
        """This round's budget (every rank gets the same): bytes sent up and down by all its
        participants, local SGD steps (summed over ranks; absent with the vmap engine), and
        their running totals (continued across a resume from the restored history).
        ``models``: the server models the round used (:attr:`Algorithm.model_count`); the
        communication is counted for the models at the start and scaled by models / initial K
        (FedFew's K=auto retires models; its communication is proportional to K)."""
        prev = self.history[-1] if self.history else {}
        share = (int(models), self.module.initial_K)
        out: dict[str, int] = {"bytes_up": self.communication.bytes_up * num_participants * share[0] // share[1],
                               "bytes_down": self.communication.bytes_down * num_participants * share[0] // share[1]}
        if self.count_steps:
            out["local_steps"] = int(all_reduce_(torch.tensor([float(steps)], device=self.fabric.device)).item())
        for key in list(out):
            out[f"{key}_cumulative"] = int(prev.get(f"{key}_cumulative", 0)) + out[key]
        return out

    def budget(self) -> dict[str, Any]:
        """What the run spent so far (results.json ``budget``): rounds, server models kept,
        participants per round, parameters d of one model, communication per participating
        client per round (:class:`fedfew.core.budget.Communication`), bytes per round and in total,
        local SGD steps (None with the vmap engine, which does not count them)."""
        last = self.history[-1] if self.history else {}
        per_round = len(last.get("participants") or [])
        c = self.communication
        return {
            "rounds": len(self.history), "server_models": int(self.module.K), "participants_per_round": per_round,
            "num_parameters": sum(p.numel() for p in self.module.models[0].parameters()),
            "params_up_per_client_round": c.params_up, "params_down_per_client_round": c.params_down,
            "bytes_per_parameter": c.bytes_per_parameter,
            "bytes_up_per_client_round": c.bytes_up, "bytes_down_per_client_round": c.bytes_down,
            # the last round's (K=auto: with the models it had; the per-client figures are the K_max models')
            "bytes_up_per_round": int(last.get("bytes_up", c.bytes_up * per_round)),
            "bytes_down_per_round": int(last.get("bytes_down", c.bytes_down * per_round)),
            "bytes_up_total": int(last.get("bytes_up_cumulative", 0)),
            "bytes_down_total": int(last.get("bytes_down_cumulative", 0)),
            "local_steps": int(last["local_steps_cumulative"]) if "local_steps_cumulative" in last else None,
        }

    def evaluate(self, rnd: int) -> dict[str, Any]:
        """Selection + personalized accuracy of every client (all clients, not only participants)."""
        mine = [self.host_data.clients[c] for c in self.my_clients(list(range(self.num_clients)))]
        result = evaluate_clients(self.algorithm, self.ctx, mine, self.num_clients, rnd)
        result["round"] = rnd
        self.remember_best(result)
        return result

    def remember_best(self, result: dict[str, Any]) -> None:
        """Keep the best evaluation so far of every optimistic protocol (``reference``), the
        run's own (``best_evaluation``) and those of ``eval.also`` (``best_also``)."""
        if self.eval_settings.optimistic:
            self.best_evaluation = best_round(self.best_evaluation, result)
        for protocol, scored in result.get("also", {}).items():
            if protocol in OPTIMISTIC:
                self.best_also[protocol] = best_round(self.best_also.get(protocol), {**scored, "round": result["round"]})

    @staticmethod
    def _evaluation_entry(rnd: int, evaluation: dict[str, Any]) -> dict[str, Any]:
        """One entry of ``results.json``'s ``evaluations``: the round and the summary, and under
        ``eval.also`` each extra protocol's summary (``also``)."""
        entry = {"round": rnd, **evaluation["summary"]}
        if "also" in evaluation:
            entry["also"] = {p: r["summary"] for p, r in evaluation["also"].items()}
        return entry

    # ---- checkpoints -------------------------------------------------------------------
    def state_dict(self, rnd: int, host_state: dict[int, dict[str, Any]] | None = None) -> dict[str, Any]:
        """Everything later rounds depend on (see :mod:`fedfew.core.checkpoint`).

        ``host_state``: every client's host state (default: this rank's, all of it on one process).
        """
        return {
            "round": rnd,
            "config": OmegaConf.to_container(self.cfg, resolve=True),  # checked on resume
            "models": self.module.models.state_dict(),
            "model_ids": list(self.module.model_ids),  # the set K=auto left (fedfew.stch.auto_k)
            "algorithm": self.algorithm.state_dict(),
            "host_state": self.ctx.host_state if host_state is None else host_state,
            "rng": rng_states(),
            "history": self.history,
            "evaluations": self.evaluations,
            "wall_time_s": self.wall_time_s,
            "partition_hash": self.host_data.partition_hash,
            "data_fingerprint": self.host_data.data_fingerprint,  # checked on resume, with the partition
            "logger_state": self.logger_state,
            "best_evaluation": self.best_evaluation,
            "best_also": self.best_also,
            "nonfinite": self.nonfinite.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a checkpoint: the next round is ``state["round"] + 1``.

        Raises:
            ResumeError: (a ValueError) this run's config differs from the checkpoint's in a key
                that changes results (:func:`fedfew.core.checkpoint.check_resume_config`).
            ValueError: the checkpoint was made on a different partition, or from other data (its
                ``data_fingerprint``, when it records one).
        """
        check_resume_config(state, self.cfg)
        if state["partition_hash"] != self.host_data.partition_hash:
            raise ValueError(
                "resume: the checkpoint's partition differs from this run's (different seed, dataset, "
                "num_clients or partition settings); resume with the original config or start a new run"
            )
        recorded = state.get("data_fingerprint")  # absent in checkpoints written before it was recorded
        if recorded and self.host_data.data_fingerprint and recorded != self.host_data.data_fingerprint:
            raise ValueError(
                f"resume: the checkpoint was made from other data (data fingerprint {recorded[:12]}, this run's "
                f"{self.host_data.data_fingerprint[:12]}: the files in data_dir differ in content); point data_dir "
                "at the data the run started with, or start a new run"
            )
        self.module.keep_models_(state.get("model_ids", self.module.model_ids))  # models K=auto retired
        self.module.models.load_state_dict(state["models"])
        self.algorithm.load_state_dict(state["algorithm"])
        self.ctx.host_state.clear()
        self.ctx.host_state.update(state["host_state"])
        set_rng_states(state["rng"])
        self.history = list(state["history"])
        self.evaluations = list(state["evaluations"])
        self.wall_time_s = float(state.get("wall_time_s", 0.0))
        self.logger_state = dict(state.get("logger_state", {}))
        self.best_evaluation = state.get("best_evaluation")
        self.best_also = state.get("best_also") or {}  # checkpoints written before eval.also took reference: none
        self.nonfinite.load_state_dict(state.get("nonfinite"))
        self.start_round = int(state["round"]) + 1

    def save_checkpoint(self, rnd: int) -> None:
        """Rank 0 writes the checkpoint; every rank contributes its own clients' host state."""
        host_state = merge_dicts(self.ctx.host_state)  # a collective: every rank calls it
        if self.fabric.global_rank == 0:
            save_checkpoint(checkpoint_path(self.run_dir), self.state_dict(rnd, host_state))
        self.fabric.barrier()

    def _stop_requested(self) -> bool:
        """Whether any rank received a pre-emption signal (all ranks agree)."""
        flag = torch.tensor([1.0 if self.stop_signal.requested else 0.0], device=self.fabric.device)
        return bool(all_reduce_(flag, "max").item() > 0)

    def fit(self) -> dict[str, Any]:
        """Run every round, evaluating every ``eval_every`` rounds and after the last one;
        checkpoint every ``checkpoint_every`` rounds and when SIGTERM/SIGUSR1/SIGINT arrives (then
        stop after the current round, returning ``{"interrupted": True, ...}``; a second SIGINT
        raises KeyboardInterrupt at once). Runs at ``trainer.threads`` torch threads and gives the
        caller's count back after (:func:`fedfew.core.threads.run_threads`).

        Returns:
            the final evaluation (``clients``, ``summary``), last logs and timings.
        """
        with run_threads(self.cfg):
            return self._fit()

    def _fit(self) -> dict[str, Any]:
        cfg, fabric = self.cfg, self.fabric
        view = self.view()  # what the callbacks see (fedfew.simulator.run_view)
        fabric.call("on_fit_start", sim=view)
        every = int(cfg.get("checkpoint_every") or 0)
        self.stop_signal.install()
        evaluation: dict[str, Any] | None = None
        logs: dict[str, Any] = self.history[-1] if self.history else {}
        # resident memory before the first round (data, models, state loaded) and its largest value at
        # a round's end (after its evaluation): what the rounds add, which the process peak may hide
        memory_before = current_host_mib()
        memory_rounds: float | None = None
        try:
            for rnd in range(self.start_round, int(cfg.rounds) + 1):
                start = time.perf_counter()
                logs = self.run_round(rnd)
                self.history.append(logs)
                evaluation = None
                if rnd % int(cfg.eval_every) == 0 or rnd == int(cfg.rounds):
                    evaluation = self.evaluate(rnd)
                    self.evaluations.append(self._evaluation_entry(rnd, evaluation))
                self.wall_time_s += time.perf_counter() - start
                now = current_host_mib()
                if now is not None:
                    memory_rounds = now if memory_rounds is None else max(memory_rounds, now)
                fabric.call("on_round_end", sim=view, round=rnd, logs=logs, evaluation=evaluation)
                stop = self._stop_requested()
                if (every and rnd % every == 0) or stop:
                    self.save_checkpoint(rnd)
                if self.nonfinite.stopped_at is not None:  # diverged: nothing finite reaches the server any more
                    break
                if stop and rnd < int(cfg.rounds):
                    fabric.call("on_interrupt", sim=view, round=rnd)
                    return {"interrupted": True, "round": rnd, "signal": self.stop_signal.signum}
        finally:
            self.stop_signal.uninstall()
        wall = self.wall_time_s
        last = len(self.history)  # the last round trained (< rounds when the run diverged)
        final = evaluation if evaluation is not None else self.evaluate(last)
        also = {p: reported({**r, "round": final["round"]}, self.best_also.get(p), p in OPTIMISTIC)
                for p, r in final.get("also", {}).items()}  # eval.also: the final round's (reference: the best round's)
        final = reported(final, self.best_evaluation, self.eval_settings.optimistic)  # reference: the best round
        final["summary"]["rounds"] = int(cfg.rounds)
        final["summary"].update(self.algorithm.summary())  # e.g. K=auto's K_changes
        nonfinite = self.nonfinite.as_dict()
        clients = merge_dicts(nonfinite["clients"])  # every rank's clients (a collective)
        nonfinite["clients"] = {c: clients[c] for c in sorted(clients, key=int)}
        nonfinite["verdict"] = "diverged" if nonfinite["stopped_at"] is not None else (
            "nonfinite" if clients else "finite")
        outcome = {"verdict": nonfinite["verdict"], "rounds_trained": last}
        final["summary"].update(outcome)
        results = {
            "config": OmegaConf.to_container(cfg, resolve=True),
            "summary": final["summary"],
            "clients": final["clients"],
            "loss": logs.get("loss"),
            "alpha": logs.get("alpha"),
            "w": logs.get("w"),
            "participants": logs.get("participants"),
            "evaluations": self.evaluations,
            "partition_hash": self.host_data.partition_hash,
            "data_fingerprint": self.host_data.data_fingerprint or None,  # what was read, not where (fedfew.data.fingerprint)
            "wall_time_s": wall,
            # wall time (training, evaluations, logging) per round, and training alone per round
            "seconds_per_round": wall / max(1, len(self.history)),
            "train_seconds_per_round": sum(float(h["round_time_s"]) for h in self.history) / max(1, len(self.history)),
            # this process's peaks (rank 0's under Fabric), data loading included; after a resume, since the resume
            "peak_host_memory_mib": peak_host_mib(),
            # resident memory before round 1 and the largest at a round's end (None off Linux): their
            # difference is what training and evaluation add on top of the loaded data
            "host_memory_before_rounds_mib": memory_before,
            "host_memory_max_after_round_mib": memory_rounds,
            "peak_device_memory_mib": peak_device_mib(fabric.device),
            "world_size": fabric.world_size,
            "budget": self.budget(),
            "nonfinite": nonfinite,
        }
        if self.preset is not None:
            results["preset"] = self.preset
        if also:  # the same run, scored under eval.also's protocols: what a run of each would report
            results["also"] = {
                p: {"summary": {**r["summary"], "rounds": int(cfg.rounds), **self.algorithm.summary(), **outcome},
                    "clients": r["clients"],
                    "evaluations": [{"round": e["round"], **e["also"][p]} for e in self.evaluations if "also" in e]}
                for p, r in also.items()
            }
        if cfg.get("save_models", False) and fabric.global_rank == 0:
            atomic_torch_save(self.run_dir / "models.pt", [m.state_dict() for m in self.module.models])
        fabric.call("on_fit_end", sim=view, results=results)
        return results
