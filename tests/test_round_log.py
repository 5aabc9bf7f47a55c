"""One round-log contract (fedfew.algorithms.round_log): every key a method's end_round returns is
declared with its kind, the sinks write each key by that kind and never by its length, so a run
with as many participants as models (P = K) lands in metrics.csv, W&B and the console the way any
other run does; an undeclared key or a value of the wrong shape stops the run, naming the method,
the key and how to declare it."""
from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch

from fedfew.algorithms.ifca import IFCA
from fedfew.algorithms.round_log import LOOP_KEYS, Kind, RoundLogError, check_round_log, classify, declared
from fedfew.reporting.callbacks import ConsoleReport, ResultFiles, client_info
from fedfew.reporting.wandb_monitor import WandbMonitor
from fedfew.simulator.simulation import Simulation

from conftest import compose_config

K = 3


class Probe(IFCA):
    """IFCA logging two keys of its own: a per-model vector (``spread``) and a per-client one
    (``score``), plus whatever a test puts in ``extra``."""

    log_keys = {**IFCA.log_keys, "spread": Kind.PER_MODEL, "score": Kind.PER_CLIENT}
    extra: dict = {}

    def end_round(self, rnd, participants, rows):
        logs = super().end_round(rnd, participants, rows)
        logs["spread"] = torch.arange(1, K + 1, dtype=torch.float64) / 10
        logs["score"] = torch.arange(len(participants), dtype=torch.float64)
        logs.update(self.extra)
        return logs


def probe_sim(tmp_path: Path, fabric, participants: int, extra: dict | None = None,
              log_keys: dict | None = None) -> Simulation:
    """8 clients, K = 3 IFCA models, ``participants`` clients per round, the algorithm a :class:`Probe`."""
    cfg = compose_config("algorithm=ifca", f"algorithm.K={K}", "num_clients=8", f"clients_per_round={participants}",
                         "rounds=2", "logger=none")
    sim = Simulation(cfg, fabric, tmp_path)
    sim.algorithm = Probe(cfg.algorithm, sim.ctx)
    sim.algorithm.extra = dict(extra or {})
    if log_keys is not None:
        sim.algorithm.log_keys = log_keys
    return sim


def test_the_declaration_decides_the_kind_not_the_length():
    """Three tensors of length 3 with P = K = 3: each is what its key declares."""
    log = {"a": torch.zeros(3), "b": torch.zeros(3), "c": torch.zeros(3, 1), "d": 2.0, "e": [4, 5]}
    keys = {"a": Kind.PER_MODEL, "b": Kind.PER_CLIENT, "c": Kind.PER_CLIENT, "d": Kind.SCALAR, "e": Kind.RECORD}
    assert classify(log, keys, P=3, K=3) == keys
    assert classify({"a": torch.zeros(3)}, {"a": Kind.PER_CLIENT}, P=3, K=3) == {"a": Kind.PER_CLIENT}
    assert classify({"w": torch.zeros(3, 2)}, {"w": Kind.PER_CLIENT_MODEL}, P=3, K=2) == {"w": Kind.PER_CLIENT_MODEL}
    assert declared(IFCA)["weight_per_model"] is Kind.PER_MODEL and declared(IFCA)["round"] is Kind.SCALAR
    assert set(LOOP_KEYS) <= set(declared(IFCA))


@pytest.mark.parametrize("key, kind, value, expected", [
    ("x", Kind.PER_MODEL, torch.zeros(4), r"expected one number per model, shape \(K,\) with K = 3"),
    ("x", Kind.PER_CLIENT, torch.zeros(3), r"shape \(P,\) or \(P, 1\) with P = 4"),
    ("x", Kind.PER_CLIENT_MODEL, torch.zeros(4, 2), r"shape \(P, K\) = \(4, 3\)"),
    ("x", Kind.SCALAR, torch.zeros(2), "a number"),
    ("x", Kind.PER_MODEL, [1.0, 2.0, 3.0], "a tensor"),
])
def test_a_value_of_the_wrong_shape_is_refused(key, kind, value, expected):
    with pytest.raises(RoundLogError, match=expected):
        classify({key: value}, {key: kind}, P=4, K=3, who="probe")


def test_standard_names_keep_their_meaning():
    """alpha, w, assignment, loss... are read by name in the sinks: only their own kinds are allowed."""
    with pytest.raises(RoundLogError, match=r"declares 'alpha' per_model; the sinks read 'alpha' as per_client"):
        classify({"alpha": torch.zeros(3)}, {"alpha": Kind.PER_MODEL}, P=3, K=3)


def metrics(path: Path) -> dict[str, str]:
    with open(path / "metrics.csv") as fh:
        return next(csv.DictReader(fh))


@pytest.mark.parametrize("P", [3, 4])  # P = K = 3, and P = 4 != K
def test_per_model_and_per_client_keys_land_the_same_way_whatever_P(P, tmp_path, cpu_fabric):
    sim = probe_sim(tmp_path, cpu_fabric, P)
    logs = sim.run_round(1)
    assert len(logs["participants"]) == P and logs["weight_per_model"].shape == (K,)

    # metrics.csv: per-model vectors one column per model, per-client values their mean
    view = sim.view()  # what the callbacks see of the run
    files = ResultFiles(tmp_path)
    files.on_fit_start(view)
    files.on_round_end(view, 1, logs, None)
    row = metrics(tmp_path)
    for name in ("spread", "weight_per_model", "effective_step", "clients_served"):
        assert [f"{name}/{k}" in row for k in range(K)] == [True] * K, name
    assert [float(row[f"spread/{k}"]) for k in range(K)] == [0.1, 0.2, 0.3]
    assert float(row["score_mean"]) == pytest.approx((P - 1) / 2)
    assert not {"spread_mean", "weight_per_model_mean", "effective_step_mean", "score/0"} & set(row)

    # W&B (offline: what the monitor would log): the same per-model names, the per-client value in the
    # round table and as its mean, no per-model vector among the per-client columns
    monitor = WandbMonitor(clients=client_info(view))
    payload = monitor.round_payload(view, 1, logs, None)
    assert [payload[f"spread/{k}"] for k in range(K)] == [0.1, 0.2, 0.3]
    assert [payload[f"weight_per_model/{k}"] for k in range(K)] == logs["weight_per_model"].tolist()
    assert payload["train/score_mean"] == pytest.approx((P - 1) / 2)
    assert not any(k.startswith(("train/spread", "train/weight_per_model")) for k in payload)
    table = payload["clients/round"]
    assert table.columns == ["client", "n_train", "loss_0", "loss_1", "loss_2", "model", "score"]
    assert [r[-1] for r in table.data] == list(range(P))

    # the console: the same line, from the same scalars
    console = ConsoleReport(plain=True)
    console.log_keys = view.log_keys
    line = console.progress_line(1, 2, logs, None, now=0.0)
    loss = logs["loss"].double()
    assert line.startswith(f"round 1/2  loss {float(loss.mean()):.4f}  train ")


def test_an_undeclared_key_stops_the_run(tmp_path, cpu_fabric):
    sim = probe_sim(tmp_path, cpu_fabric, 4, extra={"surprise": torch.ones(K)})
    with pytest.raises(RoundLogError) as caught:
        sim.fit()
    message = str(caught.value)
    for part in ("ifca (Probe.end_round)", "'surprise'", "Probe.log_keys does not declare",
                 "add 'surprise': Kind.PER_MODEL to Probe.log_keys (beside row_shapes)"):
        assert part in message, (part, message)


def test_a_declared_key_of_the_wrong_shape_stops_the_run(tmp_path, cpu_fabric):
    keys = {**Probe.log_keys, "surprise": Kind.PER_MODEL}
    sim = probe_sim(tmp_path, cpu_fabric, 4, extra={"surprise": torch.ones(4)}, log_keys=keys)  # (P,), not (K,)
    with pytest.raises(RoundLogError, match=r"ifca \(Probe.end_round\) logged 'surprise' as a torch.float32 tensor "
                                            r"of shape \(4,\), but declares it per_model: expected one number per model, "
                                            r"shape \(K,\) with K = 3"):
        sim.run_round(1)


def test_a_key_of_the_loop_is_not_the_algorithm_s(tmp_path, cpu_fabric):
    sim = probe_sim(tmp_path, cpu_fabric, 4)
    with pytest.raises(RoundLogError, match=r"returned \['lr'\]: keys the round loop sets itself"):
        check_round_log(sim.algorithm, {"loss": torch.zeros(4, K), "lr": 0.1}, 4, K)


def test_the_loop_counts_models_by_asking_the_algorithm(tmp_path, cpu_fabric):
    """A method's own ``K`` key is just a scalar of its log: the bytes follow ``model_count``."""
    keys = {**Probe.log_keys, "K": Kind.SCALAR}
    sim = probe_sim(tmp_path, cpu_fabric, 4, extra={"K": 1}, log_keys=keys)
    logs = sim.run_round(1)
    assert sim.algorithm.model_count == K and logs["K"] == 1
    assert logs["bytes_up"] == sim.communication.bytes_up * 4  # all K models, not the logged K = 1
