"""PartitionReport: partition.json, partition.png, the terminal table and W&B logging."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image
from rich.console import Console

from conftest import compose_config
from fedfew.data.federated import build_federated_data, partition_seed
from fedfew.data.partition import partition_summary
from fedfew.reporting.partition_report import PartitionReport, partition_title

ROOT = Path(__file__).resolve().parents[1]


def _sim(*overrides: str, rank: int = 0, loggers=()):
    cfg = compose_config("dataset=digits", *overrides)
    data = build_federated_data(cfg)
    return SimpleNamespace(cfg=cfg, host_data=data, rank=rank, loggers=list(loggers))  # as a RunView has them


def _run(sim, run_dir: Path) -> str:
    buf = io.StringIO()
    report = PartitionReport(run_dir, console=Console(file=buf, width=120))
    report.on_fit_start(sim)
    report.on_fit_end(sim, results={})  # the heatmap is drawn beside round 1; fit end waits for it
    return buf.getvalue()


def test_title_names_the_keys_that_shaped_the_partition():
    def title(name, **keys):
        part = {"name": name, "alpha": 0.3, "classes_per_client": 2, "groups": 4, "group_transform": "rotate",
                "group_data": "split", "within": "iid", **keys}
        return partition_title({"dataset": "digits", "partition": part, "num_clients": 8})

    assert title("iid") == "partition: digits, iid, 8 clients"
    assert title("dirichlet") == "partition: digits, dirichlet (alpha=0.3), 8 clients"
    assert title("pathological") == "partition: digits, pathological (classes_per_client=2), 8 clients"
    assert title("clustered", within="pathological", group_transform="permute_labels", group_data="replicate") == (
        "partition: digits, clustered (4 groups, permute_labels, replicate; within pathological "
        "(classes_per_client=2)), 8 clients")


def test_json_png_and_table(tmp_path):
    sim = _sim("num_clients=5", "partition=dirichlet", "seed=3")
    out = _run(sim, tmp_path)
    report = json.loads((tmp_path / "partition.json").read_text())
    data = sim.host_data
    expected = partition_summary(data.clients, data.targets.numpy(), 10)
    assert {k: report[k] for k in expected} == expected
    assert report["dataset"] == "digits" and report["partition"]["name"] == "dirichlet"
    assert report["partition"]["alpha"] == 0.5 and report["partition_seed"] == partition_seed(sim.cfg)
    assert report["partition_hash"] == data.partition_hash and len(report["partition_hash"]) == 64
    assert report["totals"]["n_samples"] == 1797 and report["totals"]["n_unassigned"] == 0
    for c, split in zip(report["clients"], data.clients):
        assert (c["n_train"], c["n_test"]) == (len(split.train), len(split.test))
        assert c["label_counts"] == np.bincount(data.targets.numpy()[np.r_[split.train, split.test]], minlength=10).tolist()
    with Image.open(tmp_path / "partition.png") as png:
        assert png.format == "PNG" and png.size[0] >= 600 and png.size[1] >= 400
    assert "partition: digits, dirichlet (alpha=0.5), 5 clients" in out
    assert f"partition hash {data.partition_hash[:12]}" in out and "1797 samples:" in out
    lines = [ln for ln in out.splitlines() if ln.startswith("│")]
    assert len(lines) == 5 and lines[0].split("│")[1].strip() == "0"
    c0 = report["clients"][0]
    assert lines[0].split("│")[2].strip() == str(c0["n_train"]) and lines[0].split("│")[3].strip() == str(c0["n_test"])
    top = int(np.argmax(c0["label_counts"]))
    assert lines[0].split("│")[5].split()[0] == f"{top}:{c0['label_counts'][top]}"
    assert not list(tmp_path.glob(".*.tmp"))  # atomic writes leave no temporary file


def test_only_rank_zero_writes(tmp_path):
    assert _run(_sim("num_clients=4", "partition=iid", rank=1), tmp_path) == ""
    assert not list(tmp_path.iterdir())


def test_many_clients_compact_and_unassigned(tmp_path):
    sim = _sim("num_clients=60", "partition=iid")
    out = _run(sim, tmp_path)
    rows = [ln.split("│")[1].strip() for ln in out.splitlines() if ln.startswith("│")]
    assert rows == [str(i) for i in range(15)] + ["..."] + [str(i) for i in range(55, 60)]
    assert (tmp_path / "partition.png").stat().st_size > 0
    # pathological with fewer label slots than classes leaves samples unassigned: reported
    sim = _sim("num_clients=4", "partition=pathological", "partition.classes_per_client=1")
    out = _run(sim, tmp_path / "patho")
    report = json.loads((tmp_path / "patho" / "partition.json").read_text())
    unassigned = report["totals"]["n_unassigned"]
    assert unassigned == 1797 - sum(c["n_train"] + c["n_test"] for c in report["clients"]) > 0
    assert f"{unassigned} unassigned" in out and "labels per client 1-1 of 10" in out


class WandbLogger:  # the class name is what PartitionReport looks for
    def __init__(self, fail: bool = False):
        self.logged: list[dict] = []
        self.experiment = SimpleNamespace(log=self._log, summary={})
        self.fail = fail

    def _log(self, payload):
        if self.fail:
            raise RuntimeError("W&B is down")
        self.logged.append(payload)


def test_wandb_gets_heatmap_table_and_hash(tmp_path):
    wandb = pytest.importorskip("wandb")
    logger = WandbLogger()
    sim = _sim("num_clients=3", "partition=iid", loggers=[logger])
    _run(sim, tmp_path)
    assert len(logger.logged) == 1
    payload = logger.logged[0]
    assert isinstance(payload["partition/heatmap"], wandb.Image)
    table = payload["partition/clients"]
    assert isinstance(table, wandb.Table) and len(table.data) == 3
    assert table.columns[:4] == ["client", "n_train", "n_test", "n_val"] and len(table.columns) == 14
    assert logger.experiment.summary["partition_hash"] == sim.host_data.partition_hash
    failing = WandbLogger(fail=True)
    with pytest.warns(UserWarning, match="W&B: could not log the partition summary"):
        _run(_sim("num_clients=3", "partition=iid", loggers=[failing]), tmp_path / "fail")
    assert (tmp_path / "fail" / "partition.json").exists()


@pytest.mark.slow
def test_cli_run_writes_partition_files(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "fedfew.train", "rounds=1", "num_clients=4", "logger=none", f"hydra.run.dir={run_dir}"],
        cwd=ROOT, env={**os.environ, "WANDB_MODE": "disabled"}, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((run_dir / "partition.json").read_text())
    results = json.loads((run_dir / "results.json").read_text())
    assert report["partition_hash"] == results["partition_hash"] and report["num_clients"] == 4
    assert (run_dir / "partition.png").stat().st_size > 0
    # digits defaults to the clustered partition (conf/dataset/digits.yaml); its title names the groups
    assert "partition: digits, clustered (4 groups, rotate, split; within iid), 4 clients\n" in proc.stdout
    assert proc.stdout.index("partition: digits") < proc.stdout.index("personalized test accuracy per client")
