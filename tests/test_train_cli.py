"""End-to-end runs of the command line (`python -m fedfew.train`), as a user runs them."""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def train(*overrides: str, env: dict | None = None, timeout: int = 600,
          flags: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """``python [flags] -m fedfew.train <overrides>`` in the checkout, W&B off."""
    full_env = {**os.environ, "WANDB_MODE": "disabled", **(env or {})}
    return subprocess.run(
        [sys.executable, *flags, "-m", "fedfew.train", *overrides], cwd=ROOT, env=full_env,
        capture_output=True, text=True, timeout=timeout,
    )


@pytest.mark.slow
def test_embedded_default_learns_digits(tmp_path):
    run_dir = tmp_path / "run"
    proc = train(f"hydra.run.dir={run_dir}", "logger=csv")
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((run_dir / "results.json").read_text())
    s = results["summary"]
    # defaults: digits in 4 rotation groups (partition=clustered), M = 20, K = 4 (= the groups),
    # 50 rounds; seen 0.913 client-mean (seeds 0/1/2: 0.913 / 0.910 / 0.915), ARI 1, [5, 5, 5, 5]
    assert 0.85 <= s["acc_mean"] <= 1.0
    assert s["acc_mean"] > s["majority_acc_mean"] + 0.3
    assert s["acc_min"] <= s["acc_mean"] <= s["acc_max"]
    assert s["rounds"] == 50 and sum(s["models_served"]) == 20
    # the K models really serve the groups: every model is used and the assignment recovers them
    assert s["models_in_use"] == 4 and s["assignment_ari"] >= 0.9
    # no model starves, so the collapse watch stays quiet (it fires with the reference rule:
    # tests/test_clustered.py)
    assert "warning:" not in proc.stderr and s["collapse_warnings"] == []
    assert results["preset"] == {"tuned": "digits_fedfew", "tuned_for_this_setup": True, "note": None}
    assert len(results["clients"]) == 20 and len(results["alpha"]) == 20
    assert abs(sum(results["alpha"]) - 1) < 1e-6
    assert all(abs(sum(row) - 1) < 1e-6 and len(row) == 4 for row in results["w"])
    for c in results["clients"]:
        assert c["n_train"] >= 1 and c["n_test"] >= 1 and 0 <= c["model"] < 4 and 0 <= c["acc"] <= 1
    weighted = sum(c["acc"] * c["n_test"] for c in results["clients"]) / sum(c["n_test"] for c in results["clients"])
    assert abs(weighted - s["acc_weighted"]) < 1e-9
    rows = list(csv.DictReader((run_dir / "metrics.csv").open()))
    assert [int(r["round"]) for r in rows] == list(range(1, 51))
    assert (run_dir / "config.yaml").exists() and (run_dir / "logs" / "metrics.csv").exists()
    assert "personalized test accuracy per client" in proc.stdout and "majority-label baseline" in proc.stdout
    # the README says what this command prints (seed 0), not a mean over seeds
    from test_readme_commands import default_run_table

    printed = default_run_table()["fedfew"][0]  # "0.9125 ± 0.0388, [5, 5, 5, 5], ARI 1.000"
    readme_mean, readme_std = (float(x) for x in printed.split(",")[0].split(" ± "))
    assert abs(s["acc_mean"] - readme_mean) <= 0.01 and abs(s["acc_std"] - readme_std) <= 0.01
    assert printed.split(", ", 1)[1] == f"{s['models_served']}, ARI {s['assignment_ari']:.3f}"


@pytest.mark.slow
def test_same_seed_same_results_different_seed_differs(tmp_path):
    def run(name, seed):
        proc = train(f"hydra.run.dir={tmp_path / name}", "rounds=4", f"seed={seed}", "logger=none", "trainer.threads=1")
        assert proc.returncode == 0, proc.stderr[-2000:]
        out = json.loads((tmp_path / name / "results.json").read_text())
        # the digits preset applies, tuned for 50 rounds: results.json and the log say so
        assert out["preset"]["tuned"] == "digits_fedfew" and out["preset"]["tuned_for_this_setup"] is False
        assert "(rounds: 50 in the preset, 4 here)" in out["preset"]["note"] and out["preset"]["note"] in proc.stdout
        return out["alpha"], out["w"], [c["acc"] for c in out["clients"]], out["partition_hash"]

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:  # two processes at a time, one thread each (the two of seed 3 side by side)
        a, b, c = pool.map(run, ("a", "b", "c"), (3, 3, 4))
    assert a == b  # bit-identical on CPU
    assert a[3] != c[3] and a[:3] != c[:3]


@pytest.mark.parametrize(
    "override,key",
    [
        # one value rule, one registry, one rule across keys through the CLI; every rule's message
        # is checked in process by tests/test_config.py
        ("algorithm.K=0", "algorithm.K"),
        ("dataset=nosuchset", "dataset"),
        ("algorithm.K=30", "algorithm.K"),
    ],
)
def test_invalid_values_stop_before_training(tmp_path, override, key):
    run_dir = tmp_path / "run"
    start = time.perf_counter()
    proc = train(f"hydra.run.dir={run_dir}", *override.split(), "logger=none", timeout=120)
    assert proc.returncode != 0
    assert key in proc.stderr
    assert time.perf_counter() - start < 60
    assert not (run_dir / "metrics.csv").exists() and not run_dir.exists()


@pytest.mark.parametrize("overrides,said", [
    (["optim.lr=-1"], "  optim.lr=-1: allowed number > 0"),
    (["algorithm=fedavg", "engine=vmap"], "  engine=vmap with algorithm=fedavg: "),
])
def test_bad_values_are_reported_before_torch_is_imported(tmp_path, overrides, said):
    """The value checks run before anything imports torch or Lightning (which takes seconds):
    ``-X importtime`` lists every module the process imported, and neither is among them."""
    run_dir = tmp_path / "run"
    proc = train(f"hydra.run.dir={run_dir}", *overrides, flags=("-X", "importtime"), timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    report = [line for line in proc.stderr.splitlines() if not line.startswith("import time:")]
    assert report[0] == "error: invalid configuration:" and said in "\n".join(report)
    imported = {line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert {"fedfew.config.rules", "hydra", "omegaconf"} <= imported  # the list is complete...
    assert not {"torch", "lightning"} & imported  # ...and holds neither
    assert not run_dir.exists()


def test_preset_warning_only_once_and_only_after_every_check_passed(tmp_path):
    """A run that changes the setup is told once that its preset was tuned for another one, and
    only when it trains: a run that stops on bad input (here an impossible partition, found while
    loading the data) is told only what stops it."""
    warned = "preset conf/tuned/digits_fedfew.yaml was tuned for another setup ("
    proc = train(f"hydra.run.dir={tmp_path / 'bad'}", "rounds=2", "num_clients=1000", "logger=none",
                 "trainer.threads=1", timeout=120)
    assert proc.returncode == 2 and "error: clustered partition: client 199 has 1 sample(s)" in proc.stderr
    assert warned not in proc.stdout + proc.stderr
    proc = train(f"hydra.run.dir={tmp_path / 'good'}", "rounds=1", "num_clients=4", "logger=none",
                 "trainer.threads=1", timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (proc.stdout + proc.stderr).count(warned) == 1
    note = json.loads((tmp_path / "good" / "results.json").read_text())["preset"]["note"]
    assert note.startswith(warned) and "(num_clients: 20 in the preset, 4 here; rounds: 50 in the preset, 1 here)" in note


def test_continue_command_names_the_running_interpreter(tmp_path, monkeypatch):
    """"continue with: ..." (a stopped run) works without an activated venv: this interpreter."""
    from fedfew.train import _continue_command

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "executable", "/opt/my env/bin/python")
    assert _continue_command(tmp_path / "run") == (
        f"'/opt/my env/bin/python' -m fedfew.train hydra.run.dir={tmp_path / 'run'} resume=auto")


def test_agnews_without_data_fails_fast_and_cleanly(tmp_path):
    run_dir = tmp_path / "run"
    empty = tmp_path / "empty"
    empty.mkdir()
    start = time.perf_counter()
    proc = train("dataset=agnews", f"data_dir={empty}", f"hydra.run.dir={run_dir}", "logger=none",
                 env={"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}, timeout=120)
    elapsed = time.perf_counter() - start
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert str(empty / "ag_news_csv") in proc.stderr and "FEDFEW_DATA_DIR" in proc.stderr
    assert elapsed < 30
    assert not run_dir.exists()  # no half-written run directory


def test_agnews_cut_off_csv_stops_before_training(tmp_path):
    """A test.csv cut inside a quoted field (an interrupted download) used to train on the rows
    that survived and exit 0; now the run stops while loading, names the file and line, and
    leaves no run folder (no metrics.csv)."""
    run_dir = tmp_path / "run"
    csv_dir = tmp_path / "data" / "ag_news_csv"
    csv_dir.mkdir(parents=True)
    (csv_dir / "train.csv").write_text("".join(f'"{1 + i % 4}","title {i}","text {i}"\n' for i in range(40)))
    (csv_dir / "test.csv").write_text('"1","a title","a text"\n"3","Wall St. Bears","Reuters - Short-sel')
    proc = train("dataset=agnews", f"data_dir={tmp_path / 'data'}", "num_clients=4", "trainer.threads=1",
                 f"hydra.run.dir={run_dir}", "logger=none", timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    said = f"error: {csv_dir / 'test.csv'}:2: the file ends inside a quoted field (an unterminated quote)"
    assert said in proc.stderr
    assert not (run_dir / "metrics.csv").exists() and not run_dir.exists()


@pytest.mark.slow
@pytest.mark.realdata("ag_news_csv/train.csv", "ag_news_csv/test.csv")
def test_agnews_real_data_short_run(tmp_path, real_data_dir):
    run_dir = tmp_path / "run"
    proc = train("dataset=agnews", f"data_dir={real_data_dir}", "rounds=1", "num_clients=10", "algorithm.K=2",
                 "model.embed_dim=32", f"hydra.run.dir={run_dir}", "logger=none")
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((run_dir / "results.json").read_text())
    assert sum(c["n_train"] + c["n_test"] for c in results["clients"]) == 9600
    assert len(results["w"]) == 10 and len(results["w"][0]) == 2
    assert 0.25 <= results["summary"]["majority_acc_mean"] <= 1.0
