"""Shared test helpers.

Real data: tests that read the real data directory are marked ``@pytest.mark.realdata`` and get
it from the ``real_data_dir`` fixture. The directory comes from the ``FEDFEW_DATA_DIR``
environment variable; the files a test needs are given as marker arguments, relative to it::

    @pytest.mark.realdata("ag_news_csv/train.csv", "ag_news_csv/test.csv")
    def test_something(real_data_dir): ...

When the variable is unset or a file is missing, the test is skipped, or fails when
``FEDFEW_REQUIRE_DATA=1`` (CI with the data mounted).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

DATA_DIR_ENV = "FEDFEW_DATA_DIR"
REQUIRE_DATA_ENV = "FEDFEW_REQUIRE_DATA"


def real_data_dir(*required: str) -> Path:
    """The real data directory (``$FEDFEW_DATA_DIR``), holding every path in ``required``.

    Skips the calling test when the variable is unset or a path is missing, or fails it
    instead when ``FEDFEW_REQUIRE_DATA=1``.
    """
    raw = os.environ.get(DATA_DIR_ENV, "").strip()
    if not raw:
        problem = f"{DATA_DIR_ENV} is not set"
    else:
        root = Path(raw).expanduser().resolve()
        missing = [rel for rel in required if not (root / rel).exists()]
        if not root.is_dir():
            problem = f"{DATA_DIR_ENV}={raw} is not a directory"
        elif missing:
            problem = f"missing under {DATA_DIR_ENV}={raw}: {', '.join(missing)}"
        else:
            return root
    if os.environ.get(REQUIRE_DATA_ENV, "").strip() == "1":
        pytest.fail(f"real data required ({REQUIRE_DATA_ENV}=1) but {problem}")
    pytest.skip(f"real data unavailable: {problem}")


@pytest.fixture(name="real_data_dir")
def _real_data_dir_fixture(request: pytest.FixtureRequest) -> Path:
    """:func:`real_data_dir` for the paths given as arguments of the test's ``realdata`` marker."""
    marker = request.node.get_closest_marker("realdata")
    return real_data_dir(*(marker.args if marker is not None else ()))


CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


def compose_config(*overrides: str, tuned: bool = False):
    """The run config as ``python -m fedfew.train <overrides>`` would see it (no run dir).

    Without ``tuned=True`` the per-(dataset, algorithm) preset of ``conf/tuned/`` is left out
    (``~tuned``), so a test's hand computation depends on the config defaults and its own
    overrides only, not on whatever ``make tune`` last installed."""
    if not tuned and not any(o.lstrip("+~").startswith("tuned") for o in overrides):
        overrides = ("~tuned", *overrides)
    from fedfew.config.compose import compose

    return compose(overrides, CONF_DIR)


@pytest.fixture
def cpu_fabric():
    """A single-process CPU Fabric without loggers."""
    from lightning.fabric import Fabric

    return Fabric(accelerator="cpu", devices=1)


def make_argv(*words: str) -> list[str]:
    """``make <words>`` run with this interpreter's environment and never reinstalling it
    (``-o``: the install stamp counts as up to date; ``BIN``/``VENV`` point at this venv)."""
    venv = Path(sys.executable).parent.parent
    return ["make", "--no-print-directory", "-o", f"{venv}/.installed", f"BIN={venv}/bin", f"VENV={venv}", *words]


FAKE_JOB_ID = "4242"


@pytest.fixture
def fake_sbatch(tmp_path) -> Path:
    """``<tmp>/bin/sbatch``, for a subprocess whose PATH starts with ``<tmp>/bin``: it appends its
    arguments to ``<tmp>/sbatch-calls`` (returned; absent while it was never called) and answers
    like ``sbatch --parsable`` with job id :data:`FAKE_JOB_ID`, so no Slurm cluster is needed."""
    calls = tmp_path / "sbatch-calls"
    sbatch = tmp_path / "bin" / "sbatch"
    sbatch.parent.mkdir()
    sbatch.write_text(f'#!/bin/sh\necho "$@" >> "{calls}"\necho "{FAKE_JOB_ID};cluster"\n')
    sbatch.chmod(0o755)
    return calls


def idle_process(*argv: str):
    """A live ``python`` process that sleeps for 2 minutes, started with ``argv`` after its
    program (its command line, e.g. ``fedfew.train`` to stand in for a training run); returned
    once its command line is in place. Kill it when done."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(120)", *argv],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "up"
    return proc
