"""Execute the analysis notebook on a run and save it as HTML.

``python -m fedfew.notebook RUN [--out FILE]`` (``make notebook RUN=<dir>``) runs
``notebooks/analysis.ipynb`` with ``FEDFEW_RUN=<RUN>`` (a run folder, or a folder of runs: a
``make compare`` output, a multirun folder) in a fresh Python kernel and writes the executed
notebook, code, tables and pictures, as one self-contained HTML file, by default
``<RUN>/analysis.html``; it prints the path. Needs the ``notebook`` extra (nbconvert,
nbclient, ipykernel, pandas), which ``make install`` installs.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from fedfew.core.io import atomic_write_text
from fedfew.core.run_folders import python_command

#: the notebook of the checkout (editable install: src/fedfew -> repository root)
NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "analysis.ipynb"


class NotebookError(RuntimeError):
    """The notebook could not run on this folder: no run in it, nbconvert missing, or a cell
    failed (the message names the cell's error)."""


def has_runs(path: Path) -> bool:
    """Whether ``path`` is a finished run folder or holds one below it (a ``results.json``)."""
    return (path / "results.json").is_file() or any(path.rglob("results.json"))


def render(run: str | Path, out: str | Path | None = None, notebook: str | Path = NOTEBOOK,
           timeout: float = 600) -> tuple[Path, object]:
    """Execute ``notebook`` on ``run`` and write it as HTML.

    Args:
        run: a run folder or a folder of runs (the notebook's ``FEDFEW_RUN``).
        out: the HTML file (default ``<run>/analysis.html``); written atomically, only when
            every cell ran.
        notebook: the notebook to execute.
        timeout: seconds one cell may take.
    Returns:
        (the HTML path, the executed notebook node).
    Raises:
        NotebookError: ``run`` is not a folder with a finished run (results.json) in it;
            nbconvert is not installed; a cell raised (its error is in the message).
    """
    run = Path(run).expanduser().absolute()
    if not run.is_dir():
        raise NotebookError(f"{run} is not a folder; give a run folder (outputs/<dataset>/<algorithm>/<time>...) "
                            "or a folder of runs (make runs lists them)")
    if not has_runs(run):
        raise NotebookError(f"no finished run under {run} (no results.json: the run is still going, was stopped "
                            "early or failed); make runs lists the finished ones")
    try:
        import nbformat
        from nbconvert import HTMLExporter
        from nbconvert.preprocessors import CellExecutionError, ExecutePreprocessor
    except ImportError as err:
        raise NotebookError(f"{err.name} is not installed: run make install (or pip install -e '.[notebook]')") from err
    out = Path(out) if out is not None else run / "analysis.html"
    nb = nbformat.read(str(notebook), as_version=4)
    previous = os.environ.get("FEDFEW_RUN")
    os.environ["FEDFEW_RUN"] = str(run)  # the kernel inherits this process's environment
    try:
        # the kernel logs errors only (ipykernel warns about plain TCP on localhost otherwise)
        executor = ExecutePreprocessor(timeout=timeout, kernel_name="python3",
                                       extra_arguments=["--IPKernelApp.log_level=ERROR"])
        executor.preprocess(nb, {"metadata": {"path": str(Path(notebook).parent)}})
    except CellExecutionError as err:
        raise NotebookError(f"{Path(notebook).name} failed on {run}:\n{err}") from err
    finally:
        if previous is None:
            os.environ.pop("FEDFEW_RUN", None)
        else:
            os.environ["FEDFEW_RUN"] = previous
    html, _ = HTMLExporter().from_notebook_node(nb)
    atomic_write_text(out, html)
    return out, nb


def main(argv: list[str] | None = None) -> int:
    """``python -m fedfew.notebook RUN [--out FILE] [--timeout S]``; prints the HTML's path."""
    parser = argparse.ArgumentParser(prog=python_command("fedfew.notebook"),
                                     description="Execute notebooks/analysis.ipynb on a run (or a folder of runs) into HTML.")
    parser.add_argument("run", help="a run folder, or a folder of runs (a make compare output, a multirun folder)")
    parser.add_argument("--out", help="the HTML file (default: <run>/analysis.html)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds one cell may take (default 600)")
    args = parser.parse_args(argv)
    try:
        path, _ = render(args.run, args.out, timeout=args.timeout)
    except NotebookError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
