"""The README's commands stay true: every command in its ``bash`` blocks runs, in a cheap form.

The cheap form is the README's own command line with the same make target and variables, plus
overrides that make it small (1-2 rounds, 4 clients, a temporary run folder; one trial, one seed).
:data:`CHEAP` maps each README command to those additions; a README command without an entry (or
an entry the README no longer shows) fails :func:`test_every_readme_command_has_a_cheap_form`, so
the README and this test cannot drift apart.
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import make_argv

ROOT = Path(__file__).resolve().parents[1]
TINY = "rounds=1 num_clients=4 logger=none trainer.threads=1"  # one thread: two commands run at a time

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


def readme_commands() -> list[str]:
    """The commands README.md shows: each line of its ``bash`` blocks (trailing comments removed)
    and each ``make train ...`` / ``make compare ...`` code span in a table row (the expected-results tables), in order and
    without repeats. (Targets only named in prose or in the documentation table, such as ``make
    gpu-check`` and ``make bench``, are run by tests/test_gpu_check.py and tests/test_bench.py.)"""
    text = (ROOT / "README.md").read_text()
    lines = [ln for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S) for ln in block.splitlines()]
    lines += [span for row in text.splitlines() if row.startswith("|")
              for span in re.findall(r"`(make train[^`]*|make compare [^`]+)`", row)]  # not the bare name
    commands = []
    for line in lines:
        words = shlex.split(line, comments=True)
        # re-joined as shlex keeps them (quotes normalised), so comments and spacing do not matter
        if words and shlex.join(words) not in commands:
            commands.append(shlex.join(words))
    return commands


# README command (as shlex.join writes it) -> (make variables / extra words to add, expected output).
# In extra words: {run} = a finished 2-round run folder, {tmp} = the test's temporary folder,
# {data} = the real data directory. ARGS given here are appended to the README's ARGS, and replace
# the README's value of any key they set.
CHEAP: dict[str, tuple[list[str], str]] = {
    "make train": ([f"ARGS={TINY} hydra.run.dir={{tmp}}/r"], "client-mean acc"),
    "make train ARGS=algorithm=fedavg": ([f"ARGS={TINY} hydra.run.dir={{tmp}}/r"], "client-mean acc"),
    "make train ARGS=algorithm=oracle": ([f"ARGS={TINY} hydra.run.dir={{tmp}}/r"], "ARI 1.000"),
    "make train 'ARGS=algorithm=fedfew_reference algorithm.K=4'": (
        [f"ARGS={TINY} hydra.run.dir={{tmp}}/r"], "client-mean acc"),
    # one method, one seed, one round: the command's shape and its split (ARGS merge into the README's)
    "make compare 'ALGORITHMS=fedfew fedavg' 'SEEDS=0 1 2' ARGS=partition=dirichlet": (
        ["ALGORITHMS=fedfew", "SEEDS=0", "COMPARE_OUT={tmp}/compare", "ARGS=rounds=1 num_clients=4"],
        "dirichlet (alpha=0.5)"),
    "make compare 'ALGORITHMS=fedfew fedavg' 'SEEDS=0 1 2' ARGS=partition=pathological": (
        ["ALGORITHMS=fedfew", "SEEDS=0", "COMPARE_OUT={tmp}/compare", "ARGS=rounds=1 num_clients=4"],
        "pathological (classes_per_client=2)"),
    "make test": (["-n", "PYTEST_ARGS=--collect-only"], "-m pytest --collect-only"),
    "make runs": (["ROOT={run}/.."], "fedfew"),
    "make notebook 'RUN=outputs/digits/fedfew/<run>'": (["RUN={run}"], "analysis.html"),
    ".venv/bin/python -m fedfew.reporting.plots 'outputs/digits/fedfew/<run>'": ([], "plots"),
    "make train ARGS=logger=wandb": (
        ["ARGS=rounds=1 num_clients=4 trainer.threads=1 hydra.run.dir={tmp}/r"], "wandb sync"),
    "make train DATASET=agnews DATA_DIR=../shared/data": (
        ["DATA_DIR={data}", "ARGS=rounds=1 participation=0.1 logger=none trainer.threads=1 "  # M = 20 (the preset), 2 clients train
                            "hydra.run.dir={tmp}/r"], "client-mean acc"),
    "make train 'ARGS=algorithm.K=5 algorithm.mu=0.05 rounds=100 seed=1'": (
        ["ARGS=rounds=1 num_clients=6 logger=none trainer.threads=1 hydra.run.dir={tmp}/r"], "client-mean acc"),  # K <= M
    ".venv/bin/python -m fedfew.train algorithm=ifca partition=dirichlet": (
        [*TINY.split(), "hydra.run.dir={tmp}/r"], "client-mean acc"),
    "make tune DATASET=digits 'ALGORITHMS=fedfew fedavg fedrep' JOBS=2 INSTALL=no": (
        ["ALGORITHMS=fedavg", "TRIALS=1", "TUNE_OUT={tmp}/tune", "INSTALL=no",
         "ARGS=rounds=1 num_clients=4 trainer.threads=1"],
        "presets written to"),
    "make compare DATASET=digits 'ALGORITHMS=fedfew fedavg fedrep' 'SEEDS=0 1 2' JOBS=2": (
        ["SEEDS=0", "COMPARE_OUT={tmp}/compare", "ARGS=rounds=1 num_clients=4"], "compare.md"),  # JOBS=2: one thread each
    "make train 'ARGS=trainer.devices=2 trainer.accelerator=cpu trainer.strategy=ddp'": (
        [f"ARGS={TINY} hydra.run.dir={{tmp}}/r"], "client-mean acc"),
    "make slurm DATASET=agnews DATA_DIR=/data NODES=2 GPUS=4 TIME=04:00:00": (
        ["DATA_DIR={data}", "SLURM_OUT={tmp}/slurm"], "run folder:"),
    "make train 'ARGS=checkpoint_every=10 hydra.run.dir=outputs/my_run'": (
        ["ARGS=rounds=2 num_clients=4 logger=none checkpoint_every=1 trainer.threads=1 hydra.run.dir={tmp}/resumable"], "client-mean acc"),
    "make train 'ARGS=checkpoint_every=10 hydra.run.dir=outputs/my_run resume=auto'": (
        ["ARGS=rounds=2 num_clients=4 logger=none checkpoint_every=1 trainer.threads=1 hydra.run.dir={tmp}/resumable"], "resum"),
}


def merge_args(readme_args: str, cheap_args: str) -> str:
    """The README's ARGS with the cheap ones appended; a key both set keeps the cheap value."""
    cheap_keys = {a.split("=", 1)[0].lstrip("+~") for a in cheap_args.split()}
    kept = [a for a in readme_args.split() if a.split("=", 1)[0].lstrip("+~") not in cheap_keys]
    return " ".join([*kept, *cheap_args.split()])


def cheap_form(command: str, fill: dict[str, str]) -> list[str]:
    """The argv of ``command``'s cheap form (see :data:`CHEAP`)."""
    extra, _ = CHEAP[command]
    extra = [e.format(**fill) for e in extra]
    words = [w.replace("outputs/digits/fedfew/<run>", fill["run"]) for w in shlex.split(command)]
    if words[0] == ".venv/bin/python":
        return [sys.executable, *words[1:], *extra]
    assert words[0] == "make", command
    # this interpreter's environment, never reinstalled (-o: treat the install stamp as up to date)
    argv = make_argv()
    variables = {w.split("=", 1)[0]: w.split("=", 1)[1] for w in words[2:] if "=" in w}
    flags = [e for e in extra if "=" not in e]
    for e in extra:
        if "=" in e:
            key, value = e.split("=", 1)
            variables[key] = merge_args(variables.get(key, ""), value) if key == "ARGS" else value
    return [*argv, *flags, words[1], *(f"{k}={v}" for k, v in variables.items())]


def default_run_table() -> dict[str, tuple[str, str]]:
    """README's "What the default run shows" table: the algorithm each ``make train`` row runs
    (fedfew when it sets none) -> (what that command prints on seed 0, the mean ± std over seeds 0-2)."""
    section = (ROOT / "README.md").read_text().split("## What the default run shows")[1].split("\n## ")[0]
    lines = section.splitlines()
    header = next(i for i, row in enumerate(lines) if row.startswith("| run |"))
    assert lines[header] == "| run | prints (seed 0) | seeds 0-2 |", lines[header]
    table = {}
    for row in lines[header + 2:]:
        if not row.startswith("| `make train"):
            break
        command, printed, seeds = (cell.strip() for cell in row.strip("|").split("|"))
        match = re.search(r"algorithm=(\w+)", command)
        table[match.group(1) if match else "fedfew"] = (printed, seeds)
    return table


def test_default_run_table_shows_what_one_command_prints():
    """Each row says what its one command prints (seed 0: the client mean ± the std over clients,
    as the console writes it) beside the mean ± std over seeds 0-2, and both agree with
    docs/results.md's comparison of the same runs (fedfew, fedavg and oracle with their presets):
    its means and its per-seed differences to fedfew. (What a run prints is checked against the
    fedfew row by tests/test_train_cli.py::test_embedded_default_learns_digits.)"""
    table = default_run_table()
    assert list(table) == ["fedfew", "fedavg", "oracle", "fedfew_reference"]
    for printed, seeds in table.values():
        assert re.fullmatch(r"\d\.\d{4} ± \d\.\d{4}, \[[\d, ]+\].*", printed), printed  # client-mean acc {:.4f} ± {:.4f}
        assert re.fullmatch(r"\d\.\d{3} ± \d\.\d{3}", seeds), seeds
    seed0 = {alg: float(printed.split()[0]) for alg, (printed, _) in table.items()}
    results = (ROOT / "docs" / "results.md").read_text().split("## Digits, clustered")[1].split("\n## ")[0]
    for alg in ("fedfew", "fedavg", "oracle"):
        cells = [c.strip() for c in next(r for r in results.splitlines() if r.startswith(f"| {alg} |")).split("|")]
        mean, std = (float(x) for x in cells[2].split(" ± "))
        assert table[alg][1] == f"{mean:.3f} ± {std:.3f}", alg
        if alg != "fedfew":  # "[0:-0.1817 1:... 2:...]": seed 0's paired difference to fedfew
            delta = float(re.search(r"\[0:([+-][\d.]+)", cells[7]).group(1))
            assert abs(seed0[alg] - seed0["fedfew"] - delta) <= 0.00015, (alg, seed0, delta)


def test_every_readme_command_has_a_cheap_form():
    shown = readme_commands()
    assert set(shown) == set(CHEAP), (
        f"README commands without a cheap form here: {sorted(set(shown) - set(CHEAP))}; "
        f"cheap forms of commands the README no longer shows: {sorted(set(CHEAP) - set(shown))}")


def test_cheap_form_keeps_the_readme_command_and_overrides_its_keys():
    fill = {"run": "/r", "tmp": "/t", "data": "/d"}
    argv = cheap_form("make train 'ARGS=algorithm.K=5 algorithm.mu=0.05 rounds=100 seed=1'", fill)
    assert argv[-2:] == ["train", "ARGS=algorithm.K=5 algorithm.mu=0.05 seed=1 rounds=1 num_clients=6 logger=none "
                                  "trainer.threads=1 "
                                  "hydra.run.dir=/t/r"]
    argv = cheap_form("make compare DATASET=digits 'ALGORITHMS=fedfew fedavg fedrep' 'SEEDS=0 1 2' JOBS=2", fill)
    assert argv[-7:] == ["compare", "DATASET=digits", "ALGORITHMS=fedfew fedavg fedrep", "SEEDS=0", "JOBS=2",
                         "COMPARE_OUT=/t/compare", "ARGS=rounds=1 num_clients=4"]
    argv = cheap_form(".venv/bin/python -m fedfew.reporting.plots 'outputs/digits/fedfew/<run>'", fill)
    assert argv == [sys.executable, "-m", "fedfew.reporting.plots", "/r"]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A 2-round digits run to point the README's ``<run>`` commands at."""
    run = tmp_path_factory.mktemp("readme") / "outputs" / "digits" / "fedfew" / "run"
    proc = subprocess.run([sys.executable, "-m", "fedfew.train", "rounds=2", "num_clients=4", "logger=none",
                           f"hydra.run.dir={run}"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run


def run_cheap(commands: list[str], fill: dict[str, str], path: str) -> str | None:
    """Run the cheap forms of ``commands`` in order; None when each exits 0 and prints what
    :data:`CHEAP` expects, else what went wrong."""
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "PATH": path}
    for command in commands:
        argv = cheap_form(command, fill)
        proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        out = proc.stdout + proc.stderr
        if proc.returncode != 0 or CHEAP[command][1] not in out:
            return (f"README: {command}\nran: {shlex.join(argv)}\nexit {proc.returncode}, expected "
                    f"{CHEAP[command][1]!r} in the output:\n{out[-3000:]}")
    return None


@pytest.mark.slow
def test_readme_commands_run(tmp_path, finished_run, fake_sbatch):
    """Every README command, cheaply, two at a time (each with one torch thread)."""
    data = os.environ.get("FEDFEW_DATA_DIR", "")
    have_data = bool(data) and Path(data, "ag_news_csv").is_dir()
    if not have_data and os.environ.get("FEDFEW_REQUIRE_DATA") == "1":
        pytest.fail("FEDFEW_REQUIRE_DATA=1 but FEDFEW_DATA_DIR has no ag_news_csv/")
    jobs: list[list[str]] = []
    for command in readme_commands():
        if "DATA_DIR" in command and not have_data:
            continue  # needs the real data directory (FEDFEW_DATA_DIR with ag_news_csv/)
        if command.endswith("resume=auto'"):  # continues the run of the command before it, in one job
            first = command.replace(" resume=auto", "")
            jobs = [j for j in jobs if j != [first]] + [[first, command]]
        else:
            jobs.append([command])
    path = f"{fake_sbatch.parent / 'bin'}{os.pathsep}{os.environ['PATH']}"
    fills = [{"run": str(finished_run), "tmp": str(tmp_path / f"job{i}"), "data": data} for i in range(len(jobs))]
    with ThreadPoolExecutor(max_workers=2) as pool:
        failures = [f for f in pool.map(run_cheap, jobs, fills, [path] * len(jobs)) if f]
    assert not failures, "\n\n".join(failures)
    resumable = Path(fills[[i for i, j in enumerate(jobs) if len(j) == 2][0]]["tmp"]) / "resumable"
    assert (resumable / "checkpoints" / "last.ckpt").exists() and (resumable / "results.json").exists()
