"""Run several algorithms on the same partitions and budget and tabulate them (``make compare``).

    python -m fedfew.compare --dataset digits --algorithms fedfew fedavg ifca --seeds 0 1 2 \\
        --out outputs/compare/digits -- rounds=20 data_dir=/path/to/data

Every (algorithm, seed) is one isolated subprocess ``python -m fedfew.train dataset=<dataset>
algorithm=<alg> seed=<seed> <extra overrides> hydra.run.dir=<out>/<alg>/seed<seed>``; the
extra overrides (after ``--``) go to every run, so all algorithms share rounds, local epochs,
batch size, learning rate, clients and partition (the partition is derived from the seed
alone, and its hash is checked to be the same for every algorithm of a seed). A run whose
``results.json`` exists is reused, so an interrupted comparison resumes where it stopped;
reusing results produced with different overrides is refused.

An override for one method's own key (``algorithm.K=5``) fails for the algorithms without that
key; ``++algorithm.K=5`` adds it where missing (ignored there), or compare that method apart.

Written to ``<out>`` (atomically): ``compare.csv`` and ``compare.md``, one row per algorithm:
client-mean accuracy (mean and std over seeds), std across clients, min and max client
accuracy, sample-weighted accuracy (each averaged over seeds), seconds per round, and
parameters sent up and down per participating client per round (from
:meth:`fedfew.algorithms.base.Algorithm.communication`); plus the majority-label baseline of
the same partitions as a reference row. Subprocess output goes to ``<out>/logs/``.
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import math
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from fedfew.io import atomic_write_text

MAJORITY = "majority label"
"""Name of the reference row: every client predicts the most frequent label of its train split."""

CSV_FIELDS = (
    "algorithm", "runs", "acc_mean", "acc_mean_std_over_seeds", "acc_std_across_clients", "acc_min", "acc_max",
    "acc_weighted", "seconds_per_round", "params_up_per_client_round", "params_down_per_client_round",
    "num_parameters", "rounds", "local_epochs", "batch_size", "lr", "num_clients",
)


class CompareError(RuntimeError):
    """The comparison cannot be made as asked (stale results, mismatched partitions)."""


@dataclass(frozen=True)
class Run:
    """One (algorithm, seed) run of a comparison."""

    algorithm: str
    seed: int
    out: Path
    extra: tuple[str, ...] = ()
    dataset: str = "digits"

    @property
    def dir(self) -> Path:
        return self.out / self.algorithm / f"seed{self.seed}"

    @property
    def results_path(self) -> Path:
        return self.dir / "results.json"

    @property
    def log_path(self) -> Path:
        return self.out / "logs" / f"{self.algorithm}_seed{self.seed}.log"

    def overrides(self) -> list[str]:
        """Hydra overrides of the run (the run directory last, so it cannot be overridden)."""
        return [f"dataset={self.dataset}", f"algorithm={self.algorithm}", f"seed={self.seed}", *self.extra,
                f"hydra.run.dir={self.dir}"]

    def task_overrides(self) -> list[str]:
        """The overrides Hydra records in ``.hydra/overrides.yaml`` (all but ``hydra.*``)."""
        return [o for o in self.overrides() if not o.lstrip("+~").startswith("hydra.")]


def recorded_overrides(run: Run) -> list[str] | None:
    """The task overrides a finished run was started with (None when not recorded)."""
    path = run.dir / ".hydra" / "overrides.yaml"
    if not path.exists():
        return None
    from omegaconf import OmegaConf

    return [str(o) for o in OmegaConf.load(path)]


def check_reusable(run: Run) -> None:
    """Raise :class:`CompareError` when ``run``'s results come from different overrides."""
    recorded = recorded_overrides(run)
    if recorded is not None and recorded != run.task_overrides():
        raise CompareError(
            f"{run.results_path} was produced with overrides {recorded}, this comparison asks for "
            f"{run.task_overrides()}; use another --out (OUT=...) or delete {run.dir}"
        )


def execute(run: Run, python: str = sys.executable) -> tuple[bool, float, float]:
    """Train ``run`` in a subprocess (output to its log file).

    Returns:
        (success, wall seconds, CPU seconds of the subprocess: user + system).
    """
    run.log_path.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    command = [python, "-m", "fedfew.train", *run.overrides()]
    with run.log_path.open("w") as log:
        log.write("$ " + " ".join(command) + "\n")
        log.flush()
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        proc.returncode = os.waitstatus_to_exitcode(status)
    ok = proc.returncode == 0 and run.results_path.exists()
    return ok, time.perf_counter() - start, usage.ru_utime + usage.ru_stime


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


_ECHO_LOCK = threading.Lock()


def _echo(line: str) -> None:
    """One whole line to stdout, flushed (progress from several threads, into a log file)."""
    with _ECHO_LOCK:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def run_all(runs: Sequence[Run], jobs: int = 1, python: str = sys.executable,
            echo=_echo) -> dict[Run, str]:
    """Run every run without results (``jobs`` at a time); returns run -> status
    (``reused`` | ``done`` | ``failed``). Stale results raise before anything starts."""
    status: dict[Run, str] = {}
    todo = []
    for run in runs:
        if run.results_path.exists():
            check_reusable(run)
            status[run] = "reused"
        else:
            todo.append(run)
    if status:
        echo(f"reusing {len(status)} finished run(s): " + ", ".join(f"{r.algorithm}/seed{r.seed}" for r in status))

    def one(item: tuple[int, Run]) -> tuple[Run, bool, float, float]:
        i, run = item
        echo(f"[{i}/{len(todo)}] {run.algorithm} seed {run.seed} -> {run.dir}")
        return (run, *execute(run, python))

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        for run, ok, seconds, cpu in pool.map(one, enumerate(todo, 1)):
            status[run] = "done" if ok else "failed"
            if ok:
                acc = json.loads(run.results_path.read_text())["summary"]["acc_mean"]
                echo(f"    {run.algorithm} seed {run.seed}: client-mean acc {acc:.4f} "
                     f"({seconds:.0f} s wall, {cpu:.0f} s CPU)")
            else:
                echo(f"    {run.algorithm} seed {run.seed} FAILED after {seconds:.0f} s; log {run.log_path}:\n"
                     + _tail(run.log_path))
    return status


# -- the table ---------------------------------------------------------------------------------

def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else math.nan


def _std(xs: Sequence[float]) -> float:
    """Sample standard deviation over seeds (nan for fewer than two)."""
    if len(xs) < 2:
        return math.nan
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def _population_std(xs: Sequence[float]) -> float:
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))


_MODEL_CACHE: dict[str, Any] = {}


def build_model(config: dict[str, Any]):
    """A freshly built model of a run's architecture, on the CPU (for parameter counts).

    The model's size can depend on the data (a text model's vocabulary), so the run's data
    is rebuilt once per (dataset, partition, clients, seed, model) and cached.
    """
    key = json.dumps({k: config.get(k) for k in ("dataset", "partition", "num_clients", "seed", "data_dir", "model")},
                     sort_keys=True, default=str)
    if key not in _MODEL_CACHE:
        import torch
        from omegaconf import OmegaConf

        from fedfew.data.federated import build_federated_data
        from fedfew.models import MODELS
        from fedfew.simulation import data_info

        cfg = OmegaConf.create(config)
        info = data_info(build_federated_data(cfg))
        with torch.random.fork_rng(devices=[]):
            _MODEL_CACHE[key] = MODELS.get(cfg.model.name)(cfg.model, info)
    return _MODEL_CACHE[key]


def communication(config: dict[str, Any]) -> tuple[int, int, int]:
    """(params up, params down per participating client per round, d) of a run's config."""
    from omegaconf import OmegaConf

    from fedfew.algorithms import ALGORITHMS

    model = build_model(config)
    alg = ALGORITHMS.get(config["algorithm"]["name"])
    up, down = alg.communication(OmegaConf.create(config["algorithm"]), model)
    return int(up), int(down), sum(p.numel() for p in model.parameters())


def budget(config: dict[str, Any]) -> dict[str, Any]:
    """What every algorithm of a comparison must share."""
    return {
        "rounds": config["rounds"], "local_epochs": config["local_epochs"],
        "batch_size": config["dataset"]["batch_size"], "lr": config["optim"]["lr"],
        "num_clients": config["num_clients"], "participation": config.get("participation"),
        "clients_per_round": config.get("clients_per_round"), "partition": config["partition"],
    }


def summarize(results: dict[tuple[str, int], dict[str, Any]], algorithms: Sequence[str],
              params: dict[tuple[str, int], tuple[int, int, int]] | None = None) -> tuple[list[dict[str, Any]], list[str]]:
    """Table rows (one per algorithm with results, then the majority-label row) and warnings.

    Args:
        results: (algorithm, seed) -> the run's ``results.json``.
        algorithms: row order.
        params: (algorithm, seed) -> (up, down, d); computed from the configs when None.
    Raises:
        CompareError: two algorithms of one seed saw different partitions.
    """
    warnings: list[str] = []
    hashes: dict[int, tuple[str, str]] = {}
    for (alg, seed), res in results.items():
        h = res.get("partition_hash", "")
        if seed in hashes and hashes[seed][1] != h:
            raise CompareError(f"seed {seed}: {alg} and {hashes[seed][0]} were trained on different partitions "
                               f"({h} vs {hashes[seed][1]}); the comparison would be meaningless")
        hashes.setdefault(seed, (alg, h))
    budgets = {json.dumps(budget(r["config"]), sort_keys=True, default=str): key for key, r in results.items()}
    if len(budgets) > 1:
        warnings.append("runs differ in budget (rounds/local epochs/batch/lr/clients/partition): "
                        + "; ".join(f"{a}/seed{s}" for a, s in budgets.values()))
    rows: list[dict[str, Any]] = []
    for alg in algorithms:
        runs = {seed: r for (a, seed), r in sorted(results.items()) if a == alg}
        if not runs:
            continue
        summaries = [r["summary"] for r in runs.values()]
        first = next(iter(runs.values()))
        up, down, d = (params or {}).get((alg, next(iter(runs)))) or communication(first["config"])
        b = budget(first["config"])
        accs = [s["acc_mean"] for s in summaries]
        rows.append({
            "algorithm": alg, "runs": len(runs),
            "acc_mean": _mean(accs), "acc_mean_std_over_seeds": _std(accs),
            "acc_std_across_clients": _mean([s["acc_std"] for s in summaries]),
            "acc_min": _mean([s["acc_min"] for s in summaries]),
            "acc_max": _mean([s["acc_max"] for s in summaries]),
            "acc_weighted": _mean([s["acc_weighted"] for s in summaries]),
            "seconds_per_round": _mean([r["seconds_per_round"] for r in runs.values()]),
            "params_up_per_client_round": up, "params_down_per_client_round": down, "num_parameters": d,
            "rounds": b["rounds"], "local_epochs": b["local_epochs"], "batch_size": b["batch_size"],
            "lr": b["lr"], "num_clients": b["num_clients"],
        })
    # the majority-label baseline of each seed's partition (any algorithm's run of that seed)
    per_seed = {}
    for (alg, seed), r in sorted(results.items()):
        per_seed.setdefault(seed, r)
    if per_seed:
        maj = [[c["majority_acc"] for c in r["clients"]] for r in per_seed.values()]
        means = [_mean(m) for m in maj]
        rows.append({
            "algorithm": MAJORITY, "runs": len(per_seed),
            "acc_mean": _mean(means), "acc_mean_std_over_seeds": _std(means),
            "acc_std_across_clients": _mean([_population_std(m) for m in maj]),
            "acc_min": _mean([min(m) for m in maj]), "acc_max": _mean([max(m) for m in maj]),
            "acc_weighted": _mean([r["summary"]["majority_acc_weighted"] for r in per_seed.values()]),
            "seconds_per_round": math.nan, "params_up_per_client_round": 0, "params_down_per_client_round": 0,
            "num_parameters": 0,
        })
    return rows, warnings


def _fmt(x: Any, digits: int = 4) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return ""
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def to_csv(rows: Sequence[dict[str, Any]]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=CSV_FIELDS, extrasaction="ignore")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: _fmt(row.get(k), 6) for k in CSV_FIELDS})
    return buf.getvalue()


def to_markdown(rows: Sequence[dict[str, Any]], title: str, notes: Sequence[str] = ()) -> str:
    lines = [f"# {title}", ""]
    lines += [
        "| algorithm | client-mean acc | std across clients | min | max | sample-weighted | s / round | "
        "params up / down per client per round |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        acc = f"{r['acc_mean']:.4f}"
        if not math.isnan(r["acc_mean_std_over_seeds"]):
            acc += f" ± {r['acc_mean_std_over_seeds']:.4f}"
        if r["algorithm"] == MAJORITY:
            seconds, comm = "", "(reference)"
        else:
            seconds = f"{r['seconds_per_round']:.2f}"
            comm = f"{r['params_up_per_client_round']:,} / {r['params_down_per_client_round']:,}"
        lines.append(f"| {r['algorithm']} | {acc} | {r['acc_std_across_clients']:.4f} | {r['acc_min']:.4f} | "
                     f"{r['acc_max']:.4f} | {r['acc_weighted']:.4f} | {seconds} | {comm} |")
    lines.append("")
    lines += [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def write_tables(out: Path, rows: Sequence[dict[str, Any]], title: str, notes: Sequence[str] = ()) -> None:
    """``<out>/compare.csv`` and ``<out>/compare.md``, each written atomically."""
    atomic_write_text(out / "compare.csv", to_csv(rows))
    atomic_write_text(out / "compare.md", to_markdown(rows, title, notes))


def describe(rows: Sequence[dict[str, Any]], results: dict[tuple[str, int], dict[str, Any]], dataset: str,
             seeds: Sequence[int]) -> tuple[str, list[str]]:
    """Title and notes of the markdown table (the shared budget and how to read the columns)."""
    cfg = next(iter(results.values()))["config"] if results else {}
    part = cfg.get("partition", {})
    scheme = part.get("name", "?")
    if scheme == "dirichlet":
        scheme += f" alpha={part.get('alpha')}"
    elif scheme == "pathological":
        scheme += f" {part.get('classes_per_client')} classes/client"
    title = f"{dataset}: personalized test accuracy, seeds {' '.join(map(str, seeds))}"
    notes = []
    if cfg:
        d = next((r["num_parameters"] for r in rows if r["algorithm"] != MAJORITY), 0)
        schedule = cfg["optim"].get("schedule", "constant")
        schedule = "" if schedule == "constant" else f" ({schedule} schedule)"
        notes.append(
            f"budget shared by every algorithm: M={cfg['num_clients']} clients ({scheme}), {cfg['rounds']} rounds, "
            f"{cfg['local_epochs']} local epoch(s), batch {cfg['dataset']['batch_size']}, {cfg['optim'].get('name', 'sgd')} lr {cfg['optim']['lr']}"
            f"{schedule}, "
            f"participation {cfg.get('participation')}; model {cfg['model']['name']} with d={d:,} parameters")
    notes += [
        "client-mean acc: mean over clients of each client's test accuracy (final round), mean ± std over seeds; "
        "std/min/max: across clients (averaged over seeds); sample-weighted: total correct / total test samples",
        "params up / down: parameters one participating client sends / receives per round",
        "majority label: each client predicts the most frequent label of its own train split (same partitions)",
    ]
    return title, notes


def collect(runs: Sequence[Run]) -> dict[tuple[str, int], dict[str, Any]]:
    """(algorithm, seed) -> results.json of every finished run."""
    return {(r.algorithm, r.seed): json.loads(r.results_path.read_text()) for r in runs if r.results_path.exists()}


def default_algorithms() -> list[str]:
    """Every registered algorithm, FedFew first."""
    from fedfew.algorithms import ALGORITHMS

    names = ALGORITHMS.names()
    return sorted(names, key=lambda n: (n != "fedfew", n))


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    argv = list(argv)
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    parser = argparse.ArgumentParser(prog="python -m fedfew.compare", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", default="digits", help="dataset config value (default digits)")
    parser.add_argument("--algorithms", nargs="+", default=None,
                        help="algorithm config values (default: every registered algorithm)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0], help="seeds (default 0)")
    parser.add_argument("--out", default=None, help="output folder (default outputs/compare/<dataset>)")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time (default 1)")
    args = parser.parse_args(argv)
    args.extra = [e for e in extra if e.strip()]
    # one string with spaces (make ALGORITHMS="a b") is accepted as well as separate words
    if args.algorithms is not None:
        args.algorithms = [a for item in args.algorithms for a in item.split()]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    algorithms = args.algorithms or default_algorithms()
    from fedfew.algorithms import ALGORITHMS

    for alg in algorithms:
        ALGORITHMS.get(alg)  # unknown names fail here, with the list of known ones
    bad = [e for e in args.extra if e.split("=")[0].lstrip("+~") in ("dataset", "algorithm", "seed", "hydra.run.dir")]
    if bad:
        raise CompareError(f"{bad}: dataset, algorithm, seed and the run directory are set by the comparison "
                           "(use --dataset/--algorithms/--seeds/--out)")
    out = Path(args.out or f"outputs/compare/{args.dataset}").expanduser().resolve()
    runs = [Run(alg, seed, out, tuple(args.extra), args.dataset) for seed in args.seeds for alg in algorithms]
    start = time.perf_counter()
    status = run_all(runs, jobs=args.jobs)
    results = collect(runs)
    rows, warnings = summarize(results, algorithms)
    title, notes = describe(rows, results, args.dataset, args.seeds)
    failed = [f"{r.algorithm}/seed{r.seed}" for r, s in status.items() if s == "failed"]
    if failed:
        warnings.append(f"failed runs (left out; logs in {out / 'logs'}): {', '.join(failed)}")
    write_tables(out, rows, title, [*warnings, *notes])
    print(to_markdown(rows, title, [*warnings, *notes]))
    print(f"wrote {out / 'compare.csv'} and {out / 'compare.md'} ({time.perf_counter() - start:.0f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (CompareError, ValueError) as err:  # stale results, mismatched partitions, unknown names
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
