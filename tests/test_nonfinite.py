"""Divergence is an outcome (fedfew.core.nonfinite): a fully diverged run stops early with its exit code
and a verdict; non-finite clients and local copies are recorded once, with their rounds; a
non-finite personal state stops a run under fail_on_nonfinite."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from fedfew.core.nonfinite import DIVERGED_EXIT, DIVERGED_ROUNDS, NonFiniteLog, describe
from fedfew.simulator.simulation import Simulation

from conftest import compose_config


def test_reports_are_recorded_per_client_with_their_rounds_and_described_in_one_line():
    log = NonFiniteLog()
    for rnd, reports in [(1, []), (2, [(3, "local copy of model 2")]), (3, [(3, "local copy of model 2"),
                                                                         (3, "local copy of model 0")]),
                         (4, []), (5, [(3, "local copy of model 2"), (7, "personal state 'head'")])]:
        log.begin_round(rnd)
        for cid, what in reports:
            log.report(cid, what)
        assert not log.end_round([3, 7, 9], log.reported_this_round())
    record = log.as_dict()
    assert record == {
        "clients": {"3": {"first_round": 2, "last_round": 5, "rounds": 3,
                          "what": ["local copy of model 2", "local copy of model 0"]},
                    "7": {"first_round": 5, "last_round": 5, "rounds": 1, "what": ["personal state 'head'"]}},
        "diverged_rounds": [], "stopped_at": None, "verdict": "nonfinite"}
    assert describe(record, 10) == (
        "non-finite in 2 client(s), left out of those rounds' aggregation: client 3: local copies of models 0, 2, "
        "rounds 2-5 (3 rounds); client 7: personal state 'head', round 5 (1 round). A lower optim.lr or an "
        "optim.clip_norm usually cures it")
    assert describe(NonFiniteLog().as_dict(), 10) is None


def test_the_run_diverges_after_enough_rounds_in_a_row_where_every_participant_was_non_finite():
    log = NonFiniteLog()
    participants = [0, 1]
    # all, all, one finite (streak reset), then all x DIVERGED_ROUNDS
    pattern = [{0, 1}, {0, 1}, {0}] + [{0, 1}] * DIVERGED_ROUNDS
    stopped = []
    for rnd, reported in enumerate(pattern, start=1):
        log.begin_round(rnd)
        stopped.append(log.end_round(participants, reported))
    assert stopped == [False] * (len(pattern) - 1) + [True]
    assert log.stopped_at == len(pattern) and log.verdict == "diverged"
    assert log.diverged_rounds == [1, 2, 4, 5, 6]
    restored = NonFiniteLog()
    restored.load_state_dict(log.state_dict())  # a checkpoint keeps the streak and the records
    assert restored.state_dict() == log.state_dict()


def test_fail_on_nonfinite_stops_at_the_first_report_naming_round_client_and_what():
    log = NonFiniteLog(fatal=True)
    log.begin_round(4)
    with pytest.raises(FloatingPointError, match=r"round 4: client 2: non-finite local model \(fail_on_nonfinite=true"):
        log.report(2, "local model")


@pytest.mark.parametrize("fatal", [False, True])
def test_a_non_finite_personal_state_is_reported_when_it_is_saved(tmp_path, cpu_fabric, fatal):
    cfg = compose_config("algorithm=ditto", "num_clients=4", "logger=none", f"fail_on_nonfinite={str(fatal).lower()}")
    sim = Simulation(cfg, cpu_fabric, tmp_path)
    sim.nonfinite.begin_round(7)
    state = torch.ones(5)
    state[2] = float("nan")
    if fatal:
        with pytest.raises(FloatingPointError, match=r"round 7: client 1: non-finite personal state 'personal'"):
            sim.algorithm.save_client(1, personal=state)
        return
    sim.algorithm.save_client(1, personal=state)
    sim.algorithm.save_client(2, personal=torch.ones(5))
    assert sim.nonfinite.as_dict()["clients"] == {
        "1": {"first_round": 7, "last_round": 7, "rounds": 1, "what": ["personal state 'personal'"]}}
    assert torch.isnan(sim.ctx.host_state[1]["personal"][2])  # kept as it is: the client is scored with it


@pytest.mark.slow
def test_a_fully_diverged_run_stops_early_with_its_exit_code_and_a_verdict(tmp_path):
    """optim.lr=1e8 on digits: every client's update is non-finite from round 2; the run stops
    after DIVERGED_ROUNDS such rounds, exits DIVERGED_EXIT, says DIVERGED before any figure and
    prints no warning per round; results.json's summary carries the verdict."""
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "fedfew.train", "optim.lr=1e8", "logger=none", "~tuned",
                           "trainer.threads=1", f"hydra.run.dir={run_dir}"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == DIVERGED_EXIT, proc.stderr[-2000:]
    out = proc.stdout + proc.stderr
    assert "UserWarning" not in out and "non-finite local model" not in out
    assert out.index("DIVERGED: every participant was non-finite in rounds [2, 3, 4]") < out.index("client-mean acc")
    assert "error: the run diverged" in proc.stderr
    results = json.loads((run_dir / "results.json").read_text())
    assert results["summary"]["verdict"] == "diverged"
    assert results["summary"]["rounds_trained"] == 1 + DIVERGED_ROUNDS < results["summary"]["rounds"] == 50
    assert results["nonfinite"]["stopped_at"] == 4 and len(results["nonfinite"]["clients"]) == 20
    assert len((run_dir / "metrics.csv").read_text().strip().splitlines()) == 1 + 4  # header + 4 rounds
