"""notebooks/analysis.ipynb runs end to end (nbclient) on runs made here: a folder of two runs
(a Hydra multirun over seeds, like a comparison) and one run directory."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "analysis.ipynb"


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sweep")
    env = {**os.environ, "WANDB_MODE": "disabled"}
    proc = subprocess.run(
        [sys.executable, "-m", "fedfew.train", "-m", "seed=0,1", "rounds=2", "eval_every=1", "num_clients=8",
         "algorithm.K=2", "logger=csv", "logger.plots=false", f"hydra.sweep.dir={out}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def execute(run: Path):
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(NOTEBOOK, as_version=4)
    os.environ["FEDFEW_RUN"] = str(run)  # the kernel inherits the environment
    try:
        NotebookClient(nb, timeout=180, kernel_name="python3",
                       resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
    finally:
        os.environ.pop("FEDFEW_RUN", None)
    return nb


def outputs(nb) -> list[dict]:
    return [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs]


def text_of(nb) -> str:
    parts = []
    for o in outputs(nb):
        parts.append(o.get("text", ""))
        for kind in ("text/html", "text/plain", "text/markdown"):
            parts.append(o.get("data", {}).get(kind, ""))
    return "\n".join(parts)


@pytest.mark.slow
def test_notebook_on_a_folder_of_runs(sweep):
    # a comparison table next to the runs, as `make compare` writes it (compare.csv)
    acc = {name: json.loads((sweep / name / "results.json").read_text())["summary"]["acc_weighted"] for name in "01"}
    (sweep / "compare.csv").write_text("algorithm,acc_weighted\n" + "".join(f"seed{n},{a!r}\n" for n, a in acc.items()))
    nb = execute(sweep)
    assert not [o for o in outputs(nb) if o.get("output_type") == "error"]
    text = text_of(nb)
    assert "2 run(s)" in text and "compare.csv" in text and "seed1" in text
    for name in ("0", "1"):
        res = json.loads((sweep / name / "results.json").read_text())
        # both runs in the comparison table, with their real accuracy
        assert f"{res['summary']['acc_mean']:.4f}" in text
    images = [o for o in outputs(nb) if "image/png" in o.get("data", {})]
    # curves, distributions, and per run (K = 2, 2 rounds): client accuracy, alpha, assignment,
    # w heatmaps at rounds 1 and 2, g / effective step
    assert len(images) == 2 + 2 * 6


@pytest.mark.slow
def test_notebook_on_one_run_as_html(sweep):
    """`make notebook RUN=<dir>` (python -m fedfew.notebook): the executed notebook as HTML in
    the run folder, its path printed."""
    from fedfew.notebook import render

    run = sweep / "0"
    path, nb = render(run)
    assert path == run / "analysis.html"
    assert not [o for o in outputs(nb) if o.get("output_type") == "error"]
    text = text_of(nb)
    res = json.loads((run / "results.json").read_text())
    assert "1 run(s)" in text and f"{res['summary']['acc_mean']:.4f}" in text
    # curves, accuracy figure, distributions, client accuracy, alpha, assignment, 2 w heatmaps, g / step
    assert sum("image/png" in o.get("data", {}) for o in outputs(nb)) == 9
    html = path.read_text()
    assert html.startswith("<!DOCTYPE html>") and f"{res['summary']['acc_mean']:.4f}" in html
    assert html.count('src="data:image/png;base64,') == 9  # the pictures are inside the file


def test_notebook_command_refuses_a_folder_without_finished_runs(tmp_path):
    (tmp_path / "running").mkdir()
    (tmp_path / "running" / "metrics.csv").write_text("round\n1\n")
    for target, expected in ((tmp_path / "missing", "is not a folder"), (tmp_path, "no finished run under")):
        proc = subprocess.run([sys.executable, "-m", "fedfew.notebook", str(target)], capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode == 2 and proc.stderr.startswith("error: ") and expected in proc.stderr
    assert not list(tmp_path.rglob("*.html"))
