"""Run several algorithms on the same partitions and seeds and tabulate them (``make compare``).

    python -m fedfew.compare --dataset digits --algorithms fedfew fedavg ifca --seeds 0 1 2 \\
        -- rounds=20 data_dir=/path/to/data     # -> outputs/compare/digits_rounds-20

Every (algorithm, seed) is one isolated subprocess ``python -m fedfew.train dataset=<dataset>
algorithm=<alg> seed=<seed> ~tuned <preset values> <extra overrides> hydra.run.dir=<out>/<alg>/seed<seed>``.
Each method gets its own tuned preset (``make tune``; docs/tuning.md): by default the one in a
setup folder ``conf/tuned/<dataset><setup>/`` tuned for exactly the runs' setup, else
``conf/tuned/<dataset>_<alg>.yaml`` when it exists; with ``--presets DIR`` the one in DIR
instead (a preset tuned for another setup), with ``--presets none`` none; its values are passed
as explicit overrides, so a changed preset is never mistaken for a finished run. The extra
overrides (after ``--``) go to every run and win over the presets. The partition is derived
from the seed alone, and its hash is checked to be the same for every algorithm of a seed. A run
whose ``results.json`` exists is reused, so an interrupted comparison resumes where it stopped;
reusing results produced with different overrides is refused (a thread count, logger or
``data_dir`` does not count: :func:`fedfew.experiments.run_folders.result_overrides`), and so is reusing results made
from other data: the data in the runs' ``data_dir`` must have the fingerprint the results record
(:mod:`fedfew.data.fingerprint`), so committed runs are reused from a clone anywhere with the data
anywhere. A run that was cut short continues from its last checkpoint (every 5 rounds,
:mod:`fedfew.experiments.launch`). User guide: docs/compare.md. compare.md and compare.csv name presets
relative to the repository and the data folder as ``<data_dir>`` (:func:`fedfew.experiments.run_folders.portable_path`).

An override for one method's own key (``algorithm.K=5``) fails for the algorithms without that
key; ``++algorithm.K=5`` adds it where missing (ignored there), or compare that method apart.

Written to ``<out>`` (atomically; :func:`summarize` defines every column):

- ``compare.csv``: one row per algorithm, then the majority-label row: over seeds the mean and
  (sample) std of ``acc_mean``, ``acc_weighted`` and ``acc_min`` at the reported round and as the
  mean of the last three evaluations (``*_last3``); balanced accuracy and macro-F1; the paired
  per-seed difference of ``acc_mean`` against the reference method (fedfew: ``diff_*``); the
  budget actually used (rounds, local SGD steps, server models, bytes up and down per round and
  per participating client per round, d); the learning rate and own keys of each method; per seed,
  how many clients' scored models diverged (``diverged_clients_per_seed``, "seed:count" where not 0).
- ``compare.md``: the same as two tables plus notes (what every method shared and what differs,
  the presets, whether fedfew is first, the protocol; ``reference`` is labelled OPTIMISTIC).
- ``accuracy_rounds.png`` and ``accuracy_bytes.png``: client-mean accuracy against rounds and
  against cumulative bytes communicated (up + down), one line per method (mean over seeds) with
  a band (mean +- std over seeds), the majority label dotted.

Subprocess output goes to ``<out>/logs/``.
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import math
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from fedfew.core.checkpoint import checkpoint_path
from fedfew.core.io import atomic_write_text
from fedfew.experiments.launch import (FAILED_RESULTS, Busy, check_not_training, exclusive, launch, outcome, progress,
                           recorded_overrides, refused_checkpoint, tidy)
from fedfew.core.nonfinite import DIVERGED_EXIT
from fedfew.reporting.partition_report import partition_scheme
from fedfew.experiments.run_folders import data_mismatch, diverged_clients, portable_command, portable_path, python_command

MAJORITY = "majority label"
"""Name of the reference row: every client predicts the most frequent label of its train split."""

#: the accuracy figures spread over seeds (each at the reported round and as ``*_last3``)
METRICS = ("acc_mean", "acc_weighted", "acc_min")
LAST = 3  # evaluations averaged in the *_last3 figures

CSV_FIELDS = (
    "algorithm", "seeds",
    "acc_mean", "acc_mean_std", "acc_weighted", "acc_weighted_std", "acc_min", "acc_min_std",
    "acc_mean_last3", "acc_mean_last3_std", "acc_weighted_last3", "acc_weighted_last3_std",
    "acc_min_last3", "acc_min_last3_std",
    "diff_acc_mean", "diff_acc_mean_std", "diff_acc_mean_per_seed", "diff_acc_mean_last3", "diff_acc_mean_last3_std",
    "diff_reference", "diff_seeds",
    "acc_std_across_clients", "acc_max", "balanced_acc_mean", "macro_f1_mean", "assignment_ari", "models_in_use",
    "diverged_clients_per_seed", "protocol", "optimistic",
    "rounds", "local_steps", "server_models", "bytes_up_per_round", "bytes_down_per_round",
    "bytes_up_per_client_round", "bytes_down_per_client_round", "params_up_per_client_round",
    "params_down_per_client_round", "num_parameters", "participants_per_round",
    "seconds_per_round", "wall_time_s", "lr", "hyperparameters", "preset",
    "local_epochs", "batch_size", "num_clients",
)


class CompareError(RuntimeError):
    """The comparison cannot be made as asked (stale results, mismatched partitions, a
    missing presets folder)."""


@dataclass(frozen=True)
class Run:
    """One (algorithm, seed) run of a comparison.

    Attributes:
        preset: the method's preset as overrides (``~tuned`` and its values), before ``extra``.
        preset_source: where the preset came from (a path, or "" for none).
        data_dir: the data folder the run reads (its config's ``data_dir``), against whose content
            a run folder found finished or checkpointed is checked before it is reused
            (:func:`check_reusable`); "" skips that check.
    """

    algorithm: str
    seed: int
    out: Path
    extra: tuple[str, ...] = ()
    dataset: str = "digits"
    preset: tuple[str, ...] = ()
    preset_source: str = ""
    data_dir: str = ""

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
        return [f"dataset={self.dataset}", f"algorithm={self.algorithm}", f"seed={self.seed}", *self.preset,
                *self.extra, f"hydra.run.dir={self.dir}"]

    def task_overrides(self) -> list[str]:
        """The overrides Hydra records in ``.hydra/overrides.yaml`` (all but ``hydra.*``)."""
        return [o for o in self.overrides() if not o.lstrip("+~").startswith("hydra.")]


def preset_for(dataset: str, algorithm: str, presets: str | None, extra: Sequence[str],
               cfg: Any = None) -> tuple[tuple[str, ...], str]:
    """The preset overrides of one method and their source.

    Args:
        presets: None (``conf/tuned``), ``"none"`` (no preset) or a folder of
            ``<dataset>_<algorithm>.yaml`` files (``make tune``'s ``<out>/presets``).
        extra: the comparison's extra overrides; a preset key they set is left out (they win).
        cfg: the runs' config, with ``presets`` None: a preset in a setup folder
            ``conf/tuned/<dataset><setup>/`` whose ``# setup:`` line matches it
            (:func:`fedfew.tune.preset_matches`) wins over ``conf/tuned/<dataset>_<algorithm>.yaml``.
    Returns:
        (``("~tuned", "optim.lr=...", ...)``, the preset's path or "").
    """
    from fedfew.tune import TUNED_DIR, fixed_keys, preset_matches, preset_overrides, setup_preset

    if presets == "none":
        return ("~tuned",), ""
    name = f"{dataset}_{algorithm}.yaml"
    path = (Path(presets).expanduser().resolve() if presets else TUNED_DIR) / name
    if not presets and cfg is not None and not (path.is_file() and preset_matches(path, cfg)):
        path = setup_preset(name, cfg) or path
    if not path.is_file():
        return ("~tuned",), ""
    fixed = fixed_keys(extra)
    values = [o for o in preset_overrides(path) if o.split("=", 1)[0] not in fixed]
    return ("~tuned", *values), str(path)


def preset_score(path: str) -> str:
    """The ``best validation score`` line of a preset's header ("" when absent or no preset)."""
    from fedfew.tune import preset_header

    return preset_header(path).get("best validation score", "").split(";")[0].strip() if path else ""


def setup_mismatch(rows: Sequence[dict[str, Any]], config: dict[str, Any]) -> str | None:
    """A note when some methods' presets were tuned for another setup than the runs'
    (:func:`fedfew.tune.preset_matches`: the header's ``# setup:`` against the runs' config): the
    values were chosen on that setup's validation split and may not suit this one (docs/tuning.md).
    None when every preset matches, or no method has one."""
    from omegaconf import OmegaConf

    from fedfew.tune import describe_setup, preset_header, preset_matches

    cfg = OmegaConf.create(config)
    other: dict[str, list[str]] = {}
    for row in rows:
        path = row.get("preset") or ""
        if path and preset_matches(path, cfg) is False:  # None: the preset records no setup
            other.setdefault(preset_header(path).get("tuned for") or "?", []).append(row["algorithm"])
    if not other:
        return None
    return ("presets tuned for another setup than these runs' (" + describe_setup(cfg) + "): "
            + "; ".join(f"{', '.join(algs)} for {setup}" for setup, algs in other.items())
            + "; their values were chosen on that setup's validation split, the same way for every method")


def check_reusable(run: Run) -> str:
    """How far ``run`` got (:func:`fedfew.experiments.launch.progress`: ``done``, ``checkpoint`` or ``none``).

    A run folder is this run's when it was made with the same overrides, up to those that do not
    change results (:func:`fedfew.experiments.run_folders.result_overrides`: another thread count, e.g. JOBS=1 after
    JOBS=2, or another ``data_dir``), and from the same data: the data in ``run.data_dir`` has the
    fingerprint its results or checkpoint record (:func:`fedfew.experiments.run_folders.data_mismatch`; for a run
    recorded before the fingerprint, the same partition hash). So runs made in another folder or
    on another machine, the data elsewhere, are reused.

    Raises:
        CompareError: its results or checkpoint come from different overrides, or from other data
            (the message names both fingerprints or partition hashes), or the data in
            ``run.data_dir`` cannot be read to tell.
        Busy: a live process still trains it (:func:`fedfew.experiments.launch.check_not_training`).
    """
    from fedfew.experiments.run_folders import result_overrides

    check_not_training(run.dir)
    state = progress(run.dir, run.task_overrides())
    what = run.results_path if run.results_path.exists() else f"the checkpoint in {run.dir}"
    if state == "stale":
        raise CompareError(
            f"{what} was produced with overrides {result_overrides(recorded_overrides(run.dir) or [])}, this "
            f"comparison asks for {result_overrides(run.task_overrides())}; use another --out (COMPARE_OUT=...) "
            f"or delete {run.dir}"
        )
    if state != "none" and run.data_dir:
        try:
            why = data_mismatch(run.dir, run.data_dir)
        except (OSError, ValueError) as err:  # DataNotFoundError, a malformed file, a partition that fails
            raise CompareError(f"cannot tell whether {what} was made from the data this comparison reads: "
                               f"{type(err).__name__}: {err}") from err
        if why:
            raise CompareError(
                f"{what} was made from other data than this comparison reads ({why}); a run is reused on the "
                f"same data only, wherever that lies: point data_dir at the data it was made from, use another "
                f"--out (COMPARE_OUT=...) or delete {run.dir}"
            )
    return state


def execute(run: Run, python: str = sys.executable) -> tuple[str, float, float, bool]:
    """Train ``run`` in a subprocess (output to its log file), from its checkpoint when it has
    one (:func:`fedfew.experiments.launch.launch`).

    Returns:
        (``done`` | ``failed`` | ``interrupted`` (stopped by a signal: its checkpoint is kept), wall
        seconds, CPU seconds of the subprocess: user + system, whether it resumed).
    """
    code, wall, cpu, resumed = launch(run.overrides(), run.dir, run.log_path, (python, "-m", "fedfew.train"))
    return outcome(code, run.dir), wall, cpu, resumed


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
    """Run every run without results (``jobs`` at a time; one with a checkpoint continues from
    it); returns run -> status (``reused`` | ``done`` | ``failed`` | ``interrupted``). Stale results
    or checkpoints raise before anything starts."""
    status: dict[Run, str] = {}
    todo = []
    for run in runs:
        if check_reusable(run) == "done":
            tidy(run.dir, run.overrides())  # finished by a run a killed comparison left behind
            status[run] = "reused"
        else:
            todo.append(run)
    if status:
        echo(f"reusing {len(status)} finished run(s): " + ", ".join(f"{r.algorithm}/seed{r.seed}" for r in status))

    def one(item: tuple[int, Run]) -> tuple[Run, str, float, float, bool]:
        i, run = item
        cont = " (continuing from its checkpoint)" if checkpoint_path(run.dir).is_file() else ""
        echo(f"[{i}/{len(todo)}] {run.algorithm} seed {run.seed} -> {run.dir}{cont}")
        return (run, *execute(run, python))

    pool = ThreadPoolExecutor(max_workers=max(1, jobs))
    try:
        for future in [pool.submit(one, item) for item in enumerate(todo, 1)]:
            run, state, seconds, cpu, resumed = future.result()
            status[run] = state
            if state == "done":
                acc = json.loads(run.results_path.read_text())["summary"]["acc_mean"]
                part = " for its last part" if resumed else ""
                echo(f"    {run.algorithm} seed {run.seed}: client-mean acc {acc:.4f} "
                     f"({seconds:.0f} s wall, {cpu:.0f} s CPU{part})")
            elif state == "diverged":
                stopped_at = json.loads(run.results_path.read_text()).get("nonfinite", {}).get("stopped_at")
                echo(f"    {run.algorithm} seed {run.seed}: DIVERGED, every client non-finite, stopped after round "
                     f"{stopped_at} (exit code {DIVERGED_EXIT}); in the table, named in its warnings")
            elif state == "interrupted":
                echo(f"    {run.algorithm} seed {run.seed} was stopped by a signal after {seconds:.0f} s; its "
                     f"checkpoint is kept: run the same command again to continue it")
            else:
                hint = (f"\n    fedfew.train refused to continue from {checkpoint_path(run.dir)} (the log says why); "
                        f"delete {run.dir / 'checkpoints'} to start the run afresh") if refused_checkpoint(run.log_path) else ""
                if (run.dir / FAILED_RESULTS).exists():
                    hint += f"\n    (it failed after writing its results: kept as {run.dir / FAILED_RESULTS}, not used)"
                echo(f"    {run.algorithm} seed {run.seed} FAILED after {seconds:.0f} s; log {run.log_path}:\n"
                     + _tail(run.log_path) + hint)
    except BaseException:  # Ctrl-C: start no queued run (the running ones save a checkpoint and stop)
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()
    return status


# -- the table ---------------------------------------------------------------------------------

def _mean(xs: Sequence[float]) -> float:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else math.nan


def _std(xs: Sequence[float]) -> float:
    """Sample standard deviation over seeds (ddof = 1; nan for fewer than two)."""
    if len(xs) < 2:
        return math.nan
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def _population_std(xs: Sequence[float]) -> float:
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))


_MODEL_CACHE: dict[str, Any] = {}


def build_model(config: dict[str, Any]):
    """A freshly built model of a run's architecture, on the CPU (for parameter counts of
    results written before results.json held its ``budget``).

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
        from fedfew.core.simulation import data_info

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


def run_budget(result: dict[str, Any]) -> dict[str, Any]:
    """A run's ``budget`` (results.json; rebuilt from its config for older results: bytes at 4
    per parameter, local steps unknown)."""
    if "budget" in result:
        return result["budget"]
    cfg = result["config"]
    up, down, d = communication(cfg)
    per_round = int(cfg.get("clients_per_round") or max(1, round(float(cfg.get("participation", 1.0)) * cfg["num_clients"])))
    return {"rounds": cfg["rounds"], "server_models": None, "num_parameters": d, "participants_per_round": per_round,
            "params_up_per_client_round": up, "params_down_per_client_round": down, "bytes_per_parameter": 4.0,
            "bytes_up_per_client_round": 4 * up, "bytes_down_per_client_round": 4 * down,
            "bytes_up_per_round": 4 * up * per_round, "bytes_down_per_round": 4 * down * per_round,
            "local_steps": None}


def shared_budget(config: dict[str, Any]) -> dict[str, Any]:
    """What every algorithm of a comparison must share (the learning rate and each method's
    own keys are tuned per method, so they are listed per method instead)."""
    return {
        "rounds": config["rounds"], "local_epochs": config["local_epochs"],
        "batch_size": config["dataset"]["batch_size"], "optimizer": config["optim"].get("name", "sgd"),
        "schedule": config["optim"].get("schedule", "constant"),
        "num_clients": config["num_clients"], "participation": config.get("participation"),
        "clients_per_round": config.get("clients_per_round"), "partition": config["partition"],
        "model": config.get("model", {}).get("name"), "eval": config.get("eval"),
    }


def own_keys(config: dict[str, Any]) -> str:
    """A method's own settings as ``key=value, ...``: ``K`` when its config defines it (an ``++algorithm.K``
    reaches every method's node, also those that have no K) and the keys ``make tune`` searches for
    it (conf/tune/<algorithm>.yaml); every key of its ``algorithm`` node but the name when it has no
    search space."""
    from omegaconf import OmegaConf

    from fedfew.tune import CONFIG_DIR, TuneError, load_space

    node = config.get("algorithm", {})
    name = node.get("name", "")
    source = CONFIG_DIR / "algorithm" / f"{name}.yaml"
    has_k = source.is_file() and "K" in OmegaConf.load(source)
    try:
        searched = {d.key.split(".", 1)[1] for d in load_space(name) if d.key.startswith("algorithm.")}
        keys = [k for k in node if (k == "K" and has_k) or k in searched]
    except TuneError:
        keys = [k for k in node if k != "name" and (k != "K" or has_k)]
    return ", ".join(f"{k}={node[k]}" for k in keys)


def seed_metrics(result: dict[str, Any]) -> dict[str, float]:
    """One run's figures: :data:`METRICS` at the reported round and as the mean over its last
    :data:`LAST` evaluations (``*_last3``), plus balanced accuracy, macro-F1, ARI."""
    s = result["summary"]
    evals = result.get("evaluations") or [s]
    tail = evals[-LAST:]
    out = {m: float(s[m]) for m in METRICS}
    out.update({f"{m}_last3": _mean([float(e[m]) for e in tail if m in e]) for m in METRICS})
    for key in ("balanced_acc_mean", "macro_f1_mean", "assignment_ari", "models_in_use"):
        out[key] = float(s[key]) if key in s else None
    out["diverged_clients"], out["num_clients"] = len(diverged_clients(result)), len(result.get("clients", []))
    return out


def majority_metrics(result: dict[str, Any]) -> dict[str, float]:
    """The majority-label baseline of a run's partition as the same figures (constant over rounds)."""
    maj = [c["majority_acc"] for c in result["clients"]]
    out = {"acc_mean": _mean(maj), "acc_weighted": float(result["summary"]["majority_acc_weighted"]), "acc_min": min(maj)}
    out.update({f"{m}_last3": out[m] for m in METRICS})
    out["acc_std_across_clients"], out["acc_max"] = _population_std(maj), max(maj)
    return out


def below_majority(figures: dict[str, dict[int, dict[str, Any]]]) -> list[str]:
    """One warning per method whose client-mean accuracy on some seed is below the majority-label
    baseline's on that seed (each client predicting the most frequent label of its own train
    split): the method learned less than that, most often because its lr diverges on this setup
    (a preset tuned for another partition, say).

    Args:
        figures: algorithm (and :data:`MAJORITY`) -> seed -> :func:`seed_metrics` figures.
    """
    majority = figures.get(MAJORITY, {})
    out = []
    for alg, per_seed in figures.items():
        below = [f"seed {s}: {f['acc_mean']:.4f} < {majority[s]['acc_mean']:.4f}" for s, f in sorted(per_seed.items())
                 if alg != MAJORITY and s in majority and f["acc_mean"] < majority[s]["acc_mean"]]
        if below:
            out.append(f"**{alg} is below the majority label** ({'; '.join(below)}): it learned less than each client "
                       "predicting its most frequent train label; look at its train_loss in metrics.csv (a diverging "
                       "lr?) before reading its row")
    return out


def diverged_runs(figures: dict[str, dict[int, dict[str, Any]]]) -> list[str]:
    """One warning per method with clients whose scored model diverged on some seed
    (:func:`fedfew.experiments.run_folders.diverged_clients`): those clients predict one class, and the method's row
    averages them in, so its figures measure its preset's stability as much as the method.

    Args:
        figures: algorithm -> seed -> :func:`seed_metrics` figures.
    """
    out = []
    for alg, per_seed in figures.items():
        hit = [f"seed {s}: {f['diverged_clients']} of {f['num_clients']} clients" for s, f in sorted(per_seed.items())
               if f.get("diverged_clients")]
        if hit:
            out.append(f"**{alg} diverged** ({'; '.join(hit)}): those clients' scored models have a non-finite loss and "
                       "predict one class; its row counts them (train_loss in its metrics.csv shows when)")
    return out


def paired(values: dict[int, float], reference: dict[int, float]) -> dict[int, float]:
    """Per-seed differences ``values[s] - reference[s]`` over the seeds both have (the same
    partition, initialisation and participation streams)."""
    return {s: values[s] - reference[s] for s in sorted(values) if s in reference}


def summarize(results: dict[tuple[str, int], dict[str, Any]], algorithms: Sequence[str],
              reference: str | None = "fedfew",
              presets: dict[str, str] | None = None) -> tuple[list[dict[str, Any]], list[str]]:
    """Table rows (one per algorithm with results, then the majority-label row) and warnings.

    Per algorithm, over its seeds: the mean and sample std (ddof 1; nan for one seed) of
    :data:`METRICS` at the reported round (``acc_mean``, ``acc_mean_std``, ...) and as the mean
    of the last three evaluations (``acc_mean_last3``, ``acc_mean_last3_std``, ...); the paired
    difference of ``acc_mean`` (and ``acc_mean_last3``) against ``reference``: per seed
    (``diff_acc_mean_per_seed``, "seed:value" pairs), their mean and sample std; the budget of
    its runs (results.json ``budget``: rounds, local SGD steps (mean over seeds), server models,
    bytes per round and per participating client per round, d); lr, own keys and preset; the
    seeds where clients' scored models diverged, as "seed:count" (``diverged_clients_per_seed``,
    :func:`fedfew.experiments.run_folders.diverged_clients`). Warnings: runs that differ in what every method shares,
    a method below the majority label on some seed (:func:`below_majority`), and one that diverged
    (:func:`diverged_runs`).

    Args:
        results: (algorithm, seed) -> the run's ``results.json``.
        algorithms: row order.
        reference: the method every other is paired against (None or absent: no differences).
        presets: algorithm -> the preset file its runs used ("" for none).
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
    budgets = {json.dumps(shared_budget(r["config"]), sort_keys=True, default=str): key for key, r in results.items()}
    if len(budgets) > 1:
        warnings.append("runs differ in what every method should share (rounds/local epochs/batch/optimizer/"
                        "clients/partition/model/evaluation): " + "; ".join(f"{a}/seed{s}" for a, s in budgets.values()))
    per_alg: dict[str, dict[int, dict[str, Any]]] = {}
    for (alg, seed), r in sorted(results.items()):
        per_alg.setdefault(alg, {})[seed] = r
    figures = {alg: {seed: seed_metrics(r) for seed, r in runs.items()} for alg, runs in per_alg.items()}
    majority_runs = {}
    for (alg, seed), r in sorted(results.items()):
        majority_runs.setdefault(seed, r)
    figures[MAJORITY] = {seed: majority_metrics(r) for seed, r in majority_runs.items()}
    ref = figures.get(reference) if reference else None
    warnings += below_majority(figures) + diverged_runs(figures)

    def spread(row: dict[str, Any], figs: dict[int, dict[str, Any]]) -> None:
        for m in METRICS:
            for key in (m, f"{m}_last3"):
                vals = [f[key] for f in figs.values()]
                row[key], row[f"{key}_std"] = _mean(vals), _std(vals)
        if ref is not None:
            for key in ("acc_mean", "acc_mean_last3"):
                diff = paired({s: f[key] for s, f in figs.items()}, {s: f[key] for s, f in ref.items()})
                row[f"diff_{key}"], row[f"diff_{key}_std"] = _mean(list(diff.values())), _std(list(diff.values()))
                if key == "acc_mean":
                    row["diff_acc_mean_per_seed"] = " ".join(f"{s}:{d:+.4f}" for s, d in diff.items())
                    row["diff_seeds"] = len(diff)
            row["diff_reference"] = reference

    rows: list[dict[str, Any]] = []
    for alg in algorithms:
        runs = per_alg.get(alg)
        if not runs:
            continue
        first = next(iter(runs.values()))
        cfg = first["config"]
        spent = [run_budget(r) for r in runs.values()]
        b = spent[0]
        steps = [x.get("local_steps") for x in spent]
        summaries = [r["summary"] for r in runs.values()]
        row: dict[str, Any] = {
            "algorithm": alg, "seeds": len(runs),
            "acc_std_across_clients": _mean([s["acc_std"] for s in summaries]),
            "acc_max": _mean([s["acc_max"] for s in summaries]),
            "balanced_acc_mean": _mean([f["balanced_acc_mean"] for f in figures[alg].values()]),
            "macro_f1_mean": _mean([f["macro_f1_mean"] for f in figures[alg].values()]),
            "assignment_ari": _mean([f["assignment_ari"] for f in figures[alg].values()]),
            "models_in_use": _mean([f["models_in_use"] for f in figures[alg].values()]),
            "protocol": summaries[0].get("protocol", "final"), "optimistic": bool(summaries[0].get("optimistic", False)),
            "rounds": b["rounds"], "local_steps": None if None in steps else _mean(steps),
            "server_models": b.get("server_models"),
            **{k: b.get(k) for k in ("bytes_up_per_round", "bytes_down_per_round", "bytes_up_per_client_round",
                                     "bytes_down_per_client_round", "params_up_per_client_round",
                                     "params_down_per_client_round", "num_parameters", "participants_per_round")},
            "seconds_per_round": _mean([r["seconds_per_round"] for r in runs.values()]),
            "wall_time_s": _mean([r.get("wall_time_s") for r in runs.values()]),
            "lr": cfg["optim"]["lr"], "hyperparameters": own_keys(cfg),
            "preset": (presets or {}).get(alg, ""),
            "local_epochs": cfg["local_epochs"], "batch_size": cfg["dataset"]["batch_size"],
            "num_clients": cfg["num_clients"],
        }
        row["diverged_clients_per_seed"] = " ".join(f"{s}:{f['diverged_clients']}" for s, f in figures[alg].items()
                                                    if f["diverged_clients"])
        spread(row, figures[alg])
        rows.append(row)
    if majority_runs:
        maj = figures[MAJORITY]
        row = {"algorithm": MAJORITY, "seeds": len(maj),
               "acc_std_across_clients": _mean([f["acc_std_across_clients"] for f in maj.values()]),
               "acc_max": _mean([f["acc_max"] for f in maj.values()]),
               "bytes_up_per_round": 0, "bytes_down_per_round": 0, "local_steps": 0, "server_models": 0}
        spread(row, maj)
        rows.append(row)
    return rows, warnings


def _fmt(x: Any, digits: int = 4) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return ""
    if isinstance(x, bool):
        return "true" if x else "false"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def to_csv(rows: Sequence[dict[str, Any]]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=CSV_FIELDS, extrasaction="ignore")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: _fmt(portable_path(row[k]) if k == "preset" and row.get(k) else row.get(k), 6)
                         for k in CSV_FIELDS})
    return buf.getvalue()


def _pm(row: dict[str, Any], key: str) -> str:
    """``mean ± std`` of one figure (the std only with two seeds or more)."""
    value = row.get(key)
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    std = row.get(f"{key}_std")
    return f"{value:.4f}" + ("" if std is None or math.isnan(std) else f" ± {std:.4f}")


def _mb(value: Any) -> str:
    return "" if value is None else f"{value / 1e6:.3f}"


def to_markdown(rows: Sequence[dict[str, Any]], title: str, notes: Sequence[str] = ()) -> str:
    """compare.md: an accuracy table (mean ± std over seeds; the paired difference against the
    reference method), a budget table, then the notes."""
    ref = next((r.get("diff_reference") for r in rows if r.get("diff_reference")), None)
    lines = [f"# {title}", ""]
    if any(r.get("optimistic") for r in rows):
        lines += ["**OPTIMISTIC: protocol `reference` reports the best evaluation round on the test data "
                  "(as the reference code does); these figures flatter every method.**", ""]
    lines += [
        "| algorithm | client-mean acc | last 3 evals | sample-weighted | worst client | worst, last 3 | "
        + (f"Δ vs {ref} (paired, per seed) | " if ref else "") + "balanced acc | macro-F1 | ARI |",
        "|---|---|---|---|---|---|" + ("---|" if ref else "") + "---|---|---|",
    ]
    for r in rows:
        diff = ""
        if ref:
            if r["algorithm"] != ref and r.get("diff_seeds"):
                std = r.get("diff_acc_mean_std")
                diff = f"{r['diff_acc_mean']:+.4f}" + ("" if std is None or math.isnan(std) else f" ± {std:.4f}")
                diff += f" [{r['diff_acc_mean_per_seed']}]"
            diff = diff + " | "
        lines.append(f"| {r['algorithm']} | {_pm(r, 'acc_mean')} | {_pm(r, 'acc_mean_last3')} | {_pm(r, 'acc_weighted')} | "
                     f"{_pm(r, 'acc_min')} | {_pm(r, 'acc_min_last3')} | {diff}{_fmt(r.get('balanced_acc_mean'))} | "
                     f"{_fmt(r.get('macro_f1_mean'))} | {_fmt(r.get('assignment_ari'), 2)} |")
    lines += ["", "| algorithm | lr | own keys | rounds | local SGD steps | server models | MB up / down per round | "
                  "s / round |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["algorithm"] == MAJORITY:
            continue
        steps = "" if r.get("local_steps") is None else f"{r['local_steps']:,.0f}"
        lines.append(f"| {r['algorithm']} | {_fmt(r.get('lr'), 4)} | {r.get('hyperparameters', '')} | {r.get('rounds')} | "
                     f"{steps} | {_fmt(r.get('server_models'))} | {_mb(r.get('bytes_up_per_round'))} / "
                     f"{_mb(r.get('bytes_down_per_round'))} | {_fmt(r.get('seconds_per_round'), 2)} |")
    lines.append("")
    lines += [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def ranking_note(rows: Sequence[dict[str, Any]], reference: str | None) -> str | None:
    """Whether the reference method (fedfew) is first on client-mean accuracy, said plainly."""
    ranked = sorted((r for r in rows if r["algorithm"] != MAJORITY), key=lambda r: -r["acc_mean"])
    names = [r["algorithm"] for r in ranked]
    if not reference or reference not in names or len(names) < 2:
        return None
    place = names.index(reference)

    def gap(row: dict[str, Any]) -> str:
        """``name acc (paired row - reference: mean ± std over seeds[, within one std])``."""
        d, sd = row.get("diff_acc_mean"), row.get("diff_acc_mean_std")
        text = f"{row['algorithm']} {row['acc_mean']:.4f}"
        if d is None or sd is None or math.isnan(sd):
            return text
        return text + f" (paired - {reference}: {d:+.4f} ± {sd:.4f}" + (", within one std)" if abs(d) <= sd else ")")

    if place == 0:
        return f"{reference} is first on client-mean accuracy ({ranked[0]['acc_mean']:.4f}; next: {gap(ranked[1])})"
    return (f"**{reference} is not first**: it ranks {place + 1} of {len(names)} on client-mean accuracy "
            f"({ranked[place]['acc_mean']:.4f}); ahead of it: {', '.join(gap(r) for r in ranked[:place])}")


def write_tables(out: Path, rows: Sequence[dict[str, Any]], title: str, notes: Sequence[str] = (),
                 suffix: str = "") -> list[Path]:
    """``<out>/compare<suffix>.csv`` and ``<out>/compare<suffix>.md``, each written atomically;
    returns their paths."""
    paths = [out / f"compare{suffix}.csv", out / f"compare{suffix}.md"]
    atomic_write_text(paths[0], to_csv(rows))
    atomic_write_text(paths[1], to_markdown(rows, title, notes))
    return paths


def also_protocols(results: dict[tuple[str, int], dict[str, Any]]) -> list[str]:
    """The ``eval.also`` protocols that every run of ``results`` was scored under (results.json
    ``also``), in the runs' order."""
    found = [list((r.get("also") or {}).keys()) for r in results.values()]
    return [p for p in found[0] if all(p in f for f in found[1:])] if found else []


def protocol_view(result: dict[str, Any], protocol: str) -> dict[str, Any]:
    """``result`` (one results.json) as a run of ``protocol`` would have reported it: its
    ``also[protocol]`` summary, clients and evaluations in place of the run's own; the rest
    (config, budget, timings) is the run's.

    Raises:
        KeyError: the run was not scored under ``protocol`` (not in its ``eval.also``).
    """
    scored = result["also"][protocol]
    return {**result, "summary": scored["summary"], "clients": scored["clients"], "evaluations": scored["evaluations"]}


def describe(rows: Sequence[dict[str, Any]], results: dict[tuple[str, int], dict[str, Any]], dataset: str,
             seeds: Sequence[int], reference: str | None = "fedfew") -> tuple[str, list[str]]:
    """Title and notes of the markdown table: what every method shared, what differs (lr,
    own keys, presets), the ranking, and how to read the columns."""
    cfg = next(iter(results.values()))["config"] if results else {}
    part = cfg.get("partition", {})
    scheme = partition_scheme(part) if part else "?"
    protocol = next((r.get("protocol") for r in rows if r.get("protocol")), "final")
    title = (f"{dataset}: personalized test accuracy, protocol {protocol}"
             + (" (OPTIMISTIC)" if any(r.get("optimistic") for r in rows) else "")
             + f", seeds {' '.join(map(str, seeds))}")
    notes = []
    ranking = ranking_note(rows, reference)
    if ranking:
        notes.append(ranking)
    if cfg:
        d = next((r.get("num_parameters") for r in rows if r["algorithm"] != MAJORITY and r.get("num_parameters")), 0)
        schedule = cfg["optim"].get("schedule", "constant")
        schedule = "" if schedule == "constant" else f" ({schedule} schedule)"
        ev = cfg.get("eval") or {}
        finetune = f" ({ev.get('finetune_epochs')} fine-tuning epoch(s))" if protocol in ("finetune", "reference") else ""
        notes.append(
            f"shared by every method: M={cfg['num_clients']} clients, {scheme}, {cfg['rounds']} rounds, "
            f"{cfg['local_epochs']} local epoch(s), batch {cfg['dataset']['batch_size']}, local optimizer "
            f"{cfg['optim'].get('name', 'sgd')}{schedule}, participation {cfg.get('participation')}, model "
            f"{cfg['model']['name']} with d={d:,} parameters, protocol {protocol}{finetune}, the same seeds and partitions")
    differs = []
    for r in rows:
        if r["algorithm"] == MAJORITY:
            continue
        source = r.get("preset") or ""
        score = preset_score(source)
        where = (f"tuned preset {portable_path(source)}" + (f", best validation acc {score}" if score else "")
                 if source else "no preset: config defaults")
        differs.append(f"{r['algorithm']}: lr {r.get('lr')}; {r.get('hyperparameters') or '(no own keys)'} ({where})")
    mismatch = setup_mismatch(rows, cfg) if cfg else None
    if mismatch:
        notes.append(mismatch)
    if differs:
        notes.append("what differs per method (each tuned the same way on validation data, make tune; docs/tuning.md): "
                     + " | ".join(differs) + "; and the local SGD steps, server models and bytes in the budget table")
    notes += [
        "client-mean acc: mean over clients of each client's test accuracy at the reported round (final, or the best "
        "round under protocol reference), mean ± sample std over seeds; last 3 evals: the mean of the last three "
        "evaluations of each run; worst client: min over clients; sample-weighted: total correct / total test samples",
        (f"Δ vs {reference}: per seed, the method's client-mean acc minus {reference}'s on the same seed (same partition), "
         "mean ± std over seeds, then each seed's value" if reference else ""),
        "balanced acc: mean recall over the classes in each client's test labels; macro-F1: torchmetrics' macro average; "
        "ARI: adjusted Rand index of the model assignment against the true client groups (clustered partitions, "
        "methods with several models)",
        "local SGD steps: optimizer steps of local training over the whole run (mean over seeds); MB up / down: bytes all "
        "participating clients send / receive per round (parameters x element size; 1 MB = 10^6 bytes)",
        "majority label: each client predicts the most frequent label of its own train split (same partitions)",
    ]
    return title, [n for n in notes if n]


# -- pictures ----------------------------------------------------------------------------------

def curves(results: dict[tuple[str, int], dict[str, Any]], algorithms: Sequence[str]
           ) -> dict[str, dict[str, Any]]:
    """Per algorithm: evaluation rounds, client-mean accuracy (seeds x rounds, over the rounds
    every seed evaluated) and cumulative bytes (up + down) at those rounds."""
    out = {}
    for alg in algorithms:
        runs = [r for (a, _), r in sorted(results.items()) if a == alg]
        if not runs:
            continue
        per_seed = [{int(e["round"]): float(e["acc_mean"]) for e in (r.get("evaluations") or [])} for r in runs]
        rounds = sorted(set.intersection(*(set(p) for p in per_seed))) if per_seed else []
        b = run_budget(runs[0])
        per_round = (b.get("bytes_up_per_round") or 0) + (b.get("bytes_down_per_round") or 0)
        out[alg] = {"rounds": rounds, "acc": [[p[t] for t in rounds] for p in per_seed],
                    "bytes": [t * per_round for t in rounds]}
    return out


def write_plots(out: Path, results: dict[tuple[str, int], dict[str, Any]], algorithms: Sequence[str],
                majority: float | None, title: str, suffix: str = "") -> list[Path]:
    """``accuracy_rounds<suffix>.png`` and ``accuracy_bytes<suffix>.png`` in ``out``: one line per method (mean
    over seeds) with a band of ± one std over seeds; methods that communicate nothing (local)
    are a dashed horizontal line at their final accuracy in the bytes plot."""
    import numpy as np
    from matplotlib.figure import Figure

    from fedfew.reporting.plots import save_figure

    data = curves(results, algorithms)
    written = []
    for name, xkey, xlabel in ((f"accuracy_rounds{suffix}.png", "rounds", "round"),
                               (f"accuracy_bytes{suffix}.png", "bytes", "cumulative bytes communicated (up + down, MB)")):
        fig = Figure(figsize=(7.5, 4.5))
        ax = fig.add_subplot(1, 1, 1)
        for i, (alg, c) in enumerate(data.items()):
            if not c["rounds"]:
                continue
            acc = np.asarray(c["acc"], dtype=float)
            mean = acc.mean(axis=0)
            std = acc.std(axis=0, ddof=1) if len(acc) > 1 else np.zeros_like(mean)
            color = f"C{i % 10}"
            if xkey == "bytes":
                x = np.asarray(c["bytes"], dtype=float) / 1e6
                if not x.any():
                    ax.axhline(mean[-1], color=color, linestyle="--", label=f"{alg} (no communication)")
                    continue
            else:
                x = np.asarray(c["rounds"], dtype=float)
            ax.plot(x, mean, marker="o", markersize=3, color=color, label=alg)
            if len(acc) > 1:
                ax.fill_between(x, mean - std, mean + std, color=color, alpha=0.2)
        if majority is not None:
            ax.axhline(majority, color="grey", linestyle=":", label=MAJORITY)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("client-mean accuracy")
        ax.set_title(title, fontsize="small")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="x-small", ncol=2)
        fig.tight_layout()
        written.append(save_figure(fig, out / name))
    return written


def collect(runs: Sequence[Run]) -> dict[tuple[str, int], dict[str, Any]]:
    """(algorithm, seed) -> results.json of every finished run."""
    return {(r.algorithm, r.seed): json.loads(r.results_path.read_text()) for r in runs if r.results_path.exists()}


def default_algorithms() -> list[str]:
    """Every registered algorithm, FedFew first."""
    from fedfew.algorithms import ALGORITHMS

    names = ALGORITHMS.names()
    return sorted(names, key=lambda n: (n != "fedfew", n))


def default_out(dataset: str, extra: Sequence[str], presets: str | None) -> Path:
    """:func:`fedfew.experiments.run_folders.setup_folder` of kind ``compare``, plus ``_presets-<name>`` with
    ``--presets`` (the tune folder's name for make tune's ``<out>/presets``), e.g.
    ``outputs/compare/digits_partition-dirichlet_presets-digits``."""
    from fedfew.experiments.run_folders import setup_folder

    setup = list(extra)
    if presets:
        folder = Path(presets).expanduser().resolve()
        setup.append(f"presets={'none' if presets == 'none' else (folder.parent.name if folder.name == 'presets' else folder.name)}")
    return setup_folder("compare", dataset, setup)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    argv = list(argv)
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    parser = argparse.ArgumentParser(prog=python_command("fedfew.compare"), description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", default="digits", help="dataset config value (default digits)")
    parser.add_argument("--algorithms", nargs="+", default=None,
                        help="algorithm config values (default: every registered one that can run on the setup)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0], help="seeds (default 0)")
    parser.add_argument("--out", default=None, help="output folder (default $FEDFEW_OUTPUT_DIR or outputs, then compare/<dataset>, plus the extra overrides as in a run folder's name, e.g. outputs/compare/digits_partition-dirichlet)")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time (default 1)")
    parser.add_argument("--presets", default=None,
                        help="folder of <dataset>_<algorithm>.yaml presets to use instead of conf/tuned "
                             "(make tune's <out>/presets), or 'none' for the config defaults")
    parser.add_argument("--reference", default="fedfew",
                        help="the method every other is paired against (default fedfew; absent: the first algorithm)")
    args = parser.parse_args(argv)
    args.extra = [e for e in extra if e.strip()]
    # one string with spaces (make ALGORITHMS="a b") is accepted as well as separate words
    if args.algorithms is not None:
        args.algorithms = [a for item in args.algorithms for a in item.split()]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    algorithms = args.algorithms or default_algorithms()
    from fedfew.data.fingerprint import forget_data

    forget_data()  # the data is read afresh by each comparison (check_reusable)
    from fedfew.algorithms import ALGORITHMS
    from fedfew.experiments.run_folders import older_setup_note
    from fedfew.tune import LEFT_OUT, RUN_KEYS, TuneError, check_extra_keys, runnable_algorithms

    for alg in algorithms:
        ALGORITHMS.get(alg)  # unknown names fail here, with the list of known ones
    bad = [e for e in args.extra if e.split("=", 1)[0].lstrip("+~") in RUN_KEYS]
    if bad:
        raise CompareError(f"{bad}: dataset, algorithm, seed, the run directory and the presets are set by the "
                           "comparison, which also resumes interrupted runs itself "
                           "(use --dataset/--algorithms/--seeds/--out/--presets)")
    if args.presets not in (None, "none") and not Path(args.presets).expanduser().is_dir():
        raise CompareError(f"--presets {args.presets}: no such folder (make tune writes <out>/presets; "
                           "'none' runs every method with its config defaults)")
    try:  # a key no method of the list defines, with the closest valid one
        check_extra_keys(algorithms, args.extra)
    except TuneError as err:
        raise CompareError(str(err)) from err
    if args.out:
        out = Path(args.out).expanduser().resolve()
    else:
        out = default_out(args.dataset, args.extra, args.presets)
        note = older_setup_note("compare", args.dataset, out)
        if note:
            _echo(note)
    presets = {alg: preset_for(args.dataset, alg, args.presets, args.extra) for alg in algorithms}
    def overrides_of(alg: str) -> list[str]:
        return Run(alg, args.seeds[0], out, tuple(args.extra), args.dataset, *presets[alg]).task_overrides()

    try:  # every run config is checked before any run starts (the default list leaves out what cannot run)
        configs, left_out = runnable_algorithms(algorithms, named=bool(args.algorithms), overrides_of=overrides_of)
        if args.presets is None:  # a preset tuned for exactly this setup (conf/tuned/<dataset><setup>/) wins
            for alg, cfg in list(configs.items()):
                chosen = preset_for(args.dataset, alg, None, args.extra, cfg)
                if chosen != presets[alg]:
                    presets[alg] = chosen
                    configs.update(runnable_algorithms([alg], named=True, overrides_of=overrides_of)[0])
    except TuneError as err:
        raise CompareError(str(err)) from err
    if left_out:
        _echo(LEFT_OUT + "; ".join(left_out))
    algorithms = list(configs)
    reference = args.reference if args.reference in algorithms else algorithms[0]
    runs = [Run(alg, seed, out, tuple(args.extra), args.dataset, *presets[alg], str(configs[alg].data_dir))
            for seed in args.seeds for alg in algorithms]
    with exclusive(out, "make compare"):  # one tool at a time writes into out
        start = time.perf_counter()
        status = run_all(runs, jobs=args.jobs)
        finished = [r for r in runs if status.get(r) in ("done", "reused", "diverged")]
        results = collect(finished)  # a failed run's results stay out
        failed = [f"{r.algorithm}/seed{r.seed}" for r, s in status.items() if s == "failed"]
        verdicts = {r: json.loads(r.results_path.read_text())["summary"].get("verdict", "finite") for r in finished}
        diverged = [f"{r.algorithm}/seed{r.seed}" for r, v in verdicts.items() if v == "diverged"]
        nonfinite = [f"{r.algorithm}/seed{r.seed}" for r, v in verdicts.items() if v == "nonfinite"]
        stopped = [f"{r.algorithm}/seed{r.seed}" for r, s in status.items() if s == "interrupted"]
        elapsed = time.perf_counter() - start
        run_wall = sum(float(r.get("wall_time_s") or 0.0) for r in results.values())
        trained = len(status) - sum(s == "reused" for s in status.values())
        written = []
        # the run's own protocol, then each eval.also protocol: the same runs, another table each
        for protocol in [None, *also_protocols(results)]:
            scored = results if protocol is None else {k: protocol_view(r, protocol) for k, r in results.items()}
            rows, warnings = summarize(scored, algorithms, reference, {a: p[1] for a, p in presets.items()})
            title, notes = describe(rows, scored, args.dataset, args.seeds, reference)
            if left_out:
                notes.append("left out (they cannot run on this setup): " + "; ".join(left_out))
            if failed:
                warnings.append(f"failed runs (left out; logs in {portable_path(out / 'logs')}): {', '.join(failed)}")
            if diverged:
                warnings.append(f"**runs that diverged** (every client non-finite, stopped early with exit code "
                                f"{DIVERGED_EXIT}; their figures are of the models as they were then, not a result): "
                                f"{', '.join(diverged)}")
            if nonfinite:
                warnings.append(f"runs where some client's update, local copy or personal state went non-finite in "
                                f"some rounds (left out of those rounds' aggregation; results.json nonfinite says who "
                                f"and when): {', '.join(nonfinite)}")
            if stopped:
                warnings.append(f"runs stopped by a signal (left out; run the same command again to continue them "
                                f"from their checkpoints): {', '.join(stopped)}")
            if protocol is not None:
                notes.append(f"the same runs as compare.md, scored under protocol {protocol} at the same evaluations "
                             f"(eval.also; a run trains the same under every protocol)")
            notes.append(f"command: `{portable_command(['python', '-m', 'fedfew.compare', *argv])}`; this "
                         f"invocation took {elapsed / 60:.1f} min with {args.jobs} job(s) ({trained} run(s) trained); "
                         f"the {len(results)} runs' round loops took {run_wall / 60:.1f} min in total")
            suffix = "" if protocol is None else f"_{protocol}"
            written += write_tables(out, rows, title, [*warnings, *notes], suffix)
            majority = next((r["acc_mean"] for r in rows if r["algorithm"] == MAJORITY), None)
            if scored:
                written += write_plots(out, scored, algorithms, majority, title, suffix)
            print(to_markdown(rows, title, [*warnings, *notes]))
        print(f"wrote {', '.join(str(w) if i == 0 else w.name for i, w in enumerate(written))} ({elapsed:.0f} s)")
    return 1 if failed or stopped or diverged else 0


if __name__ == "__main__":
    from fedfew.experiments.launch import pass_signals_on, stopped_exit_code

    pass_signals_on()
    try:
        sys.exit(main())
    except (CompareError, Busy, ValueError) as err:  # stale results, a busy folder, unknown names
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt as err:  # Ctrl-C, or SIGTERM / SIGHUP passed on to the runs
        print("\ncomparison stopped: the finished runs are kept and the running ones saved a checkpoint; run "
              "the same command again to continue", file=sys.stderr)
        sys.exit(stopped_exit_code(err))
