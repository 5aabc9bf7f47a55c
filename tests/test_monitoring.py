"""Live monitoring: W&B (offline, read back with W&B's own reader), the history file, PNG plots,
generic logging for baselines, and W&B never stopping a run."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from fedfew.algorithms.round_log import LOOP_KEYS, Kind
from fedfew.reporting.callbacks import round_scalars
from fedfew.reporting.history_file import load_history, write_history
from fedfew.reporting.wandb_monitor import (
    WandbMonitor, client_columns, find_wandb_runs, load_table, read_wandb_run, wandb_scalars,
)

ROOT = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def wandb_env(tmp_path: Path) -> dict[str, str]:
    """Offline, silent W&B with every W&B folder inside ``tmp_path``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(WANDB_MODE="offline", WANDB_SILENT="true", WANDB_DIR=str(tmp_path / "wandb_dir"),
               WANDB_CACHE_DIR=str(tmp_path / "wandb_cache"), WANDB_DATA_DIR=str(tmp_path / "wandb_data"),
               WANDB_CONFIG_DIR=str(tmp_path / "wandb_config"))
    return env


def train(tmp_path: Path, *overrides: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fedfew.train", *overrides], cwd=ROOT, env=wandb_env(tmp_path),
                          capture_output=True, text=True, timeout=timeout)


def assert_png(path: Path) -> None:
    assert path.exists(), path
    assert path.read_bytes()[:8] == PNG_MAGIC and path.stat().st_size > 2000, path


@pytest.mark.slow
def test_wandb_offline_logs_alpha_w_every_round(tmp_path):
    run_dir = tmp_path / "run"
    M, K, R = 10, 3, 3
    proc = train(tmp_path, f"hydra.run.dir={run_dir}", f"rounds={R}", "eval_every=1", f"num_clients={M}",
                 f"algorithm.K={K}", "logger=wandb", "logger.tags=[test,monitoring]", "logger.group=tests")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "wandb sync" in proc.stdout
    results = json.loads((run_dir / "results.json").read_text())
    history = load_history(run_dir)

    # exactly one W&B run, in the run directory, finished cleanly
    assert len(find_wandb_runs(tmp_path)) == 1
    run = read_wandb_run(run_dir)
    assert run.exit_code == 0
    # the full resolved config is the run config
    assert run.config == results["config"]

    rounds = [h for h in run.history if "round" in h]  # (other callbacks may log before round 1)
    assert [h["_step"] for h in rounds] == list(range(1, R + 1))
    assert [r["round"] for r in history["rounds"]] == list(range(1, R + 1))
    for step, logged, rec in zip(range(1, R + 1), rounds, history["rounds"]):
        assert logged["round"] == step
        rows = load_table(run, logged["clients/round"])
        assert [r["client"] for r in rows] == rec["participants"] == list(range(M))
        alpha = [r["alpha"] for r in rows]
        w = [[r[f"w_{k}"] for k in range(K)] for r in rows]
        loss = [[r[f"loss_{k}"] for k in range(K)] for r in rows]
        # alpha: length M, sums to 1; w: M x K, rows sum to 1; both exactly as in the history
        assert len(alpha) == M and math.isclose(sum(alpha), 1.0, abs_tol=1e-9)
        assert len(w) == M and all(len(row) == K and math.isclose(sum(row), 1.0, abs_tol=1e-9) for row in w)
        assert alpha == rec["alpha"] and w == rec["w"] and loss == rec["loss"]
        assert [r["model"] for r in rows] == rec["assignment"] == [int(np.argmax(row)) for row in w]
        # per-client alpha lines and the scalars agree with the same values
        assert [logged[f"alpha/client_{i}"] for i in range(M)] == alpha
        assert logged["train/g"] == rec["g"]
        assert math.isclose(logged["alpha/max"], max(alpha), rel_tol=1e-12)
        share_k = np.sum(np.array(alpha)[:, None] * np.array(w), axis=0)  # sum_i alpha_i w_ik
        assert np.allclose([logged[f"weight_share/{k}"] for k in range(K)], share_k, atol=1e-12)
        # the default (normalised) server step: every model with any weight takes a full server_lr step
        server_lr = results["config"]["algorithm"]["server_lr"]
        assert [logged[f"effective_step/{k}"] for k in range(K)] == [server_lr * float(s > 0) for s in share_k]
        assert [logged[f"clients_served/{k}"] for k in range(K)] == np.bincount(rec["assignment"], minlength=K).tolist()
        assert logged["train/lr"] == results["config"]["optim"]["lr"] and logged["train/round_time_s"] > 0
        # images and histograms are W&B media
        assert logged["w/heatmap"]["_type"] == "image-file" and logged["loss/heatmap"]["_type"] == "image-file"
        assert_png(run.files_dir / logged["w/heatmap"]["path"])
        assert logged["alpha/hist"]["_type"] == "histogram"
        # evaluation every round: summary scalars and the per-client accuracy histogram
        ev = history["evaluations"][step - 1]
        assert ev["round"] == step
        for key in ("acc_mean", "acc_std", "acc_min", "acc_max", "acc_weighted"):
            assert logged[f"eval/{key}"] == ev["summary"][key]
        assert logged["eval/acc_hist"]["_type"] == "histogram" and sum(logged["eval/acc_hist"]["values"]) == M
        assert [r["acc"] for r in load_table(run, logged["eval/clients"])] == ev["acc"]

    # results.json holds the last round's alpha / w: the values W&B got in round R
    assert results["alpha"] == history["rounds"][-1]["alpha"]
    assert results["w"] == history["rounds"][-1]["w"]
    # the end-of-run summary table: size, labels, chosen model, accuracy per client
    final = run.history[-1]
    table = load_table(run, final["summary/clients"])
    assert [(r["client"], r["n_train"], r["n_test"], r["model"], r["acc"]) for r in table] == \
        [(c["id"], c["n_train"], c["n_test"], c["model"], c["acc"]) for c in results["clients"]]
    assert all(sum(r[f"n_label_{c}"] for c in range(10)) == r["n_train"] for r in table)
    assert "summary/alpha_over_rounds_table" in final and "plots/alpha" in final
    assert run.summary["final/acc_mean"] == results["summary"]["acc_mean"]

    # the same pictures as PNG files in the run directory
    for name in ("accuracy", "alpha", "assignment", "client_accuracy", "w_round_0001", "w_round_0002",
                 "w_round_0003", "loss_round_0003"):
        assert_png(run_dir / "plots" / f"{name}.png")


@pytest.mark.slow
def test_two_processes_make_one_wandb_run_and_exit_promptly(tmp_path):
    run_dir = tmp_path / "run"
    start = time.time()
    proc = train(tmp_path, f"hydra.run.dir={run_dir}", "rounds=2", "eval_every=1", "num_clients=6", "algorithm.K=2",
                 "logger=wandb", "trainer.devices=2", "trainer.strategy=ddp", "trainer.accelerator=cpu",
                 "trainer.threads=1", timeout=240)
    ended = time.time()
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((run_dir / "results.json").read_text())
    assert results["world_size"] == 2
    last_round = (run_dir / "metrics.csv").stat().st_mtime  # rewritten at the end of every round
    assert start < last_round and ended - last_round < 60
    runs = find_wandb_runs(tmp_path)
    assert len(runs) == 1, runs
    run = read_wandb_run(runs[0])
    assert run.exit_code == 0 and [h["_step"] for h in run.history if "round" in h] == [1, 2]
    assert len(load_table(run, run.history[-1]["clients/round"])) == 6
    assert run.config["trainer"]["devices"] == 2


def baseline_logs(P: int = 4, K: int = 2) -> dict:
    """Round logs as a baseline might return them: no alpha / w / g."""
    return {
        "round": 2, "round_time_s": 0.5, "lr": 0.1, "participants": list(range(P)),
        "loss": torch.arange(P * K, dtype=torch.float64).reshape(P, K) / 10,
        "assignment": torch.tensor([0, 1, 1, 0])[:P],
        "weight_per_model": torch.tensor([0.25, 0.75], dtype=torch.float64)[:K],
        "personal_loss": torch.linspace(0.1, 0.4, P, dtype=torch.float64),
        "global_loss_mean": 0.7,
    }


#: what a baseline returning :func:`baseline_logs` declares, and the loop's keys
BASELINE_KEYS = {**LOOP_KEYS, "loss": Kind.PER_CLIENT_MODEL, "assignment": Kind.PER_CLIENT,
                 "weight_per_model": Kind.PER_MODEL, "personal_loss": Kind.PER_CLIENT, "global_loss_mean": Kind.SCALAR}


def test_round_scalars_and_wandb_names_are_generic():
    logs = baseline_logs()
    s = round_scalars(logs, None, BASELINE_KEYS)
    assert s["round"] == 2 and s["global_loss_mean"] == 0.7 and "g" not in s
    assert s["personal_loss_mean"] == pytest.approx(0.25)  # Ditto-like per-client value: its mean
    assert s["train_loss_mean"] == pytest.approx(0.35) and s["train_loss_best_mean"] == pytest.approx(0.3)
    assert [s["clients_served/0"], s["clients_served/1"]] == [2, 2]
    evaluation = {"summary": {"acc_mean": 0.5, "acc_std": 0.1, "acc_min": 0.3, "acc_max": 0.7, "acc_weighted": 0.55,
                              "majority_acc_mean": 0.2, "global_acc_mean": 0.4, "models_served": [3, 1]},
                  "clients": []}
    w = wandb_scalars(logs, evaluation, BASELINE_KEYS)
    assert w["train/global_loss_mean"] == 0.7 and w["train/loss_mean"] == pytest.approx(0.35)
    assert w["train/personal_loss_mean"] == pytest.approx(0.25)
    assert w["eval/acc_mean"] == 0.5 and w["eval/global_acc_mean"] == 0.4
    assert [w["eval/models_served/0"], w["eval/models_served/1"]] == [3, 1]
    assert not any(k.startswith("alpha") for k in w)
    cols = client_columns(logs, BASELINE_KEYS)
    assert list(cols) == ["loss", "assignment", "personal_loss"]
    assert [s["weight_per_model/0"], s["weight_per_model/1"]] == [0.25, 0.75]  # per-model: one column per model
    assert [w["weight_per_model/0"], w["weight_per_model/1"]] == [0.25, 0.75]


def test_round_payload_for_a_baseline_has_assignment_but_no_alpha():
    sim = SimpleNamespace(module=SimpleNamespace(K=2), num_clients=4, cfg=OmegaConf.create({"rounds": 5}),
                          log_keys=BASELINE_KEYS)
    monitor = WandbMonitor(clients=[{"n_train": 10 + i} for i in range(4)])
    first = monitor.round_payload(sim, 1, {**baseline_logs(), "round": 1}, None)
    assert first["assignment/changed"] == 0
    logs = {**baseline_logs(), "assignment": torch.tensor([1, 1, 1, 0])}
    payload = monitor.round_payload(sim, 2, logs, None)
    assert payload["assignment/changed"] == 1 and payload["clients_served/1"] == 3
    assert "loss/heatmap" in payload and "w/heatmap" not in payload
    assert not any(k.startswith("alpha") for k in payload)
    table = payload["clients/round"]
    assert table.columns == ["client", "n_train", "loss_0", "loss_1", "model", "personal_loss"]
    assert [row[4] for row in table.data] == [1, 1, 1, 0] and [row[1] for row in table.data] == [10, 11, 12, 13]


def test_wandb_errors_never_stop_a_run(tmp_path):
    from fedfew.reporting.loggers import WandbLogger

    logger = WandbLogger(OmegaConf.create({"name": "wandb", "mode": "no-such-mode"}), tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert logger.start({"seed": 0}) is None
        logger.log({"x": 1.0}, step=1)
        logger.update_summary({"y": 2})
        logger.finalize("success")
    assert not logger.active
    assert sum("W&B disabled" in str(w.message) for w in caught) == 1
    assert not (tmp_path / "wandb").exists()


def test_plots_from_history_with_partial_participation(tmp_path):
    from fedfew.reporting.plots import per_client_matrix, write_plots

    rng = np.random.default_rng(0)
    M, K = 6, 2
    rounds = []
    for t in range(1, 6):
        ids = sorted(rng.choice(M, size=4, replace=False).tolist())
        w = rng.dirichlet(np.ones(K), size=4)
        rounds.append({"round": t, "participants": ids, "g": 1.0 / t, "alpha": rng.dirichlet(np.ones(4)).tolist(),
                       "w": w.tolist(), "loss": rng.random((4, K)).tolist(), "assignment": w.argmax(1).tolist()})
    history = {"num_clients": M, "K": K, "algorithm": "fedfew", "dataset": "synthetic", "rounds": rounds,
               "evaluations": [{"round": t, "summary": {"acc_mean": 0.5, "acc_std": 0.1, "acc_min": 0.3, "acc_max": 0.8,
                                                        "acc_weighted": 0.55, "majority_acc_mean": 0.2},
                                "acc": rng.random(M).tolist(), "model": rng.integers(0, K, M).tolist()}
                               for t in (2, 4, 5)]}
    write_history(tmp_path, history)
    written = {p.name for p in write_plots(tmp_path)}
    assert written == {"accuracy.png", "alpha.png", "assignment.png", "client_accuracy.png",
                       "w_round_0001.png", "w_round_0003.png", "w_round_0005.png",
                       "loss_round_0001.png", "loss_round_0003.png", "loss_round_0005.png"}
    for name in written:
        assert_png(tmp_path / "plots" / name)
    x, alpha = per_client_matrix(history, "alpha")
    assert x.tolist() == [1, 2, 3, 4, 5]
    for j, rec in enumerate(rounds):
        absent = sorted(set(range(M)) - set(rec["participants"]))
        assert np.isnan(alpha[j, absent]).all() and alpha[j, rec["participants"]].tolist() == rec["alpha"]
    # chosen rounds only
    assert {p.name for p in write_plots(tmp_path, w_rounds=[2], out_dir=tmp_path / "two")} >= {"w_round_0002.png"}


def test_run_plots_take_the_history_just_written_without_reading_it_back(tmp_path, monkeypatch):
    """PlotFiles given its ResultFiles draws from the history in memory: the same pictures as from the
    file, and the file is not read again (it was written a moment before)."""
    import fedfew.reporting.plots as plots
    from fedfew.reporting.callbacks import PlotFiles, ResultFiles

    rounds = [{"round": t, "participants": [0, 1, 2], "g": 1.0, "alpha": [0.2, 0.3, 0.5],
               "w": [[0.9, 0.1], [0.5, 0.5], [0.2, 0.8]], "loss": [[0.1, 0.2]] * 3, "assignment": [0, 0, 1]}
              for t in (1, 2, 3)]
    history = {"num_clients": 3, "K": 2, "algorithm": "fedfew", "dataset": "synthetic", "rounds": rounds,
               "evaluations": [{"round": 3, "summary": {"acc_mean": 0.5, "acc_std": 0.1, "acc_min": 0.3,
                                                        "acc_max": 0.8, "acc_weighted": 0.5, "majority_acc_mean": 0.2},
                                "acc": [0.3, 0.5, 0.8], "model": [0, 0, 1]}]}
    write_history(tmp_path / "from_file", history)
    from_file = {p.name for p in PlotFiles(tmp_path / "from_file").draw()}

    source = ResultFiles(tmp_path / "in_memory")
    source.history = history  # what ResultFiles.write_history keeps after writing the file

    def no_read(run_dir):
        raise AssertionError(f"history of {run_dir} read back from disk")

    monkeypatch.setattr(plots, "load_history", no_read)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # PlotFiles.draw turns a failure into a warning: make it fail here
        in_memory = {p.name for p in PlotFiles(tmp_path / "in_memory", source=source).draw()}
    assert in_memory == from_file and "alpha.png" in in_memory and "w_round_0003.png" in in_memory
    for name in in_memory:
        assert_png(tmp_path / "in_memory" / "plots" / name)
