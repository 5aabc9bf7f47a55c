"""Runs say where they are: readable run folder names, the end-of-run lines, plain progress
lines when not on a terminal, `python -m fedfew.runs`; and one quiet two-process run."""
from __future__ import annotations

import csv
import json
import os
import re
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from fedfew import runs as runs_cli
from fedfew.algorithms.round_log import LOOP_KEYS, Kind
from fedfew.core import run_folders
from fedfew.experiments import run_list
from fedfew.reporting.callbacks import ConsoleReport, print_client_table
from conftest import idle_process


def test_run_suffix_is_short_readable_and_pastable():
    from hydra.core.override_parser.overrides_parser import OverridesParser

    suffix = run_folders.run_suffix(["algorithm.K=5", "partition=pathological", "data_dir=/data/x", "trainer.threads=1",
                              "dataset=agnews", "algorithm=ifca", "logger.tags=[a,b]", "optim.lr=0.05",
                              "+dataset.note=a b/c"])
    assert suffix == "_K-5_partition-pathological_lr-0.05_note-a_b_c"
    assert run_folders.run_suffix([]) == "" and run_folders.run_suffix(["data_dir=/x", "resume=auto"]) == ""
    # too many overrides: the ones that fit, then how many were left out
    many = run_folders.run_suffix([f"optim.key{i}=value{i}" for i in range(10)])
    assert many.endswith("_+6") and len(many) <= run_folders.MAX_SUFFIX + 1
    assert many.startswith("_key0-value0_key1-value1_key2-value2_key3-value3")
    # the folder goes back into hydra.run.dir=... unquoted
    folder = f"outputs/digits/fedfew/2026-01-01_12-00-00{suffix}{many}"
    assert OverridesParser.create().parse_override(f"hydra.run.dir={folder}").value() == folder


def test_setup_folders_keep_setups_apart_and_ignore_what_does_not_change_results(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDFEW_OUTPUT_DIR", str(tmp_path))
    assert run_folders.setup_folder("compare", "digits", []) == tmp_path / "compare" / "digits"
    assert run_folders.setup_folder("tune", "digits", ["partition=pathological", "trainer.threads=1", "data_dir=/d"]) == (
        tmp_path / "tune" / "digits_partition-pathological")
    # a tuned setup with its presets fits whole (up to SETUP_SUFFIX characters, not a run folder's 60)
    both = run_folders.setup_folder("compare", "digits", ["partition=pathological", "presets=digits_partition-pathological"])
    assert both.name == "digits_partition-pathological_presets-digits_partition-pathological"
    # setups whose names are cut (_+N) and differ only in what was cut still get two folders
    long = [f"optim.key{i}=value{i}" for i in range(12)]
    a, b = (run_folders.setup_folder("compare", "digits", [*long, f"optim.lr={lr}"]) for lr in (0.1, 0.2))
    assert a != b and "_+" in a.name and a.name.split("-")[:-1] == b.name.split("-")[:-1]
    assert a == run_folders.setup_folder("compare", "digits", [*long, "optim.lr=0.1", "trainer.threads=1"])
    # what two runs must share to be the same experiment: not threads, logging, the run folder or where
    # the data lies (its content is compared instead: fedfew.data.fingerprint)
    assert run_folders.result_overrides(["algorithm.K=5", "trainer.threads=1", "logger=none", "+logger.tags=[a]",
                                  "hydra.run.dir=/x", "checkpoint_every=5", "data_dir=/d", "+data_dir=/e",
                                  "seed=1"]) == ["algorithm.K=5", "seed=1"]


def test_committed_text_names_no_absolute_path_of_the_machine(tmp_path):
    """Preset headers and compare.md record data_dir as <data_dir>, paths inside the checkout
    relative to it (through its symlinks: src/fedfew/conf is conf) and a folder outside it by its
    name only."""
    inside = run_folders.CHECKOUT / "src" / "fedfew" / "conf" / "tuned" / "agnews_fedfew.yaml"
    assert run_folders.portable_path(inside) == "conf/tuned/agnews_fedfew.yaml"
    assert run_folders.portable_path("results/agnews/compare") == "results/agnews/compare"
    assert run_folders.portable_path(tmp_path / "presets") == "<elsewhere>/presets" and run_folders.portable_path("/") == "<elsewhere>"
    assert run_folders.portable_overrides(["data_dir=/work/shared/data", "+data_dir=/x", "trainer.threads=1",
                                    f"hydra.run.dir={run_folders.CHECKOUT}/outputs/a"]) == [
        "data_dir=<data_dir>", "+data_dir=<data_dir>", "trainer.threads=1", "hydra.run.dir=outputs/a"]
    command = (f"python -m fedfew.compare --out {run_folders.CHECKOUT}/results/agnews/compare --presets {tmp_path}/t/presets "
               "--jobs 2 -- data_dir=/work/shared/data trainer.threads=1 'eval.also=[finetune]'")
    assert run_folders.portable_command(command) == (
        "python -m fedfew.compare --out results/agnews/compare --presets '<elsewhere>/presets' --jobs 2 -- "
        "'data_dir=<data_dir>' trainer.threads=1 'eval.also=[finetune]'")
    assert run_folders.portable_command(["python", "-m", "x", "data_dir=/d"]) == "python -m x 'data_dir=<data_dir>'"


def test_printed_commands_name_the_running_interpreter(tmp_path, monkeypatch):
    """A printed ``python -m fedfew...`` command runs as shown without an activated venv: it names
    the interpreter that runs, relative to the working directory when that is shorter."""
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "executable", str(bin_dir / "python"))
    assert run_folders.python_command("fedfew.reporting.plots") == ".venv/bin/python -m fedfew.reporting.plots"
    monkeypatch.chdir(bin_dir)
    assert run_folders.python_command("fedfew.reporting.plots") == "./python -m fedfew.reporting.plots"  # not a PATH lookup
    monkeypatch.setattr(sys, "executable", "/opt/my env/bin/python3")  # shorter than ../../../../opt/...
    assert run_folders.python_command("fedfew.train") == "'/opt/my env/bin/python3' -m fedfew.train"
    monkeypatch.setattr(sys, "executable", "")  # no interpreter path known (embedded Python)
    assert run_folders.python_command("fedfew.train") == "python -m fedfew.train"


def test_where_lines_name_the_folder_notebook_and_plots(tmp_path, monkeypatch):
    run_dir = tmp_path / "outputs" / "digits" / "fedfew" / "2026-01-01_12-00-00_K-5"
    monkeypatch.chdir(tmp_path)  # not the checkout: the notebook command works from anywhere
    monkeypatch.setattr(sys, "executable", str(tmp_path / ".venv" / "bin" / "python"))
    lines = run_folders.where_lines(run_dir)
    assert lines == ["run folder: outputs/digits/fedfew/2026-01-01_12-00-00_K-5",
                     "  notebook: .venv/bin/python -m fedfew.notebook outputs/digits/fedfew/2026-01-01_12-00-00_K-5   "
                     "(writes analysis.html there)",
                     "  plots:    outputs/digits/fedfew/2026-01-01_12-00-00_K-5/plots   "
                     "(redraw: .venv/bin/python -m fedfew.reporting.plots outputs/digits/fedfew/2026-01-01_12-00-00_K-5)"]
    monkeypatch.chdir(run_folders.CHECKOUT)
    assert run_folders.where_lines(run_dir)[1].startswith(f"  notebook: make notebook RUN={run_dir}")
    stopped = run_folders.where_lines(run_dir, finished=False)
    assert "stopped early" in stopped[0] and len(stopped) == 2 and "notebook" not in " ".join(stopped)


def results(acc=(0.5, 1.0)):
    clients = [{"id": i, "n_train": 3, "n_test": 2, "model": i, "acc": a, "majority_acc": 0.5} for i, a in enumerate(acc)]
    return {"clients": clients, "seconds_per_round": 0.25, "train_seconds_per_round": 0.125, "wall_time_s": 1.0,
            "summary": {"acc_mean": 0.75, "acc_std": 0.25, "acc_min": 0.5, "acc_max": 1.0, "acc_weighted": 0.75,
                        "majority_acc_mean": 0.5, "models_served": [1, 1], "rounds": 4}}


def test_end_of_run_prints_headline_figures_speeds_and_where(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "executable", "/opt/venv/bin/python")
    print_client_table(results(), run_dir=tmp_path / "run")
    out = capsys.readouterr().out.splitlines()
    i = out.index("client-mean acc 0.7500 ± 0.2500 (min 0.5000, max 1.0000); sample-weighted 0.7500; "
                  "majority-label baseline 0.5000")
    assert out[i + 1:i + 5] == [
        "models serving clients: 2 of 2 (clients per model [1, 1])",
        "speed: wall 0.25 s/round (training, evaluation, logging); train 0.12 s/round (local training and aggregation)",
        "run folder: run",
        "  notebook: /opt/venv/bin/python -m fedfew.notebook run   (writes analysis.html there)",
    ]


def test_many_clients_print_the_lowest_accuracies_only(capsys):
    accs = [(7 * i % 50) / 50 for i in range(50)]     # 50 clients, each accuracy once
    print_client_table(results(accs), max_rows=10)
    out = capsys.readouterr().out
    assert "personalized test accuracy: the 5 lowest of 50 clients (every client's: results.json)" in out
    rows = [line.split("│") for line in out.splitlines() if line.count("│") == 7]
    assert [(int(r[1]), float(r[5])) for r in rows] == sorted(((i, a) for i, a in enumerate(accs)), key=lambda x: x[1])[:5]


def fake_sim(rounds: int, run_dir: Path, start_round: int = 1):
    return SimpleNamespace(rank=0, cfg=SimpleNamespace(rounds=rounds),
                           start_round=start_round, run_dir=run_dir,
                           log_keys={**LOOP_KEYS, "g": Kind.SCALAR, "loss": Kind.PER_CLIENT_MODEL})


def test_plain_progress_lines_at_most_every_interval_but_always_evaluations(tmp_path, capsys, monkeypatch):
    clock = iter([0.0, 3.0, 6.0, 9.0, 12.0, 15.0, 18.0])  # fit start, then rounds 1..6 three seconds apart
    report = ConsoleReport(interval_s=10.0, plain=True, clock=lambda: next(clock))
    sim = fake_sim(6, tmp_path)
    report.on_fit_start(sim)
    for rnd in range(1, 7):
        loss = torch.full((2, 2), float(rnd))  # train_loss_mean = round
        logs = {"round": rnd, "round_time_s": 0.5 * rnd, "lr": 0.1, "g": 10.0 - rnd, "loss": loss}
        evaluation = {"summary": {"acc_mean": 0.1 * rnd}} if rnd in (5, 6) else None
        report.on_round_end(sim, rnd, logs, evaluation)
    lines = capsys.readouterr().out.splitlines()
    # round 1 (the first), 5 (an evaluation; 12 s after round 1) and 6 (the last); 2-4 fall inside 10 s
    assert lines == [
        "round 1/6  loss 1.0000  g 9.0000  train 0.50 s/round  wall 3.00 s/round  eta 0:00:15",
        # rounds 2-5: train (1 + 1.5 + 2 + 2.5) / 4 = 1.75 s, wall (15 - 3) / 4 = 3 s; eta 15 s / 5 rounds x 1
        "round 5/6  loss 5.0000  g 5.0000  acc 0.5000  train 1.75 s/round  wall 3.00 s/round  eta 0:00:03",
        "round 6/6  loss 6.0000  g 4.0000  acc 0.6000  train 3.00 s/round  wall 3.00 s/round",
    ]


def test_plain_progress_every_round_when_rounds_are_slow(tmp_path, capsys, monkeypatch):
    clock = iter([0.0, 11.0, 22.0, 33.0])
    report = ConsoleReport(interval_s=10.0, plain=True, clock=lambda: next(clock))
    sim = fake_sim(5, tmp_path, start_round=3)  # resumed at round 3
    report.on_fit_start(sim)
    for rnd in (3, 4, 5):
        report.on_round_end(sim, rnd, {"round": rnd, "round_time_s": 10.0, "lr": 0.1}, None)
    lines = capsys.readouterr().out.splitlines()
    assert [line.split("  ")[0] for line in lines] == ["round 3/5", "round 4/5", "round 5/5"]
    assert lines[0] == "round 3/5  train 10.00 s/round  wall 11.00 s/round  eta 0:00:22"


def make_run(root: Path, name: str, started: float, results_summary: dict | None = None, metrics: list | None = None,
             rounds: int = 4, checkpoint: bool = False, touched: float | None = None) -> Path:
    run = root / name
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "config.yaml").write_text("rounds: ${dataset.rounds}\n")
    (run / "config.yaml").write_text(f"rounds: {rounds}\n")
    if results_summary is not None:
        (run / "results.json").write_text(json.dumps({"summary": results_summary, "wall_time_s": 90.0}))
    if metrics:
        with (run / "metrics.csv").open("w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=["round", "g", "acc_mean", "acc_min"])
            writer.writeheader()
            writer.writerows(metrics)
    if checkpoint:
        (run / "checkpoints").mkdir()
        (run / "checkpoints" / "last.ckpt").write_bytes(b"x")
    for path in [run / ".hydra" / "config.yaml", run / "config.yaml"]:
        os.utime(path, (started, started))
    for path in [p for p in run.rglob("*") if p.is_file() and p.name != "config.yaml"]:
        os.utime(path, (touched or started, touched or started))
    return run


def test_find_runs_newest_first_with_status_and_figures(tmp_path, capsys):
    now = time.time()
    old = now - 3 * 3600
    done = make_run(tmp_path, "digits/fedfew/a", old, results(acc=(0.5, 1.0))["summary"])
    stopped = make_run(tmp_path, "digits/fedfew/b", old + 60, metrics=[{"round": 1, "g": 2.0},
                                                                        {"round": 2, "g": 1.0, "acc_mean": 0.4, "acc_min": 0.1}])
    resumable = make_run(tmp_path, "digits/ifca/c", old + 120, metrics=[{"round": 1, "g": 2.0}], checkpoint=True)
    running = make_run(tmp_path, "agnews/fedfew/d", now - 30, metrics=[{"round": 3, "g": 1.0}], rounds=60, touched=now)
    (done / "plots").mkdir()
    (done / "plots" / "config.yaml").write_text("not a run\n")  # folders inside a run are not runs
    found = run_list.find_runs([tmp_path])
    assert [r.path for r in found] == [running, resumable, stopped, done]
    assert [r.status for r in found] == ["running", "resumable", "interrupted", "done"]
    assert [r.rounds for r in found] == ["3/60", "1/4", "2/4", "4/4"]
    assert found[2].summary == {"acc_mean": 0.4, "acc_min": 0.1}  # the last evaluation so far
    assert found[3].summary["acc_weighted"] == 0.75 and found[3].wall_time_s == 90.0

    assert runs_cli.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if "fedfew/a" in line)
    cells = [c.strip() for c in row.strip("│ ").split("│")]
    assert cells[2:] == ["done", "4/4", "0.7500", "0.5000", "0.7500", "0.5000", "[1, 1]", "1.5 min"]
    assert runs_cli.main([str(tmp_path), "--limit", "1"]) == 0
    assert "3 older run(s) not shown (--all)" in capsys.readouterr().out
    assert runs_cli.main([str(tmp_path / "nothing")]) == 2


def test_status_follows_the_training_process_when_it_is_known(tmp_path):
    import socket
    import subprocess

    now = time.time()
    # an old folder whose process still runs (a long first round): running
    live = make_run(tmp_path, "live", now - 3 * 3600, metrics=[{"round": 1, "g": 1.0}])
    trainer = idle_process("fedfew.train")  # a stand-in
    (live / run_folders.PID_FILE).write_text(f"{socket.gethostname()} {trainer.pid}\n")
    # an old folder whose pid now belongs to another program (the file outlived a crash): interrupted
    reused = make_run(tmp_path, "reused", now - 3 * 3600, metrics=[{"round": 1, "g": 1.0}])
    other = idle_process()
    (reused / run_folders.PID_FILE).write_text(f"{socket.gethostname()} {other.pid}\n")
    os.utime(reused / run_folders.PID_FILE, (now - 3 * 3600, now - 3 * 3600))  # written when that run started
    # a fresh folder whose process is gone (killed a second ago): interrupted, not running
    gone = make_run(tmp_path, "gone", now - 5, metrics=[{"round": 2, "g": 1.0}], touched=now)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (gone / run_folders.PID_FILE).write_text(f"{socket.gethostname()} {dead.pid}\n")
    # a process on another host: the modification time decides (fresh: running)
    elsewhere = make_run(tmp_path, "elsewhere", now - 5, metrics=[{"round": 2, "g": 1.0}], touched=now)
    (elsewhere / run_folders.PID_FILE).write_text("some-other-host 1\n")
    try:
        status = {r.path.name: r.status for r in run_list.find_runs([tmp_path])}
    finally:
        for proc in (trainer, other):
            proc.kill()
            proc.wait()
    assert status == {"live": "running", "reused": "interrupted", "gone": "interrupted", "elsewhere": "running"}
    run_folders.clear_running(live)
    assert run_list.run_info(live).status == "interrupted"


def test_console_report_marks_the_run_while_it_trains(tmp_path, capsys):
    report = ConsoleReport(plain=True)
    sim = fake_sim(1, tmp_path)
    report.on_fit_start(sim)
    assert (tmp_path / run_folders.PID_FILE).read_text().split()[1] == str(os.getpid())
    report.on_round_end(sim, 1, {"round": 1, "round_time_s": 0.1, "lr": 0.1}, None)
    report.on_interrupt(sim, 1)
    assert not (tmp_path / run_folders.PID_FILE).exists()
    assert "stopped early" in capsys.readouterr().out


@pytest.mark.slow
def test_two_process_run_is_quiet_named_and_says_where_it_is(tmp_path):
    """devices=2 with an `srun` on PATH (as on a Slurm login node): no srun warning, one set of
    Lightning banners, a run folder named after the overrides, plain progress lines, the
    folder at the end, and `python -m fedfew.runs` listing it with its figures."""
    import subprocess

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "srun").chmod(0o755)
    out_root = tmp_path / "outputs"
    full_env = {**{k: v for k, v in os.environ.items() if not k.startswith("SLURM_")},  # not in an allocation
                "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "FEDFEW_OUTPUT_DIR": str(out_root)}
    proc = subprocess.run([sys.executable, "-m", "fedfew.train", "rounds=2", "num_clients=6", "partition=iid",
                           "eval_every=1", "trainer.devices=2", "trainer.strategy=ddp", "trainer.accelerator=cpu",
                           "trainer.threads=1", "logger=none"],
                          cwd=run_folders.CHECKOUT, env={**full_env, "WANDB_MODE": "disabled"}, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = proc.stdout + proc.stderr
    assert "srun" not in text
    assert text.count("Initializing distributed") == 1 and text.count("All distributed processes registered") == 1
    (run_dir,) = (out_root / "digits" / "fedfew").iterdir()
    # trainer.threads and logger are left out of names; devices, strategy, accelerator do not fit in 60 characters
    assert re.fullmatch(r"\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d_rounds-2_num_clients-6_partition-iid_eval_every-1_\+3",
                        run_dir.name), run_dir.name
    summary = json.loads((run_dir / "results.json").read_text())["summary"]
    assert not (run_dir / run_folders.PID_FILE).exists()  # removed at the end: listed as done
    progress = [line for line in proc.stdout.splitlines() if line.startswith("round ")]
    assert len(progress) == 2 and all(" s/round  wall " in line and "  train " in line for line in progress)
    assert progress[1].startswith("round 2/2  loss ") and f"acc {summary['acc_mean']:.4f}" in progress[1]
    assert f"run folder: {run_dir}" in proc.stdout and f"make notebook RUN={run_dir}" in proc.stdout
    listing = subprocess.run([sys.executable, "-m", "fedfew.runs", str(out_root)], capture_output=True, text=True,
                             timeout=60)
    assert listing.returncode == 0 and run_dir.name in listing.stdout
    assert f"{summary['acc_mean']:.4f}" in listing.stdout and "done" in listing.stdout
