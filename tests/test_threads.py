"""trainer.threads: one mechanism (fedfew.core.threads) for every path that trains clients.

The simulator's fit and the Flower client's train/evaluate run at the config's thread count and
give the caller's count back; a bad value is refused before any data is read. A thread count that
differed between the two paths made their results differ at float rounding on an AMD EPYC
(2026-12-07), which the bitwise comparison in test_flower.py caught."""
from __future__ import annotations

import contextlib
import io

import pytest
import torch
from omegaconf import OmegaConf

from conftest import compose_config
from fedfew.core.threads import apply_threads, run_threads, wanted_threads

SETUP = ("dataset=digits", "num_clients=4", "rounds=1", "algorithm=fedavg", "logger=none", "trainer.accelerator=cpu",
         "partition=iid")


@pytest.fixture
def caller_threads():
    """The test's process at 2 torch threads, the count restored after whatever the test does."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield 2
    torch.set_num_threads(before)


@pytest.fixture
def seen_threads(monkeypatch):
    """torch's thread count at every client_update of FedAvg, in call order."""
    from fedfew.algorithms.fedavg import FedAvg

    seen: list[int] = []
    update = FedAvg.client_update

    def recording(self, client, rnd):
        seen.append(torch.get_num_threads())
        return update(self, client, rnd)

    monkeypatch.setattr(FedAvg, "client_update", recording)
    return seen


def _cfg(threads: object):
    return OmegaConf.create({"trainer": {"threads": threads}})


def test_run_threads_sets_and_restores(caller_threads):
    with run_threads(_cfg(1)):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == caller_threads
    with run_threads(_cfg(None)):  # null: torch's default, left as the caller had it
        assert torch.get_num_threads() == caller_threads
    with pytest.raises(RuntimeError), run_threads(_cfg(1)):
        raise RuntimeError("a failing body")
    assert torch.get_num_threads() == caller_threads  # restored on errors too
    assert apply_threads(_cfg(1)) == caller_threads and torch.get_num_threads() == 1  # the process's from here on


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "two"])
def test_bad_thread_counts_are_refused(bad):
    from fedfew.config.rules import ConfigError, validate_config

    with pytest.raises(ValueError, match=r"trainer\.threads="):
        wanted_threads(_cfg(bad))
    cfg = compose_config(*SETUP)
    cfg.trainer.threads = bad
    with pytest.raises(ConfigError, match=r"trainer\.threads="):
        validate_config(cfg)


def test_simulation_trains_at_the_configs_threads(tmp_path, cpu_fabric, caller_threads, seen_threads):
    from fedfew.simulator.simulation import Simulation

    cfg = compose_config(*SETUP, "trainer.threads=1")
    with contextlib.redirect_stdout(io.StringIO()):
        Simulation(cfg, cpu_fabric, tmp_path).fit()
    assert seen_threads == [1] * 4  # every client of the round, at the config's count
    assert torch.get_num_threads() == caller_threads  # the caller's count back


def test_flower_client_trains_at_the_configs_threads(tmp_path, caller_threads, seen_threads):
    from fedfew.flower.client import app
    from fedfew.flower.serve import serve
    from fedfew.flower.server import LocalTransport

    cfg = compose_config(*SETUP, "trainer.threads=1")
    nodes = {100 + i: {"partition-id": i, "num-partitions": 4} for i in range(4)}
    with contextlib.redirect_stdout(io.StringIO()):
        serve(LocalTransport(app, nodes), cfg, tmp_path, engine="local")
    assert seen_threads == [1] * 4
    assert torch.get_num_threads() == caller_threads
