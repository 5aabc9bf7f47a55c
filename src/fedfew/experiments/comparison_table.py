"""The tables and plots of ``make compare`` (:mod:`fedfew.experiments.comparison`): one row per
algorithm over seeds, the majority-label row, the budget each method used, the notes, and the
accuracy curves; :func:`summarize` defines every column."""
from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path
from typing import Any, Sequence

from fedfew.core.io import atomic_write_text
from fedfew.core.run_folders import diverged_clients, portable_path
from fedfew.data.partition import partition_scheme


class CompareError(RuntimeError):
    """The comparison cannot be made as asked (stale results, mismatched partitions, a
    missing presets folder)."""


#: built models by config (the parameter count d of a method's budget), so seeds share one
_MODEL_CACHE: dict[str, Any] = {}

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
    "seconds_per_round", "wall_time_s", "peak_host_memory_mib", "lr", "hyperparameters", "preset",
    "local_epochs", "batch_size", "num_clients",
)


def _max(xs: Sequence[float | None]) -> float | None:
    """The largest known value (runs made before a figure was recorded give None)."""
    known = [x for x in xs if x is not None]
    return max(known) if known else None


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
        from fedfew.simulator.simulation import data_info

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

    from fedfew.config import CONFIG_DIR
    from fedfew.experiments.search_space import load_space
    from fedfew.experiments.tune_errors import TuneError

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
    (:func:`fedfew.core.run_folders.diverged_clients`): those clients predict one class, and the method's row
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
    :func:`fedfew.core.run_folders.diverged_clients`). Warnings: runs that differ in what every method shares,
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
            "peak_host_memory_mib": _max([r.get("peak_host_memory_mib") for r in runs.values()]),
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


def _gib(mib: float | None) -> str:
    return "" if mib is None else f"{mib / 1024:.2f}"


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
                  "s / round | peak host GiB |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["algorithm"] == MAJORITY:
            continue
        steps = "" if r.get("local_steps") is None else f"{r['local_steps']:,.0f}"
        lines.append(f"| {r['algorithm']} | {_fmt(r.get('lr'), 4)} | {r.get('hyperparameters', '')} | {r.get('rounds')} | "
                     f"{steps} | {_fmt(r.get('server_models'))} | {_mb(r.get('bytes_up_per_round'))} / "
                     f"{_mb(r.get('bytes_down_per_round'))} | {_fmt(r.get('seconds_per_round'), 2)} | "
                     f"{_gib(r.get('peak_host_memory_mib'))} |")
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
    methods = [r for r in rows if r["algorithm"] != MAJORITY]
    tuned = [bool(r.get("preset")) for r in methods]
    differs = []
    for r in methods:
        source = r.get("preset") or ""
        score = preset_score(source)
        where = (f"tuned preset {portable_path(source)}" + (f", best validation acc {score}" if score else "")
                 if source else "no preset: config defaults")
        differs.append(f"{r['algorithm']}: lr {r.get('lr')}; {r.get('hyperparameters') or '(no own keys)'} ({where})")
    mismatch = setup_mismatch(rows, cfg) if cfg else None
    if mismatch:
        notes.append(mismatch)
    if differs:
        how = ("each tuned the same way on validation data, make tune; docs/tuning.md" if all(tuned)
               else "none tuned: each runs its config defaults under the same overrides" if not any(tuned)
               else "NOT tuned alike: some methods run a tuned preset, the others their config defaults")
        notes.append(f"what differs per method ({how}): "
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


def preset_score(path: str) -> str:
    """The ``best validation score`` line of a preset's header ("" when absent or no preset)."""
    from fedfew.config.presets import preset_header

    return preset_header(path).get("best validation score", "").split(";")[0].strip() if path else ""


def setup_mismatch(rows: Sequence[dict[str, Any]], config: dict[str, Any]) -> str | None:
    """A note when some methods' presets were tuned for another setup than the runs'
    (:func:`fedfew.config.presets.preset_matches`: the header's ``# setup:`` against the runs' config): the
    values were chosen on that setup's validation split and may not suit this one (docs/tuning.md).
    None when every preset matches, or no method has one."""
    from omegaconf import OmegaConf

    from fedfew.config.presets import describe_setup, preset_header, preset_matches

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
