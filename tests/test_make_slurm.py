"""``make slurm`` checks the run config before ``sbatch`` (the checks of ``make train``, and that
the dataset's files are there; no data loaded) and then says where the job's run folder and log
are. A fake ``sbatch`` first on PATH records its calls, so no Slurm cluster is needed."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import FAKE_JOB_ID as JOB_ID, compose_config, make_argv

ROOT = Path(__file__).resolve().parents[1]
AGNEWS_FILES = ("ag_news_csv/train.csv", "ag_news_csv/test.csv")

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


def make_slurm(tmp_path: Path, args: str, *variables: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """``make slurm ARGS=... <variables>`` (default ``DATASET=digits``) with this interpreter's
    environment (plus ``env``) and the fake ``sbatch``."""
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}", **(env or {})}
    return subprocess.run(
        make_argv("slurm", f"SLURM_OUT={tmp_path / 'slurm'}", "DATASET=digits", f"ARGS={args}", *variables),
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )


@pytest.mark.parametrize("args,named", [
    ("algorithm.K=0", "algorithm.K=0: allowed integer >= 1"),
    ("rounds=0 algorithm.mu=-1", "algorithm.mu=-1"),
    ("mu=0.1", "closest valid key: algorithm.mu"),  # a key no config defines
    ("algorithm.name=fedfeww", "unknown algorithm 'fedfeww'"),
])
def test_bad_config_is_never_submitted(tmp_path, fake_sbatch, args, named):
    proc = make_slurm(tmp_path, args)
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert named in proc.stderr and "nothing submitted" in proc.stderr, proc.stderr[-3000:]
    assert not fake_sbatch.exists()  # sbatch was never called
    assert not (tmp_path / "slurm" / "last.sbatch").exists()


def test_good_config_is_submitted_and_located(tmp_path, fake_sbatch):
    proc = make_slurm(tmp_path, "rounds=3 algorithm.mu=0.5")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "slurm"
    script = out / "last.sbatch"
    assert fake_sbatch.read_text().splitlines() == [f"--parsable {script}"]  # called once, with the script
    assert "config ok: dataset=digits algorithm=fedfew" in proc.stderr
    assert JOB_ID in proc.stdout.splitlines()
    assert f"run folder: {out / JOB_ID}" in proc.stderr
    assert f"log:        {out / (JOB_ID + '.out')}" in proc.stderr
    assert f"tail -F {out / (JOB_ID + '.out')}" in proc.stderr
    assert "rounds=3 algorithm.mu=0.5 hydra.run.dir=" in script.read_text()


@pytest.mark.parametrize("given", [True, False])
def test_missing_data_path_is_never_submitted(tmp_path, fake_sbatch, given):
    """DATA_DIR naming a folder that does not exist (or, without DATA_DIR, FEDFEW_DATA_DIR doing
    so) fails on this node, naming the files the job would read; DATA_ON_NODES=1 submits anyway."""
    missing = tmp_path / "no-such-folder"
    variables = ["DATASET=agnews", *([f"DATA_DIR={missing}"] if given else [])]
    env = {"FEDFEW_DATA_DIR": str(missing if not given else tmp_path / "unused")}
    proc = make_slurm(tmp_path, "", *variables, env=env)
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert f"expected {missing}/ag_news_csv/{{train,test}}.csv ({missing}/ag_news_csv/train.csv and " in proc.stderr
    assert f"the data directory {missing} does not exist here" in proc.stderr
    assert "DATA_ON_NODES=1" in proc.stderr and "nothing submitted" in proc.stderr, proc.stderr[-3000:]
    assert not fake_sbatch.exists() and not (tmp_path / "slurm" / "last.sbatch").exists()

    proc = make_slurm(tmp_path, "", *variables, "DATA_ON_NODES=1", env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "data: not checked (--data-on-nodes)" in proc.stderr
    assert fake_sbatch.read_text().splitlines() == [f"--parsable {tmp_path / 'slurm' / 'last.sbatch'}"]


@pytest.mark.realdata(*AGNEWS_FILES)
def test_data_present_is_submitted(tmp_path, fake_sbatch, real_data_dir):
    proc = make_slurm(tmp_path, "", "DATASET=agnews", f"DATA_DIR={real_data_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "config ok: dataset=agnews" in proc.stderr and "data: 2 file(s) found" in proc.stderr
    assert fake_sbatch.exists()


def test_check_data_names_each_datasets_files(tmp_path):
    """``check_data`` looks the files up as the loader does: none for digits, the LEAF files for
    femnist, at least the data directory for a loader without ``find_files`` (cifar10)."""
    from fedfew.check import check_data
    from fedfew.data.base import DataNotFoundError

    missing = tmp_path / "missing"
    assert check_data(compose_config("dataset=digits", f"data_dir={missing}")) == []
    with pytest.raises(DataNotFoundError, match=f"cifar10: the data directory {missing} does not exist"):
        check_data(compose_config("dataset=cifar10", f"data_dir={missing}"))
    with pytest.raises(DataNotFoundError, match=f"{tmp_path}/femnist/train/\\*.json") as err:
        check_data(compose_config("dataset=femnist", f"data_dir={tmp_path}"))
    assert "DATA_ON_NODES=1" in str(err.value) and "does not exist here" not in str(err.value)
    for split in ("train", "test"):
        (tmp_path / "femnist" / split).mkdir(parents=True)
        (tmp_path / "femnist" / split / "a.json").write_text("{}")  # looked up, not read
    assert check_data(compose_config("dataset=femnist", f"data_dir={tmp_path}")) == [
        tmp_path / "femnist" / "train" / "a.json", tmp_path / "femnist" / "test" / "a.json"]


def test_check_loads_no_data_and_knows_the_registries(tmp_path):
    from fedfew.algorithms import ALGORITHMS
    from fedfew.data.datasets import DATASETS
    from fedfew.models import MODELS
    from fedfew.experiments.training import check_registered

    proc = subprocess.run([sys.executable, "-m", "fedfew.check", "--data-on-nodes", "dataset=agnews",
                           f"data_dir={tmp_path / 'none'}"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]  # the files are missing, but said to be on the nodes
    assert proc.stdout.startswith("config ok: dataset=agnews algorithm=fedfew model=textcnn")
    assert proc.stdout.rstrip().endswith("data: not checked (--data-on-nodes)")
    # names read from the sources without importing them == the registries' own
    for kind, package, registry in (("dataset", "fedfew.data.datasets", DATASETS), ("model", "fedfew.models", MODELS),
                                    ("algorithm", "fedfew.algorithms", ALGORITHMS)):
        with pytest.raises(ValueError) as err:
            check_registered(kind, package, "nosuch")
        assert f"unknown {kind} 'nosuch'; available: {', '.join(registry.names())} (" in str(err.value)
        for name in registry.names():
            check_registered(kind, package, name)
