"""Two tools never write into one folder at once (fedfew.experiments.launch.exclusive, check_not_training)."""
from __future__ import annotations

import signal
import socket
import subprocess
import sys
import textwrap

import pytest

from fedfew import compare, tune
from fedfew.experiments import comparison
from fedfew.core import run_folders
from fedfew.experiments.launch import FAILED_RESULTS, LOCK_FILE, Busy, exclusive, launch, outcome, progress
from fedfew.experiments.tune_errors import TuneError

from conftest import idle_process
from test_tune import FAKE_TRAIN

HOLDER = textwrap.dedent('''
    import sys, time
    from fedfew.experiments.launch import exclusive
    with exclusive(sys.argv[1], "make compare"):
        print("held", flush=True)
        time.sleep(120)
''')


@pytest.fixture
def sleeper():
    """A live process that is not ours (stands in for a training run left behind: its command
    line names fedfew)."""
    proc = idle_process("fedfew.train")
    yield proc
    proc.kill()
    proc.wait()


def test_a_folder_in_use_by_another_tool_is_refused_until_its_holder_ends(tmp_path):
    out = tmp_path / "out"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert f"make compare (host {socket.gethostname()}, pid {holder.pid}, since " in (out / LOCK_FILE).read_text()
        with pytest.raises(Busy, match=rf"in use by make compare \(host .*pid {holder.pid}.*use another output folder"):
            with exclusive(out, "make tune"):
                pass
        # both tools refuse before training anything or opening a study
        with pytest.raises(Busy, match="in use by make compare"):
            compare.main(["--dataset", "digits", "--algorithms", "fedavg", "--seeds", "0", "--out", str(out),
                          "--", "rounds=1", "num_clients=4"])
        with pytest.raises(Busy, match="in use by make compare"):
            tune.main(["--dataset", "digits", "--algorithms", "fedavg", "--trials", "1", "--out", str(out),
                       "--install", "no", "--", "num_clients=4", "rounds=1"], command=["false"])
        assert sorted(p.name for p in out.iterdir()) == [LOCK_FILE]
    finally:
        holder.send_signal(signal.SIGKILL)  # even a killed holder releases the lock
        holder.wait()
    with exclusive(out, "make tune"):
        assert (out / LOCK_FILE).read_text().startswith("make tune (host ")
    with exclusive(out, "make tune"):  # and a leftover file locks nothing
        pass


def test_a_run_folder_that_a_live_process_trains_is_left_alone(tmp_path, sleeper, monkeypatch):
    run_dir = tmp_path / "fedavg" / "seed0"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "checkpoints" / "last.ckpt").write_text("stand-in")
    (run_dir / run_folders.PID_FILE).write_text(f"{socket.gethostname()} {sleeper.pid}\n")
    log = tmp_path / "run.log"
    with pytest.raises(Busy, match=rf"being trained by process {sleeper.pid} .*kill {sleeper.pid}"):
        launch(["hydra.run.dir=" + str(run_dir)], run_dir, log, ["true"])
    assert not log.exists()
    # compare says so before any run starts
    run = comparison.Run("fedavg", 0, tmp_path, (), "digits", (), "")
    assert run.dir == run_dir
    with pytest.raises(Busy, match=f"being trained by process {sleeper.pid}"):
        comparison.check_reusable(run)
    # the tune neither removes nor trains into it (the folder of the defaults run here)
    out = tmp_path / "tune"
    busy = out / "fedavg" / "defaults" / "seed0"
    busy.mkdir(parents=True)
    (busy / "stand-in").write_text("x")
    (busy / run_folders.PID_FILE).write_text(f"{socket.gethostname()} {sleeper.pid}\n")
    fake = tmp_path / "fake_train.py"
    fake.write_text(FAKE_TRAIN)
    monkeypatch.setenv("FAKE_LOG", str(tmp_path / "invocations.log"))
    with pytest.raises(TuneError, match=f"(?s)fedavg defaults \\(seed 0\\): .*being trained by process {sleeper.pid}"):
        tune.main(["--dataset", "digits", "--algorithms", "fedavg", "--trials", "1", "--out", str(out),
                   "--install", "no", "--", "num_clients=4", "rounds=1"], command=[sys.executable, str(fake)])
    assert (busy / "stand-in").read_text() == "x"
    assert str(busy) not in (tmp_path / "invocations.log").read_text()  # the sampled trial ran, this one not
    # a pid that the system gave to another program since (the file outlived a crash) is not a trainer
    other = idle_process()
    try:
        (run_dir / run_folders.PID_FILE).write_text(f"{socket.gethostname()} {other.pid}\n")
        assert run_folders.live_trainer(run_dir) is None and comparison.check_reusable(run) == "checkpoint"
    finally:
        other.kill()
        other.wait()
    (run_dir / run_folders.PID_FILE).write_text(f"{socket.gethostname()} {sleeper.pid}\n")
    # once that process has ended, the folder is free again
    sleeper.kill()
    sleeper.wait()
    assert run_folders.live_trainer(run_dir) is None
    assert comparison.check_reusable(run) == "checkpoint"


def test_a_run_that_fails_after_writing_its_results_is_failed_on_every_invocation(tmp_path):
    """Its results.json is moved aside, so a rerun does not reuse as finished what the first
    invocation left out as failed."""
    run_dir = tmp_path / "fedavg" / "seed0"
    script = ("import json, pathlib, sys; d = pathlib.Path(sys.argv[1].split('=', 1)[1]); d.mkdir(parents=True, exist_ok=True); "
              "(d / 'results.json').write_text(json.dumps({'summary': {'acc_mean': 0.5}})); "
              "sys.exit(next((int(a[5:]) for a in sys.argv if a.startswith('exit=')), 1))")
    overrides = [f"hydra.run.dir={run_dir}"]
    code, *_ = launch(overrides, run_dir, tmp_path / "run.log", [sys.executable, "-c", script])
    assert code == 1 and outcome(code, run_dir) == "failed"
    assert not (run_dir / "results.json").exists()
    assert (run_dir / FAILED_RESULTS).read_text() == '{"summary": {"acc_mean": 0.5}}'
    assert progress(run_dir, overrides) == "none"
    # the rerun that succeeds keeps its results, and the failed attempt's file goes
    code, *_ = launch([*overrides, "exit=0"], run_dir, tmp_path / "run.log", [sys.executable, "-c", script])
    assert code == 0 and outcome(code, run_dir) == "done" and progress(run_dir, [*overrides, "exit=0"]) == "done"
    assert not (run_dir / FAILED_RESULTS).exists()
