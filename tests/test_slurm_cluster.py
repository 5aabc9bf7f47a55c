"""Tests for the Slurm tooling in scripts/slurm/ (sbatch template renderer + a real local cluster).

The rendering tests need nothing. The tests that use the ``slurm_cluster`` fixture need a
running cluster (``sudo scripts/slurm/install.sh && sudo scripts/slurm/start.sh``); without
one they are skipped, except under ``CI=true`` where a missing cluster is a failure.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[1]
SLURM_DIR = REPO / "scripts" / "slurm"
RENDER_PY = SLURM_DIR / "render.py"


def _load_render():
    spec = importlib.util.spec_from_file_location("fedfew_slurm_render", RENDER_PY)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


render_mod = _load_render()
render = render_mod.render
RenderError = render_mod.RenderError


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in {"true", "1", "yes"}


def _run(cmd: list[str], timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def _cluster_problem() -> str | None:
    """Return why the local Slurm cluster is unusable, or None if ``sinfo`` works."""
    if shutil.which("sinfo") is None:
        return "sinfo not found (run: sudo scripts/slurm/install.sh && sudo scripts/slurm/start.sh)"
    try:
        proc = _run(["sinfo", "-h", "-o", "%P %a %D %t"], timeout=20)
    except subprocess.TimeoutExpired:
        return "sinfo timed out after 20 s: slurmctld not responding (run: sudo scripts/slurm/start.sh)"
    if proc.returncode != 0:
        return f"sinfo failed (exit {proc.returncode}): {proc.stderr.strip()} (run: sudo scripts/slurm/start.sh)"
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    if not lines:
        return "sinfo shows no partitions/nodes"
    usable = [ln for ln in lines if ln.split()[1] == "up" and not ln.split()[3].startswith(("down", "drain", "fail"))]
    if not usable:
        return f"no usable partition/node in sinfo output: {lines}"
    return None


@pytest.fixture(scope="session")
def slurm_cluster() -> str:
    """A reachable Slurm controller. Returns the first usable partition name."""
    problem = _cluster_problem()
    if problem is not None:
        if _in_ci():
            pytest.fail(f"Slurm cluster required under CI=true but unavailable: {problem}")
        pytest.skip(f"no local Slurm cluster: {problem}")
    proc = _run(["sinfo", "-h", "-o", "%P %a"])
    partitions = [ln.split()[0] for ln in proc.stdout.splitlines() if ln.strip() and ln.split()[1] == "up"]
    default = next((p for p in partitions if p.endswith("*")), partitions[0])
    return default.rstrip("*")


def _wait_for_job(job_id: str, timeout: float = 120.0) -> None:
    """Poll ``squeue -j ID -h`` until the job has left the queue (no accounting needed)."""
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        proc = _run(["squeue", "-j", job_id, "-h", "-o", "%i %T %R"], timeout=20)
        last = (proc.stdout + proc.stderr).strip()
        # Once purged from the controller, squeue reports "Invalid job id" (exit 1).
        if proc.returncode != 0 and "Invalid job id" in proc.stderr:
            return
        if proc.returncode == 0 and not proc.stdout.strip():
            return
        time.sleep(0.5)
    subprocess.run(["scancel", job_id], capture_output=True, timeout=20)
    pytest.fail(f"job {job_id} still queued after {timeout:.0f} s; last squeue: {last!r}")


def _job_state(job_id: str) -> tuple[str, str] | None:
    """(JobState, ExitCode) from ``scontrol show job`` while the controller still remembers it."""
    proc = _run(["scontrol", "show", "job", job_id], timeout=20)
    if proc.returncode != 0:
        return None
    state = re.search(r"\bJobState=(\S+)", proc.stdout)
    code = re.search(r"\bExitCode=(\S+)", proc.stdout)
    if not state:
        return None
    return state.group(1), code.group(1) if code else "?"


# --------------------------------------------------------------------------- rendering


BASE = dict(
    job_name="fedfew-test",
    nodes=2,
    ntasks_per_node=2,
    gpus_per_node=0,
    cpus_per_task=3,
    time="00:10:00",
    partition="debug",
    output="/logs/fedfew-%j.out",
    workdir="/work/fedfew",
    python="/opt/venv/bin/python",
    args=["algorithm=fedfew", "dataset=cifar10", "model.hidden=[64,64]"],
)


def test_render_cpu_job_lines():
    text = render(**BASE)
    lines = text.splitlines()
    assert lines[0] == "#!/bin/bash"
    sbatch = [ln for ln in lines if ln.startswith("#SBATCH")]
    assert sbatch == [
        "#SBATCH --job-name=fedfew-test",
        "#SBATCH --partition=debug",
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=2",
        "#SBATCH --cpus-per-task=3",
        "#SBATCH --time=00:10:00",
        "#SBATCH --output=/logs/fedfew-%j.out",
        "#SBATCH --chdir=/work/fedfew",
    ]
    assert "gpus" not in text
    assert "export OMP_NUM_THREADS=3" in lines
    assert "export PYTHONUNBUFFERED=1" in lines
    assert (
        "srun /opt/venv/bin/python -m fedfew.train algorithm=fedfew dataset=cifar10 "
        "'model.hidden=[64,64]' hydra.run.dir=outputs/slurm/${SLURM_JOB_ID} trainer.num_nodes=2 trainer.devices=2"
    ) in lines
    # No unrendered placeholders, and shell variables survive ($$ escapes).
    assert "${job_name}" not in text and "${gpu_line}" not in text
    assert "${SLURM_JOB_ID:-?}" in text
    # #SBATCH directives must all precede the first command for sbatch to honour them.
    first_cmd = next(i for i, ln in enumerate(lines) if ln and not ln.startswith("#"))
    assert all(i < first_cmd for i, ln in enumerate(lines) if ln.startswith("#SBATCH"))


def test_render_gpu_job_line():
    text = render(**{**BASE, "gpus_per_node": 2})
    sbatch = [ln for ln in text.splitlines() if ln.startswith("#SBATCH")]
    assert "#SBATCH --gpus-per-node=2" in sbatch
    assert sbatch.index("#SBATCH --gpus-per-node=2") == sbatch.index("#SBATCH --ntasks-per-node=2") + 1
    assert text.count("gpus-per-node") == 1


def test_render_defaults_and_string_ints():
    text = render(nodes="1", ntasks_per_node="4", args="a=1 'b=[2, 3]'")
    assert "#SBATCH --nodes=1\n" in text
    assert "#SBATCH --ntasks-per-node=4\n" in text
    assert "#SBATCH --partition=debug\n" in text
    assert "-m fedfew.train a=1 'b=[2, 3]' hydra.run.dir=outputs/slurm/${SLURM_JOB_ID} trainer.num_nodes=1 trainer.devices=4\n" in text
    no_args = render(args=[])
    assert "-m fedfew.train hydra.run.dir=outputs/slurm/${SLURM_JOB_ID} trainer.num_nodes=1 trainer.devices=1\n" in no_args


def test_render_quotes_python_path():
    text = render(python="/opt/my env/bin/python")
    assert "srun '/opt/my env/bin/python' -m fedfew.train" in text


@pytest.mark.parametrize("time_value", ["10", "10:30", "00:10:00", "48:00:00", "1-00", "1-12:30", "2-00:00:00", "INFINITE"])
def test_render_accepts_slurm_time_formats(time_value):
    assert f"#SBATCH --time={time_value}\n" in render(time=time_value)


@pytest.mark.parametrize(
    "override, message",
    [
        ({"nodes": 0}, "nodes must be a positive integer"),
        ({"nodes": -2}, "nodes must be a positive integer"),
        ({"nodes": 1.5}, "nodes must be an integer"),
        ({"nodes": True}, "nodes must be an integer"),
        ({"nodes": "two"}, "nodes must be an integer"),
        ({"ntasks_per_node": 0}, "ntasks_per_node must be a positive integer"),
        ({"cpus_per_task": 0}, "cpus_per_task must be a positive integer"),
        ({"gpus_per_node": -1}, "gpus_per_node must be a non-negative integer"),
        ({"gpus_per_node": 4}, "ntasks_per_node (2) must equal gpus_per_node (4)"),
        ({"time": "10 minutes"}, "invalid time"),
        ({"time": "00:60:00"}, "minutes field must be < 60"),
        ({"time": "1-24:00"}, "hours field must be < 24"),
        ({"time": "00:00:00"}, "must be greater than zero"),
        ({"time": 600}, "time must be a string"),
        ({"job_name": "two words"}, "job_name 'two words' must not contain whitespace"),
        ({"job_name": ""}, "job_name must not be empty"),
        ({"output": "/tmp/a\nb"}, "output"),
        ({"workdir": "$HOME"}, "workdir"),
        ({"python": ""}, "python must be a non-empty path"),
        ({"args": ["ok=1", 3]}, "args must be strings"),
        ({"args": "a=1\nrm -rf /"}, "args must not contain newlines"),
        ({"gpu": 1}, "unknown template value(s): gpu"),
    ],
)
def test_render_validation_errors(override, message):
    with pytest.raises(RenderError) as excinfo:
        render(**{**BASE, **override})
    assert message in str(excinfo.value)
    assert isinstance(excinfo.value, ValueError)


def test_render_cli_prints_script():
    proc = _run(
        [
            sys.executable, str(RENDER_PY), "--nodes", "1", "--ntasks-per-node", "2", "--gpus-per-node", "0",
            "--time", "00:10:00", "--partition", "debug", "--job-name", "x", "--output", "out-%j.log",
            "--workdir", "/tmp", "--python", "/usr/bin/python3", "--", "algorithm=fedfew", "+extra=[1, 2]",
        ]
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == render(
        nodes=1, ntasks_per_node=2, gpus_per_node=0, time="00:10:00", partition="debug", job_name="x",
        output="out-%j.log", workdir="/tmp", python="/usr/bin/python3", args=["algorithm=fedfew", "+extra=[1, 2]"],
    )
    assert "'+extra=[1, 2]' hydra.run.dir=outputs/slurm/${SLURM_JOB_ID} trainer.num_nodes=1 trainer.devices=2" in proc.stdout


def test_render_cli_rejects_bad_input():
    proc = _run([sys.executable, str(RENDER_PY), "--nodes", "0"])
    assert proc.returncode == 2
    assert "nodes must be a positive integer, got 0" in proc.stderr
    proc = _run([sys.executable, str(RENDER_PY), "--time", "ten"])
    assert proc.returncode == 2
    assert "invalid time 'ten'" in proc.stderr


# --------------------------------------------------------------------------- real cluster


def test_cluster_accepts_rendered_script(slurm_cluster, tmp_path):
    """slurmctld accepts the rendered directives (``sbatch --test-only`` schedules, never runs)."""
    script = tmp_path / "job.sbatch"
    script.write_text(
        render(job_name="fedfew-testonly", nodes=1, ntasks_per_node=2, cpus_per_task=1, time="00:05:00",
               partition=slurm_cluster, output=str(tmp_path / "out-%j.log"), workdir=str(tmp_path),
               python=sys.executable, args=["algorithm=fedfew"])
    )
    proc = _run(["sbatch", "--test-only", str(script)], timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "to start at" in proc.stderr, proc.stderr


def test_cluster_runs_two_task_job(slurm_cluster, tmp_path):
    out = tmp_path / "ranks-%j.out"
    script_text = "\n".join(
        [
            "#!/bin/bash",
            "#SBATCH --job-name=fedfew-ranks",
            f"#SBATCH --partition={slurm_cluster}",
            "#SBATCH --nodes=1",
            "#SBATCH --ntasks=2",
            "#SBATCH --cpus-per-task=1",
            "#SBATCH --time=00:02:00",
            f"#SBATCH --output={out}",
            f"#SBATCH --chdir={tmp_path}",
            "set -euo pipefail",
            "srun bash -c 'echo rank $SLURM_PROCID of $SLURM_NTASKS'",
            "",
        ]
    )
    job_id = render_mod.submit(script_text, tmp_path / "ranks.sbatch")
    assert job_id.isdigit()
    _wait_for_job(job_id, timeout=120)

    log = Path(str(out).replace("%j", job_id))
    deadline = time.monotonic() + 10  # the file is written by slurmstepd; allow for slow FS sync
    while not log.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert log.exists(), f"job {job_id} produced no output file {log}; state: {_job_state(job_id)}"
    content = log.read_text()
    assert "rank 0 of 2" in content, content
    assert "rank 1 of 2" in content, content
    state = _job_state(job_id)
    if state is not None:  # still within MinJobAge
        assert state == ("COMPLETED", "0:0"), state
