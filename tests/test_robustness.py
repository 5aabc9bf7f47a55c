"""Resume after a pre-emption signal, non-finite clients, partial participation."""
from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

from fedfew.data.federated import build_federated_data
from fedfew.stch.scalarization import stch_set
from fedfew.simulator.simulation import Simulation, select_participants

from conftest import compose_config
from test_train_cli import ROOT, train


def poisoned(cfg, client: int):
    data = build_federated_data(cfg)
    data.inputs[torch.as_tensor(data.clients[client].train)] = float("nan")
    return data


def flat(models):
    return [torch.cat([p.detach().reshape(-1) for p in m.parameters()]) for m in models]


def test_nonfinite_client_is_excluded_and_recorded_without_a_warning_per_round(tmp_path, cpu_fabric):
    cfg = compose_config("num_clients=6", "logger=none", "algorithm.mu=0.5")
    sim = Simulation(cfg, cpu_fabric, tmp_path, data=poisoned(cfg, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # recorded (fedfew.core.nonfinite), not warned
        logs = sim.run_round(1)
    assert logs["excluded"] == [2] and logs["nonfinite_clients"] == [2]
    K = sim.module.K
    assert sim.nonfinite.as_dict()["clients"] == {
        "2": {"first_round": 1, "last_round": 1, "rounds": 1, "what": [f"local copy of model {k}" for k in range(K)]}}
    K = sim.module.K
    assert float(logs["alpha"][2]) == 0.0 and torch.equal(logs["w"][2], torch.zeros(K, dtype=torch.float64))
    assert float(logs["alpha"].sum()) == pytest.approx(1.0)
    # the others' weights are STCH-Set over the five finite clients
    keep = [0, 1, 3, 4, 5]
    n = sim.num_train.double()
    # mu_scale=relative: losses weighted by n_i / mean n over the round's participants (all six)
    scaled = logs["loss"][keep] * (n[keep] / n.mean())[:, None]
    ref = stch_set(scaled, 0.5)
    torch.testing.assert_close(logs["alpha"][keep], ref.alpha)
    assert all(bool(torch.isfinite(v).all()) for v in flat(sim.module.models))


def test_nonfinite_client_is_fatal_when_configured(tmp_path, cpu_fabric):
    cfg = compose_config("num_clients=6", "logger=none", "fail_on_nonfinite=true")
    sim = Simulation(cfg, cpu_fabric, tmp_path, data=poisoned(cfg, 4))
    with pytest.raises(FloatingPointError, match=r"round 1: client 4: non-finite local copy of model 0"):
        sim.run_round(1)


def test_all_clients_nonfinite_leaves_models_unchanged(tmp_path, cpu_fabric):
    cfg = compose_config("num_clients=3", "partition=iid", "logger=none")
    data = build_federated_data(cfg)
    data.inputs[:] = float("nan")
    sim = Simulation(cfg, cpu_fabric, tmp_path, data=data)
    before = flat(sim.module.models)
    logs = sim.run_round(1)
    assert logs["excluded"] == [0, 1, 2] and sim.nonfinite.diverged_rounds == [1] and sim.nonfinite.stopped_at is None
    for a, b in zip(before, flat(sim.module.models)):
        assert torch.equal(a, b)


def test_participants_are_seeded_per_round_and_sized():
    cfg = compose_config("num_clients=200", "participation=0.1")
    rounds = [select_participants(cfg, r, 200) for r in (1, 2)]
    assert all(len(p) == 20 and len(set(p)) == 20 for p in rounds)
    assert rounds[0] != rounds[1] and rounds[0] == select_participants(cfg, 1, 200)
    cfg = compose_config("num_clients=200", "clients_per_round=7")
    assert len(select_participants(cfg, 1, 200)) == 7


@pytest.mark.slow
def test_two_hundred_clients_partial_participation(tmp_path):
    run_dir = tmp_path / "run"
    proc = train(f"hydra.run.dir={run_dir}", "num_clients=200", "participation=0.1", "partition=iid", "rounds=3",
                 "logger=none")
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((run_dir / "results.json").read_text())
    assert len(results["clients"]) == 200  # every client evaluated
    assert len(results["participants"]) == 20 and len(results["alpha"]) == 20
    assert abs(sum(results["alpha"]) - 1) < 1e-6


def metric_rows(run_dir: Path) -> list[dict]:
    rows = list(csv.DictReader((run_dir / "metrics.csv").open()))
    for row in rows:
        row.pop("round_time_s")
    return rows


@pytest.mark.slow
def test_signal_checkpoint_and_resume_equal_uninterrupted_run(tmp_path):
    common = ["rounds=6", "local_epochs=15", "num_clients=10", "save_models=true", "logger=none", "eval_every=2",
              "trainer.threads=1"]
    env = {**os.environ, "WANDB_MODE": "disabled"}
    full = tmp_path / "full"  # the uninterrupted run, beside the one that is stopped (one thread each)
    full_run = subprocess.Popen([sys.executable, "-m", "fedfew.train", f"hydra.run.dir={full}", *common], cwd=ROOT,
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    part = tmp_path / "part"
    child = subprocess.Popen([sys.executable, "-m", "fedfew.train", f"hydra.run.dir={part}", *common], cwd=ROOT, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while time.time() < deadline:
        if (part / "metrics.csv").exists() and len((part / "metrics.csv").read_text().splitlines()) >= 4:  # 3 rounds
            break
        assert child.poll() is None, child.communicate()[1][-2000:]
        time.sleep(0.02)
    child.send_signal(signal.SIGTERM)
    _, err = child.communicate(timeout=300)
    assert child.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert "resume=auto" in err and (part / "checkpoints" / "last.ckpt").exists()
    stopped_at = torch.load(part / "checkpoints" / "last.ckpt", weights_only=False)["round"]
    assert 3 <= stopped_at < 6 and not (part / "results.json").exists()

    proc = train(f"hydra.run.dir={part}", *common, "resume=auto")
    assert proc.returncode == 0, proc.stderr[-2000:]
    _, full_err = full_run.communicate(timeout=300)
    assert full_run.returncode == 0, full_err[-2000:]
    a = json.loads((full / "results.json").read_text())
    b = json.loads((part / "results.json").read_text())
    for key in ("loss", "alpha", "w", "clients", "evaluations"):
        assert a[key] == b[key], key  # bit-identical
    assert metric_rows(full) == metric_rows(part)
    for sa, sb in zip(torch.load(full / "models.pt"), torch.load(part / "models.pt")):
        for name in sa:
            assert torch.equal(sa[name], sb[name])
