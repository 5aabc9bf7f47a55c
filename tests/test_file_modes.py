"""Result files take the process umask (0644 under 022), not tempfile.mkstemp's 0600, so
collaborators on a shared cluster can read them; they are still written atomically."""
from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fedfew.core.io import atomic_torch_save, atomic_write_bytes, atomic_write_json, atomic_write_text, current_umask
from test_train_cli import ROOT


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def umask():
    """Set the process umask for a test (restored after)."""
    saved = os.umask(0o022)
    os.umask(saved)
    yield lambda mask: os.umask(mask)
    os.umask(saved)


@pytest.mark.parametrize("mask,expected", [(0o022, 0o644), (0o027, 0o640), (0o002, 0o664), (0o077, 0o600)])
def test_atomic_writers_follow_the_umask(tmp_path, umask, mask, expected):
    umask(mask)
    assert current_umask() == mask
    files = [
        atomic_write_json(tmp_path / "results.json", {"acc": torch.tensor([0.5, 1.0])}),
        atomic_write_text(tmp_path / "metrics.csv", "round\n1\n"),
        atomic_write_bytes(tmp_path / "plot.png", b"\x89PNG"),
        atomic_torch_save(tmp_path / "checkpoints" / "last.ckpt", {"round": 1}),
    ]
    assert [_mode(f) for f in files] == [expected] * 4
    assert (tmp_path / "results.json").read_text() == '{\n  "acc": [\n    0.5,\n    1.0\n  ]\n}\n'
    assert (tmp_path / "plot.png").read_bytes() == b"\x89PNG"
    assert torch.load(files[3]) == {"round": 1}
    assert sorted(p.name for p in tmp_path.rglob(".*.tmp")) == []  # no temporary file left behind
    atomic_write_text(tmp_path / "metrics.csv", "round\n1\n2\n")  # a rewrite keeps the mode
    assert _mode(tmp_path / "metrics.csv") == expected


@pytest.mark.slow
def test_run_files_follow_the_umask(tmp_path):
    """A real run under umask 027: every file it writes is 0640 (group-readable, not 0600)."""
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "fedfew.train", f"hydra.run.dir={run_dir}", "rounds=1", "num_clients=4",
         "partition=iid", "checkpoint_every=1", "save_models=true", "logger=csv", "trainer.threads=1"],
        cwd=ROOT, env={**os.environ, "WANDB_MODE": "disabled"}, capture_output=True, text=True, timeout=600,
        preexec_fn=lambda: os.umask(0o027),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = [p for p in run_dir.rglob("*") if p.is_file() and ".hydra" not in p.parts and p.suffix != ".log"]
    names = {p.relative_to(run_dir).as_posix() for p in files}
    assert {"results.json", "metrics.csv", "history.json.gz", "config.yaml", "partition.json", "models.pt",
            "checkpoints/last.ckpt", "logs/metrics.csv"} <= names
    assert any(n.startswith("plots/") and n.endswith(".png") for n in names)
    assert {p.relative_to(run_dir).as_posix(): oct(_mode(p)) for p in files} == {n: oct(0o640) for n in names}
