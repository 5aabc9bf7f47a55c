"""Sharding clients over processes (Fabric, CPU, gloo) gives the 1-process result."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from test_train_cli import train


def run(tmp_path: Path, name: str, *overrides: str) -> tuple[dict, list]:
    run_dir = tmp_path / name
    proc = train(f"hydra.run.dir={run_dir}", "save_models=true", "logger=none", "trainer.accelerator=cpu",
                 "trainer.threads=1", *overrides, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((run_dir / "results.json").read_text())
    models = torch.load(run_dir / "models.pt")
    return results, models


def assert_same_run(a: tuple[dict, list], b: tuple[dict, list], tol: float = 1e-5) -> None:
    ra, ma = a
    rb, mb = b
    for key in ("loss", "alpha", "w"):
        torch.testing.assert_close(torch.tensor(ra[key]), torch.tensor(rb[key]), rtol=tol, atol=tol)
    assert [c["model"] for c in ra["clients"]] == [c["model"] for c in rb["clients"]]
    assert [c["acc"] for c in ra["clients"]] == pytest.approx([c["acc"] for c in rb["clients"]], abs=1e-9)
    assert ra["partition_hash"] == rb["partition_hash"]
    for sa, sb in zip(ma, mb):
        for name in sa:
            torch.testing.assert_close(sa[name], sb[name], rtol=tol, atol=tol)


@pytest.mark.slow
def test_two_processes_equal_one(tmp_path):
    common = ("rounds=2", "num_clients=8", "eval_every=1")
    one = run(tmp_path, "one", *common)
    two = run(tmp_path, "two", *common, "trainer.devices=2", "trainer.strategy=ddp")
    assert two[0]["world_size"] == 2 and one[0]["world_size"] == 1
    assert_same_run(one, two)


@pytest.mark.slow
def test_fewer_clients_than_processes_does_not_hang(tmp_path):
    common = ("rounds=2", "num_clients=3", "partition=iid", "eval_every=1")
    one = run(tmp_path, "one", *common)
    four = run(tmp_path, "four", *common, "trainer.devices=4", "trainer.strategy=ddp")
    assert four[0]["world_size"] == 4
    assert_same_run(one, four)


@pytest.mark.slow
def test_checkpoint_holds_every_ranks_client_state(tmp_path):
    """Ditto keeps a personal model per client on the host of the rank that owns the client;
    the devices=2 checkpoint (written by rank 0) holds all M clients' personal models, equal
    to the 1-process checkpoint's."""
    common = ("rounds=2", "num_clients=6", "algorithm=ditto", "checkpoint_every=2")
    run(tmp_path, "one", *common)
    run(tmp_path, "two", *common, "trainer.devices=2", "trainer.strategy=ddp")
    one = torch.load(tmp_path / "one" / "checkpoints" / "last.ckpt", weights_only=False)
    two = torch.load(tmp_path / "two" / "checkpoints" / "last.ckpt", weights_only=False)
    assert sorted(two["host_state"]) == sorted(one["host_state"]) == list(range(6))
    for cid in range(6):
        torch.testing.assert_close(two["host_state"][cid]["personal"], one["host_state"][cid]["personal"],
                                   rtol=1e-5, atol=1e-5)
