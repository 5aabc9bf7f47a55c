"""The project's own sbatch job on the local Slurm cluster: 2 tasks, 2 FedFew rounds on CPU
(gloo), results equal to the 1-process run."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from test_distributed import assert_same_run, run
from test_slurm_cluster import render, slurm_cluster  # noqa: F401  (fixture)

ROOT = Path(__file__).resolve().parents[1]
COMMON = ["rounds=2", "num_clients=6", "eval_every=1"]


def wait_for_job(job_id: str, timeout: float = 600) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        out = subprocess.run(["squeue", "-h", "-j", job_id], capture_output=True, text=True).stdout
        if not out.strip():
            return
        time.sleep(2)
    subprocess.run(["scancel", job_id])
    pytest.fail(f"Slurm job {job_id} still queued/running after {timeout} s")


@pytest.mark.slurm
@pytest.mark.slow
def test_sbatch_job_two_tasks_equals_one_process(tmp_path, slurm_cluster):  # noqa: F811
    script = render(
        job_name="fedfew-ci", partition=slurm_cluster, nodes=1, ntasks_per_node=2, cpus_per_task=1,
        time="00:15:00", output=str(tmp_path / "job-%j.out"), workdir=str(ROOT), python=sys.executable,
        run_root=str(tmp_path / "runs"),
        args=[*COMMON, "save_models=true", "logger=none", "trainer.accelerator=cpu", "trainer.strategy=ddp",
              "trainer.threads=1"],
    )
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    job_id = subprocess.run(["sbatch", "--parsable", str(path)], capture_output=True, text=True, check=True).stdout.strip()
    job_id = job_id.split(";")[0]
    wait_for_job(job_id)
    log = (tmp_path / f"job-{job_id}.out").read_text()
    run_dir = tmp_path / "runs" / job_id
    assert (run_dir / "results.json").exists(), log[-4000:]
    slurm = (json.loads((run_dir / "results.json").read_text()), torch.load(run_dir / "models.pt"))
    assert slurm[0]["world_size"] == 2, log[-2000:]
    one = run(tmp_path, "one", *COMMON)
    assert_same_run(one, slurm)


@pytest.mark.slurm
@pytest.mark.slow
def test_hydra_sweep_through_submitit_one_job_each(tmp_path, slurm_cluster):  # noqa: F811
    sweep = tmp_path / "sweep"
    proc = subprocess.run(
        [sys.executable, "-m", "fedfew.train", "-m", "hydra/launcher=slurm", f"hydra.sweep.dir={sweep}",
         f"hydra.launcher.partition={slurm_cluster}", "rounds=1", "num_clients=4", "logger=none",
         "trainer.accelerator=cpu", "algorithm.K=1,2"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ks = sorted(json.loads((sweep / str(j) / "results.json").read_text())["config"]["algorithm"]["K"] for j in (0, 1))
    assert ks == [1, 2]
    for j, K in ((0, 1), (1, 2)):
        w = json.loads((sweep / str(j) / "results.json").read_text())["w"]
        assert len(w) == 4 and all(len(row) == K for row in w)
    # one Slurm array task per configuration
    tasks = [p.name for p in (sweep / ".submitit").iterdir() if p.is_dir() and "_" in p.name]
    assert len(tasks) == 2, tasks
