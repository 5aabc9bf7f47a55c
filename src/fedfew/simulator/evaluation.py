"""Model selection and personalized accuracy, under a named protocol (``eval`` config node,
docs/evaluation.md).

Selection: client i picks k_i* = argmin_k of the eval-mode loss of its candidate models
(``alg.candidates``) on its selection split, then is scored with that model on its score
split:

- ``eval.split=test`` (default): selection on the validation split when
  ``partition.val_fraction > 0``, else on the train split; score on the held-out test split.
- ``eval.split=val`` (``make tune``): selection on the train split, score on the validation
  split; the test split is never read.

Protocols (``eval.protocol``), the same for every algorithm, applied here and nowhere else:

- ``final`` (default): the selected model as it is; the run reports the final round.
- ``finetune``: the selected model is copied and fine-tuned for ``eval.finetune_epochs`` local
  epochs on the client's train split (the run's local optimizer and the round's lr), then
  scored; server models, personal states and the run's random streams are untouched.
- ``reference``: ``finetune`` at every evaluation, and the run reports the evaluation round
  with the best client-mean test accuracy, as the reference code (pgg3/FedFew on PFLlib) does.
  Choosing the round on test data flatters every method: results carry ``optimistic: true``.

``eval.also`` (e.g. ``[finetune]``) scores the same selected models under more protocols at the
same evaluations (``final`` / ``finetune`` / ``reference``, which shares finetune's fine-tuned
copies and keeps its own best round; the result's ``also``). A run trains the same under
every protocol, so one run gives the figures of both runs, for about one local epoch per client
and evaluation more.

Metrics per client (torchmetrics): accuracy (the headline), balanced accuracy (mean recall
over the classes present in the client's scored labels; FLamby's metric for Fed-ISIC2019) and
macro-F1 (torchmetrics' macro average: classes present in the labels or the predictions).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fedfew.algorithms.base import Algorithm, Context
from fedfew.data.base import ClientSplit, FederatedData
from fedfew.core.distributed import gather_rows
from fedfew.core.local_training import evaluate_model, train_local
from fedfew.core.seeding import derive_seed

# columns of one client's evaluation row (group: -1 when the partition has no known groups);
# n_test is the number of scored samples (the validation split's under eval.split=val)
_COLUMNS = ("model", "selection_loss", "correct", "n_test", "majority_correct", "n_train", "assignment", "group",
            "balanced_acc", "macro_f1")

#: evaluation protocols (``eval.protocol``) and the ones whose figures are optimistic
PROTOCOLS = ("final", "finetune", "reference")
OPTIMISTIC = frozenset({"reference"})
#: the protocols ``eval.also`` may add (reference keeps its own best round: Simulation.remember_best)
ALSO = ("final", "finetune", "reference")
_FINETUNES = frozenset({"finetune", "reference"})
SPLITS = ("test", "val")


@dataclass(frozen=True)
class EvalSettings:
    """The ``eval`` config node (defaults where a config has none: final protocol on test).

    Attributes:
        protocol: ``final`` | ``finetune`` | ``reference``.
        finetune_epochs: local epochs of fine-tuning (finetune, reference), >= 1.
        split: ``test`` | ``val`` (the split clients are scored on).
        also: more protocols (:data:`ALSO`, none the same as ``protocol``) scored at the same
            evaluations, reported in the result's ``also``.
    """

    protocol: str = "final"
    finetune_epochs: int = 1
    split: str = "test"
    also: tuple[str, ...] = ()

    @classmethod
    def from_config(cls, cfg: Any) -> "EvalSettings":
        """From a run config (its ``eval`` node; missing keys take the defaults).

        Raises:
            ValueError: an unknown protocol or split, finetune_epochs < 1, or an ``also`` entry
                that is not in :data:`ALSO`, repeats, or is the run's protocol.
        """
        node = cfg.get("eval", None) or {}
        out = cls(str(node.get("protocol", "final")), int(node.get("finetune_epochs", 1)), str(node.get("split", "test")),
                  tuple(str(p) for p in (node.get("also", None) or ())))
        if any(p not in ALSO for p in out.also) or len(set(out.also)) < len(out.also) or out.protocol in out.also:
            raise ValueError(f"eval.also={list(out.also)}; allowed: a list of distinct protocols among "
                             f"{', '.join(ALSO)}, without the run's own eval.protocol={out.protocol}")
        if out.protocol not in PROTOCOLS:
            raise ValueError(f"eval.protocol={out.protocol!r}; allowed: {', '.join(PROTOCOLS)}")
        if out.split not in SPLITS:
            raise ValueError(f"eval.split={out.split!r}; allowed: {', '.join(SPLITS)}")
        if out.finetune_epochs < 1:
            raise ValueError(f"eval.finetune_epochs={out.finetune_epochs}; allowed: integer >= 1")
        return out

    @property
    def protocols(self) -> tuple[str, ...]:
        """The run's protocol, then the ``also`` ones."""
        return (self.protocol, *self.also)

    @property
    def optimistic(self) -> bool:
        return self.protocol in OPTIMISTIC

    def selection_index(self, client: ClientSplit) -> np.ndarray:
        """Indices the client's model is selected on: train under ``split=val``, else the
        validation split when there is one, else train."""
        return client.train if self.split == "val" else client.selection

    def score_index(self, client: ClientSplit) -> np.ndarray:
        """Indices the client is scored on: its validation split under ``split=val``, else test."""
        return client.val if self.split == "val" else client.test


class _FineTuned:
    """What :func:`fedfew.core.local_training.train_local` trains: a scratch model with the run's local
    optimizer (``module.make_optimizer``: optim.name, the round's lr, momentum, weight decay)."""

    def __init__(self, model: nn.Module, module) -> None:
        self.working = model
        self._module = module

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return self._module.make_optimizer(self.working.parameters())

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.working(x), y)


def same_shapes(a: nn.Module, b: nn.Module) -> bool:
    """Whether ``a`` and ``b`` hold parameters and buffers of the same shapes, in the same order
    (so :func:`fedfew.core.model_set.copy_parameters_` copies one into the other whole)."""
    def shapes(m: nn.Module) -> list[tuple[int, ...]]:
        return [tuple(t.shape) for t in (*m.parameters(), *m.buffers())]

    return shapes(a) == shapes(b)


def finetune_copy(model: nn.Module, scratch: nn.Module, ctx: Context, client: ClientSplit, rnd: int,
                  epochs: int) -> nn.Module:
    """``scratch`` loaded with ``model``'s weights and fine-tuned for ``epochs`` local epochs
    on ``client``'s train split (the run's batch size, local optimizer and current lr); the
    ``finetune`` protocol. ``model`` is not modified, and the global random state is restored
    afterwards (shuffling draws from ``derive_seed(seed, "finetune", round, client)``), so a
    run's training is the same under every protocol.

    Returns:
        ``scratch``, trained.
    """
    from fedfew.core.model_set import copy_parameters_

    copy_parameters_(scratch, model)
    device = ctx.fabric.device
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        train_local(_FineTuned(scratch, ctx.module), ctx.data, ctx.train_index[client.id], epochs,
                    int(ctx.cfg.dataset.batch_size), derive_seed(int(ctx.cfg.seed), "finetune", rnd, client.id),
                    autocast=ctx.autocast)
    return scratch


@torch.no_grad()
def predict(model: nn.Module, data: FederatedData, index: torch.Tensor,
            batch_size: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """Eval-mode predictions on ``index``.

    Returns:
        (predicted labels (n,), true labels (n,)), int64 on the data's device.
    """
    was_training = model.training
    model.eval()
    preds, targets = [], []
    for start in range(0, index.numel(), batch_size):
        x, y = data.batch(index[start : start + batch_size])
        preds.append(model(x).argmax(dim=1))
        targets.append(y)
    model.train(was_training)
    if not preds:
        empty = torch.empty(0, dtype=torch.int64, device=index.device)
        return empty, empty
    return torch.cat(preds).long(), torch.cat(targets).long()


def client_metrics(preds: torch.Tensor, target: torch.Tensor, num_classes: int) -> tuple[int, float, float]:
    """Correct count, balanced accuracy and macro-F1 of one client's predictions (torchmetrics).

    Balanced accuracy is the mean recall over the classes present in ``target`` (scikit-learn's
    ``balanced_accuracy_score``; FLamby's Fed-ISIC2019 metric). It is NOT torchmetrics'
    ``MulticlassAccuracy(average="macro")``, which also averages in a recall of 0 for every
    class that is absent from ``target`` but predicted. Macro-F1 is torchmetrics'
    ``multiclass_f1_score(average="macro")``: the mean F1 over the classes present in
    ``target`` or in ``preds`` (classes absent from both are left out; scikit-learn's
    ``f1_score(average="macro")``).

    Args:
        preds, target: (n,) int64 labels in ``[0, num_classes)``.
    Returns:
        (correct, balanced accuracy, macro-F1); nan metrics for n = 0.
    """
    from torchmetrics.functional.classification import multiclass_f1_score, multiclass_recall

    if target.numel() == 0:
        return 0, float("nan"), float("nan")
    correct = int((preds == target).sum())
    recall = multiclass_recall(preds, target, num_classes=num_classes, average="none")
    present = torch.bincount(target, minlength=num_classes) > 0
    balanced = float(recall[present].mean())
    f1 = float(multiclass_f1_score(preds, target, num_classes=num_classes, average="macro"))
    return correct, balanced, f1


def evaluate_clients(
    alg: Algorithm, ctx: Context, my_clients: list[ClientSplit], num_clients: int, rnd: int = 0
) -> dict[str, Any]:
    """Select a model for every client and measure its personalized accuracy under the run's
    ``eval`` settings (:class:`EvalSettings`: protocol, split; see the module docstring).

    Each rank evaluates ``my_clients``; rows are gathered so every rank returns the same.

    Args:
        rnd: the round being evaluated (seeds the fine-tuning of the finetune protocols).
    Returns:
        dict with ``clients`` (list of per-client dicts: id, n_train, n_test (scored samples),
        model, acc, balanced_acc, macro_f1, majority_acc, selection_loss, and group on a
        clustered partition) and ``summary`` (acc_mean, acc_std, acc_min, acc_max,
        acc_weighted, balanced_acc_mean, macro_f1_mean, majority_acc_mean,
        majority_acc_weighted, models_served, models_in_use, assignment_ari when the clients
        have known groups and the algorithm keeps several server models, and protocol,
        eval_split, optimistic); with ``eval.also``, ``also``: protocol -> the same two keys for
        that protocol (the same selection; ``optimistic`` true for reference only).
    """
    settings = EvalSettings.from_config(ctx.cfg)
    device = ctx.fabric.device
    targets = ctx.data.targets
    finetuning = any(p in _FINETUNES for p in settings.protocols)
    scratch = copy.deepcopy(ctx.module.working) if finetuning else None
    rows: dict[str, dict[int, torch.Tensor]] = {p: {} for p in settings.protocols}
    for client in my_clients:
        sel = torch.as_tensor(settings.selection_index(client), device=device)
        scored = torch.as_tensor(settings.score_index(client), device=device)
        candidates = alg.candidates(client)
        losses = [evaluate_model(m, ctx.data, sel)[0] for m in candidates]
        best = int(np.nanargmin(losses)) if not all(np.isnan(losses)) else 0
        train_labels = targets[torch.as_tensor(client.train, device=device)]
        majority = int(torch.bincount(train_labels, minlength=ctx.data.num_classes).argmax())
        group = -1 if client.group is None else client.group
        tuned = None  # the fine-tuned copy, made once for every protocol that scores it
        for protocol in settings.protocols:
            model = candidates[best]
            if protocol in _FINETUNES:
                if tuned is None:
                    # a candidate of another shape (FedEM's mixture of the K models) is copied whole
                    own = scratch if same_shapes(model, scratch) else copy.deepcopy(model)
                    tuned = finetune_copy(model, own, ctx, client, rnd, settings.finetune_epochs)
                model = tuned
            preds, labels = predict(model, ctx.data, scored)
            correct, balanced, f1 = client_metrics(preds, labels, ctx.data.num_classes)
            majority_correct = int((labels == majority).sum())
            rows[protocol][client.id] = torch.tensor(
                [best, losses[best], correct, len(scored), majority_correct, len(client.train),
                 alg.model_assignment(client, best), group, balanced, f1], dtype=torch.float64
            )
    results = {}
    for protocol in settings.protocols:
        table = gather_rows(rows[protocol], num_clients,
                            torch.zeros(len(_COLUMNS), dtype=torch.float64, device=device)).cpu()
        # models_served has one entry per model id, retired ones (K=auto) included
        results[protocol] = summarize(table, num_candidates=len(alg.candidates(ctx.data.clients[0])),
                                      num_models=getattr(ctx.module, "initial_K", ctx.module.K))
        results[protocol]["summary"].update(protocol=protocol, eval_split=settings.split,
                                            optimistic=protocol in OPTIMISTIC)
    result = results[settings.protocol]
    if settings.also:
        result["also"] = {p: results[p] for p in settings.also}
    return result


def best_round(current: dict[str, Any] | None, candidate: dict[str, Any]) -> dict[str, Any]:
    """The ``reference`` protocol's pick between two evaluations (``clients``, ``summary``,
    ``round``): the one with the higher client-mean accuracy, the earlier on a tie."""
    if current is None or candidate["summary"]["acc_mean"] > current["summary"]["acc_mean"]:
        return candidate
    return current


def reported(final: dict[str, Any], best: dict[str, Any] | None, optimistic: bool) -> dict[str, Any]:
    """The evaluation a run reports under one protocol: the final one, or for an ``optimistic``
    protocol (``reference``) the best round (:func:`best_round` over every evaluation), its
    summary marked with ``best_round``, ``final_round_acc_mean`` and ``optimistic: true``.

    Args:
        final: the last evaluation (``clients``, ``summary``, ``round``). best: the best one so
            far (None: ``final``).
    """
    if not optimistic or best is None:
        return final
    chosen = best_round(best, final)
    out = {**chosen, "summary": {**chosen["summary"]}}
    out["summary"].update(best_round=int(chosen["round"]), final_round_acc_mean=final["summary"]["acc_mean"],
                          optimistic=True)
    return out


def summarize(table: torch.Tensor, num_candidates: int, num_models: int | None = None) -> dict[str, Any]:
    """Per-client results and summary statistics from an (M, 10) evaluation table (columns
    :data:`_COLUMNS`; an (M, 8) table without the balanced-accuracy and macro-F1 columns gives
    results without them).

    Statistics are over clients (each client counts once: ``acc_mean``, population
    ``acc_std``, ``acc_min``, ``acc_max``) except ``acc_weighted`` = total correct / total
    test samples; ``balanced_acc_mean`` and ``macro_f1_mean`` are client means.
    ``models_served`` counts the clients whose model assignment (k_i*, or the algorithm's own
    assignment, e.g. CFL's cluster) is each server model; ``models_in_use`` is how
    many server models serve at least one client. ``assignment_ari`` (scikit-learn's adjusted Rand
    index between the assignment and the true groups; 1 = the groups recovered up to relabelling)
    is given when every client has a known group and ``num_models`` > 1.
    """
    model, sel_loss, correct, n_test, maj, n_train, assignment, group = table.T[:8]
    metrics = table.shape[1] >= len(_COLUMNS)  # balanced accuracy and macro-F1 present
    balanced, f1 = (table[:, 8], table[:, 9]) if metrics else (None, None)
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
            **({"balanced_acc": float(balanced[i]), "macro_f1": float(f1[i])} if metrics else {}),
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
        **({"balanced_acc_mean": float(balanced.mean()), "macro_f1_mean": float(f1.mean())} if metrics else {}),
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
