"""Safe resume: a checkpoint stores its resolved config and a resume refuses any difference in a
key that changes results (naming each with both values); ``rounds`` grows only with
``resume_extend_rounds=true``; logs/metrics.csv keeps its earlier rows; Ctrl-C checkpoints like
SIGTERM and ends with one line."""
from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import compose_config
from fedfew.core.checkpoint import ADDED_KEYS, RESUME_FREE_KEYS, ResumeError, check_resume_config, checkpoint_path, resolve_resume
from fedfew.reporting.loggers import RoundCSVLogger
from fedfew.simulator.simulation import Simulation
from fedfew.experiments.training import preflight
from test_train_cli import ROOT, train

SMALL = ("num_clients=4", "partition=iid", "logger=none", "trainer.threads=1")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A real checkpoint after one round of a small digits run (rounds=3, mu=0.2); read-only."""
    from lightning.fabric import Fabric

    run_dir = tmp_path_factory.mktemp("run")
    cfg = compose_config(*SMALL, "rounds=3", "algorithm.mu=0.2")
    sim = Simulation(cfg, Fabric(accelerator="cpu", devices=1), run_dir)
    sim.history.append(sim.run_round(1))
    sim.save_checkpoint(1)
    return run_dir, torch.load(checkpoint_path(run_dir), weights_only=False)


def test_checkpoint_stores_the_resolved_config(checkpoint):
    _, state = checkpoint
    assert state["config"]["algorithm"]["mu"] == 0.2 and state["config"]["rounds"] == 3
    assert state["config"]["num_clients"] == 4 and state["round"] == 1
    assert isinstance(state["config"]["optim"]["lr"], float)  # resolved, not "${dataset.lr}"


def test_changed_mu_is_refused_naming_the_key_and_both_values(checkpoint, cpu_fabric, tmp_path):
    run_dir, state = checkpoint
    cfg = compose_config(*SMALL, "rounds=3", "algorithm.mu=0.5", "seed=3", "resume=auto")
    with pytest.raises(ResumeError) as err:
        preflight(cfg, run_dir)  # what `python -m fedfew.train` runs before loading data
    msg = str(err.value)
    assert "  algorithm.mu: checkpoint 0.2, now 0.5\n" in msg and "  seed: checkpoint 0, now 3\n" in msg
    assert str(checkpoint_path(run_dir)) in msg
    assert "rounds" not in msg.split("Keys a resume may change")[0]  # only the differing keys
    sim = Simulation(cfg, cpu_fabric, tmp_path)  # the Simulation API refuses as well
    with pytest.raises(ResumeError, match="algorithm.mu: checkpoint 0.2, now 0.5"):
        sim.load_state_dict(state)


def test_keys_that_do_not_change_results_may_differ(checkpoint):
    run_dir, state = checkpoint
    cfg = compose_config(*SMALL[:-2], "rounds=3", "algorithm.mu=0.2", "resume=auto", "logger=csv",
                         "trainer.threads=2", "checkpoint_every=5", "save_models=true", "data_dir=/elsewhere",
                         "trainer.devices=2", "trainer.strategy=ddp", "dataset.rounds=99")
    checked = preflight(cfg, run_dir)
    assert checked.resume_from == checkpoint_path(run_dir) and checked.state["round"] == 1 and checked.note is None
    assert {"logger", "trainer.threads", "checkpoint_every", "data_dir", "trainer.devices"} <= set(RESUME_FREE_KEYS)


def test_rounds_extend_only_with_the_explicit_key(checkpoint):
    run_dir, state = checkpoint
    with pytest.raises(ResumeError) as err:
        check_resume_config(state, compose_config(*SMALL, "rounds=10", "algorithm.mu=0.2"))
    assert "rounds: checkpoint 3, now 10 (to run more rounds than the checkpoint's run, add resume_extend_rounds=true)" \
        in str(err.value)
    note = check_resume_config(state, compose_config(*SMALL, "rounds=10", "algorithm.mu=0.2", "resume_extend_rounds=true"))
    assert note == "resume: rounds extended from 3 to 10 (resume_extend_rounds=true); the checkpoint is at round 1"
    with pytest.raises(ResumeError, match=r"rounds: checkpoint 3, now 2 \(resume_extend_rounds=true only extends: use rounds >= 3\)"):
        check_resume_config(state, compose_config(*SMALL, "rounds=2", "algorithm.mu=0.2", "resume_extend_rounds=true"))
    cosine = dict(state, config={**state["config"], "optim": {**state["config"]["optim"], "schedule": "cosine"}})
    note = check_resume_config(cosine, compose_config(*SMALL, "rounds=10", "algorithm.mu=0.2", "optim.schedule=cosine",
                                                      "resume_extend_rounds=true"))
    assert note.endswith("optim.schedule=cosine now anneals over the new number of rounds")


@pytest.mark.parametrize("section,key,other,shown", [("eval", "also", "eval.also=[finetune]", r"\[\], now \['finetune'\]"),
                                                      ("optim", "clip_norm", "optim.clip_norm=1.0", r"null, now 1.0")])
def test_a_checkpoint_from_before_an_added_key_resumes_under_its_old_behaviour(checkpoint, section, key, other, shown):
    """eval.also and optim.clip_norm came after checkpoints existed: one without the key counts as
    its ADDED_KEYS value (what fedfew did then), so it resumes under the default and is refused
    under another value."""
    run_dir, state = checkpoint
    older = dict(state, config={**state["config"], section: {k: v for k, v in state["config"][section].items()
                                                             if k != key}})
    assert key not in older["config"][section] and ADDED_KEYS == {"eval.also": [], "optim.clip_norm": None}
    assert check_resume_config(older, compose_config(*SMALL, "rounds=3", "algorithm.mu=0.2")) is None
    with pytest.raises(ResumeError, match=rf"{section}.{key}: checkpoint {shown}"):
        check_resume_config(older, compose_config(*SMALL, "rounds=3", "algorithm.mu=0.2", other))


def test_checkpoint_without_config_and_auto_without_checkpoint_are_refused(checkpoint, tmp_path):
    run_dir, state = checkpoint
    legacy = {k: v for k, v in state.items() if k != "config"}
    with pytest.raises(ResumeError, match="stores no config"):
        check_resume_config(legacy, compose_config(*SMALL, "rounds=3"))
    done = tmp_path / "finished"
    done.mkdir()
    (done / "results.json").write_text("{}")
    with pytest.raises(ResumeError, match=r"holds a run \(results.json\) but no checkpoint"):
        resolve_resume("auto", done)
    assert resolve_resume("auto", tmp_path / "empty") is None  # a new run folder: fresh start


def _steps(path: Path) -> list[int]:
    return [int(float(r["step"])) for r in csv.DictReader(path.open())]


def test_csv_logger_keeps_rows_before_the_resumed_round(tmp_path):
    first = RoundCSVLogger(save_dir=str(tmp_path), name="logs", version="")
    first.start_at(1)
    for step in (1, 2, 3, 4):
        first.log_metrics({"acc": step / 10, "loss": 1.0 / step}, step=step)
    first.save()
    path = tmp_path / "logs" / "metrics.csv"
    assert _steps(path) == [1, 2, 3, 4]
    resumed = RoundCSVLogger(save_dir=str(tmp_path), name="logs", version="")  # Lightning's would delete the file here
    assert path.exists() and resumed.start_at(3) == 2  # rounds 3, 4 run again after a checkpoint at round 2
    resumed.log_metrics({"acc": 0.33, "loss": 0.5, "new_column": 7.0}, step=3)
    resumed.log_metrics({"acc": 0.44, "loss": 0.25}, step=4)
    resumed.save()
    rows = list(csv.DictReader(path.open()))
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4]
    assert [float(r["acc"]) for r in rows] == [0.1, 0.2, 0.33, 0.44]
    assert [r["new_column"] for r in rows] == ["", "", "7.0", ""]
    fresh = RoundCSVLogger(save_dir=str(tmp_path), name="logs", version="")
    assert fresh.start_at(1) == 0 and not path.exists()  # a new run in the same folder starts a new file


def _wait_rows(path: Path, rows: int, child: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if path.exists() and len(path.read_text().splitlines()) >= rows + 1:
            return
        assert child.poll() is None, child.communicate()[1][-2000:]
        time.sleep(0.02)
    child.kill()
    pytest.fail(f"{path} did not reach {rows} rows")


@pytest.mark.slow
def test_ctrl_c_checkpoints_then_resume_checks_config_and_appends_logs(tmp_path):
    common = ["rounds=8", "num_clients=4", "partition=iid", "local_epochs=5", "trainer.threads=1", "logger=csv",
              "eval_every=2", "algorithm.mu=0.2"]
    run_dir = tmp_path / "run"
    child = subprocess.Popen([sys.executable, "-m", "fedfew.train", f"hydra.run.dir={run_dir}", *common], cwd=ROOT,
                             env={**os.environ, "WANDB_MODE": "disabled"}, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    _wait_rows(run_dir / "metrics.csv", 2, child)
    child.send_signal(signal.SIGINT)  # Ctrl-C
    _, err = child.communicate(timeout=300)
    assert child.returncode == 128 + signal.SIGINT, err[-2000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-2000:]
    stopped = torch.load(checkpoint_path(run_dir), weights_only=False)["round"]
    assert 2 <= stopped < 8 and not (run_dir / "results.json").exists()
    last = [line for line in err.strip().splitlines() if line.strip()][-1]
    assert last.startswith(f"stopped by SIGINT after round {stopped}; checkpoint {checkpoint_path(run_dir)}; continue with: ")
    assert last.endswith(f"hydra.run.dir={run_dir} resume=auto") and "rounds=8" in last
    assert _steps(run_dir / "logs" / "metrics.csv") == list(range(1, stopped + 1))

    changed = train(f"hydra.run.dir={run_dir}", *common[:-1], "algorithm.mu=0.5", "resume=auto")
    assert changed.returncode == 2 and "algorithm.mu: checkpoint 0.2, now 0.5" in changed.stderr, changed.stderr[-2000:]
    assert not (run_dir / "results.json").exists()  # nothing ran

    proc = train(f"hydra.run.dir={run_dir}", *[c for c in common if c != "rounds=8"], "rounds=10", "resume=auto",
                 "resume_extend_rounds=true")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"resumed from {checkpoint_path(run_dir)} at round {stopped + 1}" in proc.stdout
    assert "resume: rounds extended from 8 to 10 (resume_extend_rounds=true)" in proc.stdout
    results = json.loads((run_dir / "results.json").read_text())
    assert results["summary"]["rounds"] == 10 and results["config"]["rounds"] == 10
    steps = _steps(run_dir / "logs" / "metrics.csv")
    assert [s for s in steps if s <= stopped] == list(range(1, stopped + 1))  # the earlier rows are still there
    assert sorted(set(steps)) == list(range(1, 11)) and steps.count(10) == 2  # round 10 and its final/ row
    assert [int(r["round"]) for r in csv.DictReader((run_dir / "metrics.csv").open())] == list(range(1, 11))
