"""What partial participation does to a run: how alpha spreads over each round's participants,
and how well the clients that were rarely sampled are assigned (issue 38's M = 1,000 table).

Reads a finished run folder (its history, :mod:`fedfew.reporting.history_file`: each round's
``participants`` and, for FedFew, ``alpha`` over them; ``results.json``: each client's final
``model``, ``acc`` and, for a split with known groups, ``group``).
``python -m fedfew.reporting.participation RUN_DIR [RUN_DIR ...]`` prints one block per run.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from fedfew.reporting.history_file import HISTORY_FILE, history_path, load_history


def alpha_spread(rounds: Sequence[dict[str, Any]]) -> dict[str, float] | None:
    """How far each round's alpha (over its P participants, summing to 1) is from uniform.

    Per round: ``max_times_p`` = P * max_i alpha_i (1 when uniform; P when one client holds all)
    and ``effective_share`` = 1 / (P * sum_i alpha_i^2) (the effective number of clients as a share
    of P: 1 when uniform, 1/P for one client). P counts the participants that alpha was computed
    over: a client the round ``excluded`` for non-finite results (alpha 0 by construction) is left
    out, and a round in which nothing finite arrived (every alpha 0) is skipped. Returns their means
    over the rounds and the last round's values, or None when no round logs alpha (methods other
    than FedFew) or none has a finite participant.
    """
    rows = []
    for r in rounds:
        if not r.get("alpha"):
            continue
        excluded = set(r.get("excluded") or ())
        a = np.asarray([v for c, v in zip(r["participants"], r["alpha"]) if c not in excluded], dtype=float)
        if a.size and a.sum() > 0:
            rows.append(a)
    if not rows:
        return None
    top = np.array([len(a) * a.max() for a in rows])
    share = np.array([1.0 / (len(a) * float(np.sum(a ** 2))) for a in rows])
    return {"rounds": len(rows), "participants_mean": float(np.mean([len(a) for a in rows])),
            "max_times_p_mean": float(top.mean()), "max_times_p_last": float(top[-1]),
            "effective_share_mean": float(share.mean()), "effective_share_last": float(share[-1])}


def times_sampled(rounds: Sequence[dict[str, Any]], num_clients: int) -> np.ndarray:
    """(M,) int: the rounds in which each client took part."""
    counts = np.zeros(num_clients, dtype=int)
    for r in rounds:
        np.add.at(counts, np.asarray(r["participants"], dtype=int), 1)
    return counts


def sampling_bins(counts: np.ndarray, bins: int = 4) -> list[np.ndarray]:
    """Client ids binned by times sampled, fewest first. The clients never sampled are a bin of
    their own (the group the report is for); the others get one bin per distinct count when there
    are at most ``bins`` of them, else up to ``bins`` bins between their count quartiles (for
    ``bins=4``); a count never straddles two bins."""
    out = [np.flatnonzero(counts == 0)] if (counts == 0).any() else []
    sampled = np.flatnonzero(counts > 0)
    if sampled.size == 0:
        return out
    values = np.unique(counts[sampled])
    if len(values) <= bins:
        return out + [np.flatnonzero(counts == v) for v in values]
    edges = np.unique(np.quantile(counts[sampled], np.linspace(0, 1, bins + 1)))
    which = np.searchsorted(edges[1:-1], counts[sampled], side="left")   # bin j holds (edge j, edge j+1], bin 0 from edge 0
    return out + [sampled[which == j] for j in range(len(edges) - 1) if (which == j).any()]


def group_models(clients: Sequence[dict[str, Any]]) -> dict[int, int]:
    """Each known group's model: the one-to-one matching of groups to models that puts the most
    clients on their group's model (Hungarian method, scipy's ``linear_sum_assignment``; all
    clients, all bins together). One to one, so that models shared by several groups do not count
    as recovering them: when every client ends on one model (a collapse), one group has it and
    the others have none (absent from the result; their clients count as off their group's
    model). With more groups than models the groups left over have none as well.

    Args:
        clients: results.json's ``clients`` with ``model`` and ``group``.

    Returns:
        ``{group: model}`` for the matched groups.
    """
    from scipy.optimize import linear_sum_assignment

    groups, group_of = np.unique([int(c["group"]) for c in clients], return_inverse=True)
    models, model_of = np.unique([int(c["model"]) for c in clients], return_inverse=True)
    counts = np.zeros((len(groups), len(models)), dtype=np.int64)   # (groups, models) clients
    np.add.at(counts, (group_of, model_of), 1)
    rows, cols = linear_sum_assignment(counts, maximize=True)
    return {int(groups[r]): int(models[k]) for r, k in zip(rows, cols)}


def by_times_sampled(clients: Sequence[dict[str, Any]], counts: np.ndarray, bins: int = 4) -> list[dict[str, Any]]:
    """The clients in bins by how often they were sampled (:func:`sampling_bins`), with per
    bin: the range of times sampled, mean accuracy and, where the groups
    are known, the ARI of the final assignment against the groups within the bin and
    ``with_group_model``: the share of clients on their group's model (:func:`group_models`).

    Args:
        clients: results.json's ``clients`` (``id``, ``model``, ``acc``, optionally ``group``).
        counts: (M,) from :func:`times_sampled`.
    """
    from fedfew.simulator.evaluation import assignment_ari

    position = {c["id"]: i for i, c in enumerate(clients)}
    known = all("group" in c for c in clients)
    group_model = group_models(clients) if known else {}
    out = []
    for part in sampling_bins(counts, bins):
        members = [clients[position[int(i)]] for i in part]
        seen = [int(counts[c["id"]]) for c in members]
        row: dict[str, Any] = {"clients": len(members), "sampled_min": min(seen), "sampled_max": max(seen),
                               "sampled_mean": float(np.mean(seen)), "acc_mean": float(np.nanmean([c["acc"] for c in members]))}
        if known:
            row["with_group_model"] = float(np.mean([c["model"] == group_model.get(c["group"]) for c in members]))
            if len({c["group"] for c in members}) > 1:
                row["assignment_ari"] = assignment_ari([c["model"] for c in members], [c["group"] for c in members])
        out.append(row)
    return out


def report(run_dir: str | Path, bins: int = 4) -> dict[str, Any]:
    """:func:`alpha_spread` and :func:`by_times_sampled` of one finished run folder.

    Raises:
        FileNotFoundError: ``run_dir`` has no history (``history.json.gz``, or ``history.json`` of
            older runs) or no results.json (not a finished run).
    """
    run_dir = Path(run_dir)
    if history_path(run_dir) is None:
        raise FileNotFoundError(f"{run_dir / HISTORY_FILE} is missing: give the folder of a finished run")
    if not (run_dir / "results.json").is_file():
        raise FileNotFoundError(f"{run_dir / 'results.json'} is missing: give the folder of a finished run")
    history = load_history(run_dir)
    results = json.loads((run_dir / "results.json").read_text())
    rounds = history["rounds"]
    counts = times_sampled(rounds, len(results["clients"]))
    return {"run": str(run_dir), "algorithm": history.get("algorithm"), "rounds": len(rounds),
            "never_sampled": int((counts == 0).sum()), "alpha": alpha_spread(rounds),
            "by_times_sampled": by_times_sampled(results["clients"], counts, bins)}


def lines(rep: dict[str, Any]) -> list[str]:
    """The report in words and a small table."""
    out = [f"{rep['run']} ({rep['algorithm']}, {rep['rounds']} rounds): {rep['never_sampled']} client(s) never sampled"]
    a = rep["alpha"]
    if a:
        out.append(f"alpha over a round's {a['participants_mean']:.0f} participants: P x max alpha "
                   f"{a['max_times_p_mean']:.2f} (mean over rounds; last {a['max_times_p_last']:.2f}), effective "
                   f"clients {a['effective_share_mean']:.2f} of P (last {a['effective_share_last']:.2f}); uniform = 1, 1")
    out.append("| times sampled | clients | mean acc | with its group's model | ARI within |")
    out.append("|---|---|---|---|---|")
    for b in rep["by_times_sampled"]:
        share = "" if "with_group_model" not in b else f"{b['with_group_model']:.2f}"
        ari = "" if "assignment_ari" not in b else f"{b['assignment_ari']:.2f}"
        out.append(f"| {b['sampled_min']}-{b['sampled_max']} (mean {b['sampled_mean']:.1f}) | {b['clients']} | "
                   f"{b['acc_mean']:.4f} | {share} | {ari} |")
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m fedfew.reporting.participation RUN_DIR [RUN_DIR ...]")
        return 0 if argv else 2
    code = 0
    for run in argv:  # every run is reported; a folder that is not a finished run is named and the exit code is 2
        try:
            print("\n".join(lines(report(run))) + "\n")
        except FileNotFoundError as err:
            print(f"error: {err}", file=sys.stderr)
            code = 2
    return code


if __name__ == "__main__":
    raise SystemExit(main())
