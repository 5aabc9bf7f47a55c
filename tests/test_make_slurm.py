"""``make slurm`` checks the run config before ``sbatch`` (the checks of ``make train``, no data
loaded) and then says where the job's run folder and log are. A fake ``sbatch`` first on PATH
records its calls, so no Slurm cluster is needed."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import FAKE_JOB_ID as JOB_ID, make_argv

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


def make_slurm(tmp_path: Path, args: str) -> subprocess.CompletedProcess:
    """``make slurm ARGS=...`` with this interpreter's environment and the fake ``sbatch``."""
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.run(
        make_argv("slurm", f"SLURM_OUT={tmp_path / 'slurm'}", "DATASET=digits", f"ARGS={args}"),
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


def test_check_loads_no_data_and_knows_the_registries(tmp_path):
    from fedfew.algorithms import ALGORITHMS
    from fedfew.data.datasets import DATASETS
    from fedfew.models import MODELS
    from fedfew.train import check_registered

    proc = subprocess.run([sys.executable, "-m", "fedfew.check", "dataset=agnews", f"data_dir={tmp_path / 'none'}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]  # the files are missing: only training would notice
    assert proc.stdout.startswith("config ok: dataset=agnews algorithm=fedfew model=textcnn")
    # names read from the sources without importing them == the registries' own
    for kind, package, registry in (("dataset", "fedfew.data.datasets", DATASETS), ("model", "fedfew.models", MODELS),
                                    ("algorithm", "fedfew.algorithms", ALGORITHMS)):
        with pytest.raises(ValueError) as err:
            check_registered(kind, package, "nosuch")
        assert f"unknown {kind} 'nosuch'; available: {', '.join(registry.names())} (" in str(err.value)
        for name in registry.names():
            check_registered(kind, package, name)
