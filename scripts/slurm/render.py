#!/usr/bin/env python3
"""Render (and optionally submit) the FedFew sbatch script from ``job.sbatch.template``.

Standard library only, so it runs with any Python >= 3.8 on a login node.

Library use::

    from render import render            # scripts/slurm on sys.path, or load by path
    text = render(nodes=1, ntasks_per_node=2, time="00:10:00",
                  args=["algorithm=fedfew", "dataset=cifar10"])

CLI::

    python scripts/slurm/render.py --nodes 1 --ntasks-per-node 2 --gpus-per-node 0 \\
        --time 00:10:00 --partition debug --job-name x --output path --workdir dir \\
        --python /path/python -- algorithm=fedfew dataset=cifar10
    # add --submit to write the script to a file (--script PATH, default: a temp file)
    # and submit it with ``sbatch --parsable``; the job id is printed on stdout, and the run
    # folder, the log file and the command to follow it on stderr.
    # add --check to run ``<python> -m fedfew.check <the job's overrides>`` first (the checks
    # ``python -m fedfew.train`` makes before loading data, and that the dataset's files are
    # there): a bad config or a missing data path is never submitted. --data-on-nodes skips the
    # files check, for data that exists only on the compute nodes (or that the job downloads).

Placeholders filled in the template: job_name, nodes, ntasks_per_node, gpu_line (the
``#SBATCH --gpus-per-node`` line, dropped entirely when gpus_per_node == 0), cpus_per_task,
time, partition, output, workdir, python, args.  The training step is launched with one task
per device (``srun``), and ``trainer.num_nodes``/``trainer.devices`` are appended from
``nodes``/``ntasks_per_node`` so Lightning Fabric's SLURM environment detection agrees with
the allocation.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from string import Template
from collections.abc import Iterable, Mapping
from typing import Any

TEMPLATE_PATH = Path(__file__).resolve().with_name("job.sbatch.template")

DEFAULTS: dict[str, Any] = {
    "job_name": "fedfew",
    "nodes": 1,
    "ntasks_per_node": 1,
    "gpus_per_node": 0,
    "cpus_per_task": 1,
    "time": "01:00:00",
    "partition": "debug",
    "output": "fedfew-%j.out",
    "workdir": ".",
    "python": sys.executable or "python3",
    "args": (),
    "run_root": "outputs/slurm",
}

GPU_LINE_PLACEHOLDER = "${gpu_line}\n"

# Slurm --time formats: "minutes", "minutes:seconds", "hours:minutes:seconds", "days-hours",
# "days-hours:minutes", "days-hours:minutes:seconds", and INFINITE/UNLIMITED.
_TIME_RES = [
    re.compile(r"(?P<m>\d+)"),
    re.compile(r"(?P<m>\d+):(?P<s>\d{1,2})"),
    re.compile(r"(?P<h>\d+):(?P<m>\d{1,2}):(?P<s>\d{1,2})"),
    re.compile(r"(?P<d>\d+)-(?P<h>\d{1,2})"),
    re.compile(r"(?P<d>\d+)-(?P<h>\d{1,2}):(?P<m>\d{1,2})"),
    re.compile(r"(?P<d>\d+)-(?P<h>\d{1,2}):(?P<m>\d{1,2}):(?P<s>\d{1,2})"),
]
# Values that end up on an "#SBATCH --opt=value" line: sbatch splits those on whitespace.
_SBATCH_VALUE_RE = re.compile(r"[^\s'\"\\`$]+")


class RenderError(ValueError):
    """Invalid value for the sbatch template."""


def _positive_int(name: str, value: Any, *, allow_zero: bool = False) -> int:
    if isinstance(value, bool):
        raise RenderError(f"{name} must be an integer, got {value!r}")
    if isinstance(value, str) and re.fullmatch(r"\s*[+-]?\d+\s*", value):
        value = int(value)
    if not isinstance(value, int):
        raise RenderError(f"{name} must be an integer, got {value!r}")
    lo = 0 if allow_zero else 1
    if value < lo:
        kind = "a non-negative" if allow_zero else "a positive"
        raise RenderError(f"{name} must be {kind} integer, got {value}")
    return value


def validate_time(value: Any) -> str:
    """Return ``value`` if it is a valid, non-zero Slurm time limit, else raise RenderError."""
    if not isinstance(value, str):
        raise RenderError(f"time must be a string like HH:MM:SS, got {value!r}")
    text = value.strip()
    if text.upper() in {"INFINITE", "UNLIMITED"}:
        return text.upper()
    for rx in _TIME_RES:
        m = rx.fullmatch(text)
        if not m:
            continue
        parts = {k: int(v) for k, v in m.groupdict().items() if v is not None}
        # Only the leading field may exceed its natural range.
        leading = next(k for k in ("d", "h", "m", "s") if k in parts)
        limits = {"h": ("hours", 24), "m": ("minutes", 60), "s": ("seconds", 60)}
        for key, (label, lim) in limits.items():
            if key in parts and key != leading and parts[key] >= lim:
                raise RenderError(f"time {value!r}: the {label} field must be < {lim}")
        total = (
            parts.get("d", 0) * 86400 + parts.get("h", 0) * 3600 + parts.get("m", 0) * 60 + parts.get("s", 0)
        )
        if total <= 0:
            raise RenderError(f"time {value!r} must be greater than zero")
        return text
    raise RenderError(
        f"invalid time {value!r}: use MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS or INFINITE"
    )


def _sbatch_value(name: str, value: Any) -> str:
    if not isinstance(value, (str, os.PathLike)):
        raise RenderError(f"{name} must be a string, got {value!r}")
    text = os.fspath(value)
    if not text:
        raise RenderError(f"{name} must not be empty")
    if not _SBATCH_VALUE_RE.fullmatch(text):
        raise RenderError(
            f"{name} {text!r} must not contain whitespace, quotes, backslashes, '$' or '`' "
            "(it goes on an #SBATCH line)"
        )
    return text


def _format_args(value: Any) -> str:
    """Hydra overrides: a sequence is shell-quoted item by item; a str is used verbatim."""
    if value is None:
        return ""
    if isinstance(value, str):
        items_text = value
    elif isinstance(value, Iterable):
        items = list(value)
        for item in items:
            if not isinstance(item, str):
                raise RenderError(f"args must be strings, got {item!r}")
            if not item:
                raise RenderError("args must not contain empty strings")
        items_text = " ".join(shlex.quote(item) for item in items)
    else:
        raise RenderError(f"args must be a list of strings or a string, got {value!r}")
    if "\n" in items_text or "\r" in items_text:
        raise RenderError("args must not contain newlines")
    return items_text


def validate(values: Mapping[str, Any]) -> dict[str, str]:
    """Check ``values`` (merged with DEFAULTS) and return the template substitutions."""
    unknown = sorted(set(values) - set(DEFAULTS))
    if unknown:
        raise RenderError(f"unknown template value(s): {', '.join(unknown)}; known: {', '.join(DEFAULTS)}")
    v = {**DEFAULTS, **values}

    nodes = _positive_int("nodes", v["nodes"])
    ntasks = _positive_int("ntasks_per_node", v["ntasks_per_node"])
    gpus = _positive_int("gpus_per_node", v["gpus_per_node"], allow_zero=True)
    cpus = _positive_int("cpus_per_task", v["cpus_per_task"])
    if gpus and ntasks != gpus:
        raise RenderError(
            f"ntasks_per_node ({ntasks}) must equal gpus_per_node ({gpus}): "
            "Lightning runs one task per device"
        )

    python = v["python"]
    if not isinstance(python, (str, os.PathLike)) or not os.fspath(python):
        raise RenderError(f"python must be a non-empty path, got {python!r}")
    python = os.fspath(python)
    if "\n" in python or "\r" in python:
        raise RenderError("python must not contain newlines")

    return {
        "job_name": _sbatch_value("job_name", v["job_name"]),
        "partition": _sbatch_value("partition", v["partition"]),
        "output": _sbatch_value("output", v["output"]),
        "workdir": _sbatch_value("workdir", v["workdir"]),
        "nodes": str(nodes),
        "ntasks_per_node": str(ntasks),
        "gpus_per_node": str(gpus),
        "gpu_line": f"#SBATCH --gpus-per-node={gpus}" if gpus else "",
        "cpus_per_task": str(cpus),
        "time": validate_time(v["time"]),
        "python": shlex.quote(python),
        "args": _format_args(v["args"]),
        "run_root": _sbatch_value("run_root", v["run_root"]),
    }


def render(template_path: str | os.PathLike | None = None, **values: Any) -> str:
    """Render the sbatch script. Keyword arguments are the template values (see DEFAULTS).

    ``args`` is a list of Hydra overrides (each shell-quoted) or an already-quoted string.
    Raises RenderError (a ValueError) on invalid input.
    """
    subs = validate(values)
    text = Path(template_path or TEMPLATE_PATH).read_text()
    if not subs["gpu_line"]:
        text = text.replace(GPU_LINE_PLACEHOLDER, "")
    try:
        out = Template(text).substitute(subs)
    except (KeyError, ValueError) as exc:  # template bug, not user input
        raise RenderError(f"template {template_path or TEMPLATE_PATH}: bad placeholder {exc}") from exc
    # "srun python -m fedfew.train  trainer..." when args is empty: tidy the double space.
    return out.replace(" -m fedfew.train  ", " -m fedfew.train ")


def submit(script_text: str, script_path: str | os.PathLike | None = None, sbatch: str = "sbatch") -> str:
    """Write ``script_text`` to ``script_path`` (default: a temp file) and ``sbatch --parsable`` it.

    Returns the job id. Raises RuntimeError if sbatch is missing or fails.
    """
    if script_path is None:
        fd, name = tempfile.mkstemp(prefix="fedfew-", suffix=".sbatch")
        os.close(fd)
        script_path = name
    path = Path(script_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(script_text)
    path.chmod(0o755)
    try:
        proc = subprocess.run([sbatch, "--parsable", str(path)], capture_output=True, text=True, timeout=60)
    except FileNotFoundError as exc:
        raise RuntimeError(f"'{sbatch}' not found: is Slurm installed (scripts/slurm/install.sh)?") from exc
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError("sbatch timed out after 60 s: is slurmctld running (scripts/slurm/start.sh)?") from exc
    if proc.returncode != 0:
        raise RuntimeError(f"sbatch {path} failed (exit {proc.returncode}): {proc.stderr.strip() or proc.stdout.strip()}")
    job_id = proc.stdout.strip().split(";", 1)[0]
    if not job_id.isdigit():
        raise RuntimeError(f"unexpected sbatch --parsable output: {proc.stdout!r}")
    return job_id


def job_overrides(overrides: list[str], nodes: Any, ntasks_per_node: Any) -> list[str]:
    """The Hydra overrides the job's ``srun python -m fedfew.train`` gets (the template appends
    ``trainer.num_nodes`` and ``trainer.devices`` from the allocation; ``hydra.run.dir`` aside)."""
    return [*overrides, f"trainer.num_nodes={nodes}", f"trainer.devices={ntasks_per_node}"]


def check_config(python: str, overrides: list[str], workdir: str | os.PathLike = ".",
                 data_on_nodes: bool = False) -> tuple[bool, str]:
    """Run ``python -m fedfew.check <overrides>`` in ``workdir`` (no data loaded, no job made; the
    dataset's files are looked up unless ``data_on_nodes``).

    Returns:
        (ok, what it printed: its ``config ok: ...`` line, or its error).
    """
    flags = ["--data-on-nodes"] if data_on_nodes else []
    try:
        proc = subprocess.run([python, "-m", "fedfew.check", *flags, *overrides], capture_output=True, text=True,
                              cwd=workdir, timeout=300)
    except FileNotFoundError as exc:
        return False, f"cannot run {python}: {exc}"
    except subprocess.TimeoutExpired:
        return False, f"{python} -m fedfew.check did not finish within 300 s"
    return proc.returncode == 0, (proc.stdout if proc.returncode == 0 else proc.stderr or proc.stdout).strip()


def where(job_id: str, output: str, run_root: str, workdir: str | os.PathLike = ".") -> dict[str, Path]:
    """The job's log file (``output`` with %j = job id) and run folder (``run_root/<job id>``),
    absolute (relative paths are taken from the job's ``workdir``)."""
    base = Path(workdir).expanduser().resolve()
    log = Path(output.replace("%j", job_id).replace("%J", job_id)).expanduser()
    run = Path(run_root).expanduser() / job_id
    return {"log": log if log.is_absolute() else base / log, "run": run if run.is_absolute() else base / run}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Render the FedFew sbatch script (and optionally submit it). "
        "Hydra overrides go after '--'.",
    )
    p.add_argument("--job-name", default=DEFAULTS["job_name"])
    p.add_argument("--nodes", default=DEFAULTS["nodes"], help="number of nodes (positive int)")
    p.add_argument("--ntasks-per-node", default=DEFAULTS["ntasks_per_node"],
                   help="tasks per node = devices per node (positive int)")
    p.add_argument("--gpus-per-node", default=DEFAULTS["gpus_per_node"], help="0 for CPU-only")
    p.add_argument("--cpus-per-task", default=DEFAULTS["cpus_per_task"])
    p.add_argument("--time", default=DEFAULTS["time"], help="Slurm time limit, e.g. 00:10:00")
    p.add_argument("--partition", default=DEFAULTS["partition"])
    p.add_argument("--output", default=DEFAULTS["output"], help="log path (%%j = job id)")
    p.add_argument("--workdir", default=DEFAULTS["workdir"], help="job working directory (--chdir)")
    p.add_argument("--python", default=DEFAULTS["python"], help="Python interpreter on the compute nodes")
    p.add_argument("--run-root", default=DEFAULTS["run_root"],
                   help="run directories go to RUN_ROOT/<job id> (one shared folder for all tasks)")
    p.add_argument("--template", default=None, help=f"template path (default {TEMPLATE_PATH})")
    p.add_argument("--submit", action="store_true", help="write the script and submit it with sbatch --parsable")
    p.add_argument("--script", default=None, help="with --submit: where to write the script (default: temp file)")
    p.add_argument("--check", action="store_true",
                   help="with --submit: first run `PYTHON -m fedfew.check` on the job's overrides (as `make train` "
                   "checks before loading data, and that the dataset's files are there); a failing check "
                   "submits nothing (exit 2)")
    p.add_argument("--data-on-nodes", action="store_true",
                   help="with --check: do not look for the dataset's files here (they exist only on the compute "
                   "nodes, or the job downloads them)")
    p.add_argument("overrides", nargs="*", help="Hydra overrides (after --)")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    ns = parser.parse_args(argv)
    try:
        text = render(
            template_path=ns.template,
            job_name=ns.job_name,
            nodes=ns.nodes,
            ntasks_per_node=ns.ntasks_per_node,
            gpus_per_node=ns.gpus_per_node,
            cpus_per_task=ns.cpus_per_task,
            time=ns.time,
            partition=ns.partition,
            output=ns.output,
            workdir=ns.workdir,
            python=ns.python,
            args=ns.overrides,
            run_root=ns.run_root,
        )
    except RenderError as exc:
        parser.error(str(exc))  # exits 2
    except OSError as exc:
        print(f"render.py: error: cannot read template: {exc}", file=sys.stderr)
        return 2
    if not ns.submit:
        sys.stdout.write(text)
        return 0
    if ns.check:
        ok, said = check_config(ns.python, job_overrides(ns.overrides, ns.nodes, ns.ntasks_per_node), ns.workdir,
                                ns.data_on_nodes)
        if not ok:
            print(f"{said}\nrender.py: nothing submitted: the run config or its data failed the check "
                  f"(`{ns.python} -m fedfew.check ...`, the checks of `make train`)", file=sys.stderr)
            return 2
        print(said, file=sys.stderr, flush=True)
    try:
        job_id = submit(text, ns.script)
    except RuntimeError as exc:
        print(f"render.py: error: {exc}", file=sys.stderr)
        return 1
    print(job_id, flush=True)
    paths = where(job_id, ns.output, ns.run_root, ns.workdir)
    print(f"submitted job {job_id}\n  run folder: {paths['run']}\n  log:        {paths['log']}\n"
          f"  follow:     tail -F {paths['log']}   (queue: squeue -j {job_id}; cancel: scancel {job_id})",
          file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
