"""Model selection and personalized accuracy.

Protocol (our default, see README): client i picks k_i* = argmin_k of the eval-mode loss of
its candidate models on its selection split (validation split when configured, else its
train split), then is scored with that model on its own held-out test split. The reference
code instead scores locally fine-tuned copies and reports the best round on the test data,
which flatters every method; we report the final round.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from fedfew.algorithms.base import Algorithm, Context
from fedfew.data.base import ClientSplit
from fedfew.distributed import gather_rows
from fedfew.local import evaluate_model

# columns of one client's evaluation row (group: -1 when the partition has no known groups)
_COLUMNS = ("model", "selection_loss", "correct", "n_test", "majority_correct", "n_train", "assignment", "group")


def evaluate_clients(
    alg: Algorithm, ctx: Context, my_clients: list[ClientSplit], num_clients: int
) -> dict[str, Any]:
    """Select a model for every client and measure personalized test accuracy.

    Each rank evaluates ``my_clients``; rows are gathered so every rank returns the same.

    Returns:
        dict with ``clients`` (list of per-client dicts: id, n_train, n_test, model, acc,
        majority_acc, selection_loss, assignment, and group on a clustered partition) and
        ``summary`` (acc_mean, acc_std, acc_min, acc_max, acc_weighted, majority_acc_mean,
        majority_acc_weighted, models_served, models_in_use, and assignment_ari when the clients
        have known groups and the algorithm keeps several server models).
    """
    device = ctx.fabric.device
    targets = ctx.data.targets
    rows: dict[int, torch.Tensor] = {}
    for client in my_clients:
        sel = torch.as_tensor(client.selection, device=device)
        test = torch.as_tensor(client.test, device=device)
        candidates = alg.candidates(client)
        losses = [evaluate_model(m, ctx.data, sel)[0] for m in candidates]
        best = int(np.nanargmin(losses)) if not all(np.isnan(losses)) else 0
        _, correct = evaluate_model(candidates[best], ctx.data, test)
        train_labels = targets[torch.as_tensor(client.train, device=device)]
        majority = int(torch.bincount(train_labels, minlength=ctx.data.num_classes).argmax())
        majority_correct = int((targets[test] == majority).sum())
        group = -1 if client.group is None else client.group
        rows[client.id] = torch.tensor(
            [best, losses[best], correct, len(client.test), majority_correct, len(client.train),
             alg.model_assignment(client, best), group], dtype=torch.float64
        )
    table = gather_rows(rows, num_clients, torch.zeros(len(_COLUMNS), dtype=torch.float64, device=device)).cpu()
    # models_served has one entry per model id, retired ones (K=auto) included
    return summarize(table, num_candidates=len(alg.candidates(ctx.data.clients[0])),
                     num_models=getattr(ctx.module, "initial_K", ctx.module.K))


def summarize(table: torch.Tensor, num_candidates: int, num_models: int | None = None) -> dict[str, Any]:
    """Per-client results and summary statistics from an (M, 8) evaluation table (columns
    :data:`_COLUMNS`).

    Statistics are over clients (each client counts once: ``acc_mean``, population
    ``acc_std``, ``acc_min``, ``acc_max``) except ``acc_weighted`` = total correct / total
    test samples. ``models_served`` counts the clients whose model assignment (k_i*, or the
    algorithm's own assignment, e.g. CFL's cluster) is each server model; ``models_in_use`` is how
    many server models serve at least one client. ``assignment_ari`` (scikit-learn's adjusted Rand
    index between the assignment and the true groups; 1 = the groups recovered up to relabelling)
    is given when every client has a known group and ``num_models`` > 1.
    """
    model, sel_loss, correct, n_test, maj, n_train, assignment, group = table.T
    acc = correct / n_test
    majority = maj / n_test
    known = bool((group >= 0).all())
    clients = [
        {
            "id": i,
            "n_train": int(n_train[i]),
            "n_test": int(n_test[i]),
            "model": int(assignment[i]),
            "acc": float(acc[i]),
            "majority_acc": float(majority[i]),
            "selection_loss": float(sel_loss[i]),
            **({"group": int(group[i])} if known else {}),
        }
        for i in range(len(table))
    ]
    served = torch.bincount(assignment.long(), minlength=max(num_candidates, num_models or 0)).tolist()
    summary = {
        "acc_mean": float(acc.mean()),
        "acc_std": float(acc.std(unbiased=False)),
        "acc_min": float(acc.min()),
        "acc_max": float(acc.max()),
        "acc_weighted": float(correct.sum() / n_test.sum()),
        "majority_acc_mean": float(majority.mean()),
        "majority_acc_weighted": float(maj.sum() / n_test.sum()),
        "models_served": served,
        "models_in_use": sum(1 for n in served if n > 0),
    }
    if known and (num_models or num_candidates) > 1:
        summary["assignment_ari"] = assignment_ari(assignment.long().tolist(), group.long().tolist())
    return {"clients": clients, "summary": summary}


def assignment_ari(assignment: list[int], groups: list[int]) -> float:
    """Adjusted Rand index (scikit-learn) between the clients' model assignment and their true
    groups: 1.0 for the groups recovered up to relabelling, ~0 for a random assignment.

    Args:
        assignment: (M,) model of each client. groups: (M,) true group of each client.
    """
    from sklearn.metrics import adjusted_rand_score

    return float(adjusted_rand_score(groups, assignment))
