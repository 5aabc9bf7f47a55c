"""Fabric callbacks of a run: result files, pictures, experiment loggers, progress and the
final table.

Fabric calls ``on_fit_start(sim)``, ``on_round_end(sim, round, logs, evaluation)`` and
``on_fit_end(sim, results)`` on each callback, ``sim`` being the run's
:class:`fedfew.simulator.run_view.RunView`; only rank 0 writes or prints.

Files in the run directory (all written atomically, see :mod:`fedfew.core.io`):

    config.yaml      the resolved run config (at the start)
    metrics.csv      one row of scalars per round (:func:`round_scalars`: each round-log key by
                     the kind its algorithm declares, :mod:`fedfew.algorithms.round_log`), after every round
    history.json.gz  every round's logs (g, alpha, w, loss, assignment, ... whatever the
                     algorithm returns, and their declared kinds) and every evaluation's per-client
                     accuracy (:func:`build_history`; gzip-compressed JSON,
                     :mod:`fedfew.reporting.history_file`), at each evaluation and at the end
    results.json     final per-client results and summary, at the end
    plots/*.png      pictures (:mod:`fedfew.reporting.plots`), at evaluations (at most every
                     :data:`PLOT_INTERVAL_S` seconds) and at the end, when ``logger.plots``
"""
from __future__ import annotations

import csv
import io
import sys
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch
from omegaconf import OmegaConf

from fedfew.algorithms.round_log import LOOP_KEYS, Kind, LogKeys, classify, is_scalar
from fedfew.core.io import atomic_write_json, atomic_write_text, to_jsonable
from fedfew.core.nonfinite import describe as describe_nonfinite
from fedfew.reporting.history_file import load_history, write_history

if TYPE_CHECKING:
    from fedfew.simulator.run_view import RunView

SUMMARY_KEYS = ("acc_mean", "acc_std", "acc_min", "acc_max", "acc_weighted", "majority_acc_mean")
#: round-log keys written by their own rule rather than by their kind (fedfew.algorithms.round_log.STANDARD_KINDS):
#: the round, its time and lr come first, g and the loss next; alpha and w have no mean column,
#: the assignment becomes clients_served/<k>; model_ids name the per-model columns
OWN_RULE_KEYS = frozenset({"round", "round_time_s", "lr", "g", "loss", "alpha", "w", "assignment", "model_ids",
                           "model_set_change"})
HISTORY_VERSION = 1
#: least wall time between two redraws of the PNGs during a run (the end always redraws)
PLOT_INTERVAL_S = 30.0


def train_scalars(logs: dict[str, Any], keys: LogKeys) -> dict[str, float]:
    """Scalars of one round's logs, each key written by its declared kind (``keys``:
    :func:`fedfew.algorithms.round_log.declared`; :func:`~fedfew.algorithms.round_log.classify`
    checks the log against it): round, time, lr, g, the mean losses (``train_loss_mean`` and the
    participants' mean of their best model's, ``train_loss_best_mean``), then every per-model
    vector as ``<name>/<model id>``, the clients each model serves (``clients_served/<k>``, from
    the assignment), every other scalar under its name and the mean over participants of every
    other per-client value (``<name>_mean``).

    Raises:
        RoundLogError: a key ``keys`` does not declare, or a value not of its kind.
    """
    kinds = classify(logs, keys)
    out: dict[str, float] = {"round": logs["round"], "round_time_s": logs["round_time_s"], "lr": logs["lr"]}
    if "g" in logs:
        out["g"] = float(logs["g"])
    if isinstance(logs.get("loss"), torch.Tensor):
        loss = logs["loss"].double()
        loss = loss if loss.dim() == 2 else loss.reshape(len(loss), -1)
        out["train_loss_mean"] = float(loss.mean())
        out["train_loss_best_mean"] = float(loss.min(dim=1).values.mean())
    ids = logs.get("model_ids")  # FedFew: original model ids (K=auto retires models; a column keeps its model)
    models = 0  # the round's K, from its per-model vectors
    for name, kind in kinds.items():
        if kind is Kind.PER_MODEL and name not in OWN_RULE_KEYS:
            values = logs[name].tolist()
            models = len(values)
            out.update({f"{name}/{k}": float(v) for k, v in zip(ids or range(len(values)), values)})
    if isinstance(logs.get("assignment"), torch.Tensor):
        assignment = logs["assignment"].long().flatten()
        if ids is not None:  # the assignment holds model ids
            out.update({f"clients_served/{k}": int((assignment == k).sum()) for k in ids})
        else:
            for k, v in enumerate(torch.bincount(assignment, minlength=models).tolist()):
                out[f"clients_served/{k}"] = v
    for key, kind in kinds.items():
        if key in OWN_RULE_KEYS or key in out:
            continue
        value = logs[key]
        if kind is Kind.SCALAR:
            out[key] = float(value)
        elif kind in (Kind.PER_CLIENT, Kind.PER_CLIENT_MODEL) and value.numel() > 0:
            out[f"{key}_mean"] = float(value.double().mean())  # a per-client value, e.g. Ditto's personal_loss
    return out


def eval_scalars(evaluation: dict[str, Any] | None) -> dict[str, float]:
    """Numeric summary values of an evaluation (:data:`SUMMARY_KEYS` first, then any other
    number an algorithm's evaluation adds, then each ``eval.also`` protocol's accuracies as
    ``<protocol>_acc_mean``, ``_acc_weighted``, ``_acc_min``)."""
    if evaluation is None:
        return {}
    summary = evaluation["summary"]
    out = {key: summary[key] for key in SUMMARY_KEYS}
    for key, value in summary.items():
        if key not in out and is_scalar(value):
            out[key] = float(value)
    for protocol, scored in (evaluation.get("also") or {}).items():
        for key in ("acc_mean", "acc_weighted", "acc_min"):
            out[f"{protocol}_{key}"] = float(scored["summary"][key])
    return out


def metrics_row(logs: dict[str, Any], evaluation: dict[str, Any] | None, keys: LogKeys) -> dict[str, Any]:
    """One metrics.csv row: :func:`round_scalars` plus, in a round where K=auto retired a
    model, its ``model_set_change`` text (fedfew.stch.auto_k)."""
    row: dict[str, Any] = round_scalars(logs, evaluation, keys)
    if logs.get("model_set_change"):
        row["model_set_change"] = str(logs["model_set_change"])
    return row


def round_scalars(logs: dict[str, Any], evaluation: dict[str, Any] | None, keys: LogKeys) -> dict[str, float]:
    """The scalar metrics of one round (what metrics.csv and the loggers get); ``keys``: the
    run's declared round-log keys (:func:`train_scalars`)."""
    return {**train_scalars(logs, keys), **eval_scalars(evaluation)}


def client_info(sim: RunView) -> list[dict[str, Any]]:
    """Per client: id, n_train, n_test and the label counts of its train split."""
    data = sim.host_data
    targets = torch.as_tensor(data.targets).cpu()
    out = []
    for c in data.clients:
        labels = targets[torch.as_tensor(c.train, dtype=torch.long)]
        out.append({"id": int(c.id), "n_train": len(c.train), "n_test": len(c.test),
                    "label_counts": torch.bincount(labels, minlength=data.num_classes).tolist()})
    return out


def round_record(logs: dict[str, Any]) -> dict[str, Any]:
    """One round's logs as plain JSON values (tensors to lists)."""
    return to_jsonable(logs)


def evaluation_record(round: int, evaluation: dict[str, Any]) -> dict[str, Any]:
    """One evaluation: round, summary, and per-client accuracy / chosen model (client order)."""
    return {
        "round": int(round),
        "summary": to_jsonable(evaluation["summary"]),
        "acc": [c["acc"] for c in evaluation["clients"]],
        "model": [c["model"] for c in evaluation["clients"]],
    }


def build_history(sim: RunView, rounds: list[dict[str, Any]], evaluations: list[dict[str, Any]],
                  clients: list[dict[str, Any]]) -> dict[str, Any]:
    """The content of the run's history file (``history.json.gz``, :mod:`fedfew.reporting.history_file`)::

        {"version", "algorithm", "dataset", "num_clients" (M), "K", "model_ids", "num_classes",
         "log_keys":    {key: kind} of every key a round may hold (fedfew.algorithms.round_log),
         "clients":     [{"id", "n_train", "n_test", "label_counts"}],
         "rounds":      [{"round", "participants", "round_time_s", "lr", and what the
                          algorithm logs, e.g. FedFew: "g", "alpha" (P), "w" (P x K),
                          "loss" (P x K), "assignment" (P), "effective_step" (K)}],
         "evaluations": [{"round", "summary", "acc" (M), "model" (M)}]}

    Per-participant vectors (alpha, rows of w and loss, assignment) follow the order of that
    round's ``participants``. Model ids: ``K`` is the number of server models at the start (ids
    0..K-1) and ``model_ids`` those left at the end; under FedFew's ``K=auto`` a round's record
    also holds its ``model_ids`` (the columns of its w, loss and per-model vectors, and the
    values of its assignment), ``K`` and, when a model was retired after it, ``model_set_change``.
    """
    cfg = sim.cfg
    return {
        "version": HISTORY_VERSION,
        "algorithm": str(cfg.algorithm.name),
        "dataset": str(cfg.dataset.name),
        "num_clients": int(sim.num_clients),
        "K": int(getattr(sim.module, "initial_K", sim.module.K)),  # model ids 0..K-1 (K=auto: K_max)
        "model_ids": list(getattr(sim.module, "model_ids", range(sim.module.K))),  # the models left at the end
        "num_classes": int(sim.host_data.num_classes),
        "log_keys": {key: Kind(kind).value for key, kind in sim.log_keys.items()},  # each round key's kind
        "clients": clients,
        "rounds": rounds,
        "evaluations": evaluations,
    }


def _previous_history(run_dir: Path, start_round: int) -> tuple[list, list]:
    """Rounds and evaluations before ``start_round`` from the run's existing history (resume;
    either form, :func:`fedfew.reporting.history_file.load_history`)."""
    if start_round <= 1:
        return [], []
    try:
        old = load_history(run_dir)
    except (OSError, ValueError):
        return [], []
    return ([r for r in old.get("rounds", []) if r.get("round", 0) < start_round],
            [e for e in old.get("evaluations", []) if e.get("round", 0) < start_round])


class ResultFiles:
    """Writes ``config.yaml`` at the start, ``metrics.csv`` after every round,
    ``history.json.gz`` at every evaluation, on interruption and at the end, and ``results.json``
    at the end, each atomically, on rank 0. A resumed run keeps the rows and history of the
    rounds before its checkpoint."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self.rows: list[dict[str, float]] = []
        self.rounds: list[dict[str, Any]] = []
        self.evaluations: list[dict[str, Any]] = []
        self.clients: list[dict[str, Any]] = []
        self.history: dict[str, Any] | None = None  # what the history file holds now (for PlotFiles)

    def on_fit_start(self, sim: RunView) -> None:
        if sim.rank != 0:
            return
        atomic_write_text(self.run_dir / "config.yaml", OmegaConf.to_yaml(sim.cfg, resolve=True))
        self.clients = client_info(sim)
        # a resumed run: the rounds before the checkpoint come from its restored history
        start = int(getattr(sim, "start_round", 1))
        rounds, evaluations = _previous_history(self.run_dir, start)
        before = [logs for logs in getattr(sim, "history", []) if logs.get("round", 0) < start]
        summaries = {int(e["round"]): {k: v for k, v in e.items() if k != "round"}
                     for e in getattr(sim, "evaluations", []) if e.get("round", 0) < start}
        self.rows = [metrics_row(logs, {"summary": summaries[logs["round"]]} if logs["round"] in summaries else None,
                                 sim.log_keys) for logs in before]
        self.rounds = [round_record(logs) for logs in before] if before else rounds
        known = {e["round"] for e in evaluations}
        self.evaluations = sorted(evaluations + [
            {"round": r, "summary": to_jsonable(s), "acc": None, "model": None} for r, s in summaries.items() if r not in known
        ], key=lambda e: e["round"])

    def on_round_end(self, sim: RunView, round: int, logs: dict[str, Any], evaluation: dict[str, Any] | None) -> None:
        if sim.rank != 0:
            return
        self.rows.append(metrics_row(logs, evaluation, sim.log_keys))
        fields: list[str] = []
        for row in self.rows:
            fields += [k for k in row if k not in fields]
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=fields)
        writer.writeheader()
        writer.writerows(self.rows)
        atomic_write_text(self.run_dir / "metrics.csv", buf.getvalue())
        self.rounds.append(round_record(logs))
        if evaluation is not None:
            self.evaluations.append(evaluation_record(round, evaluation))
            self.write_history(sim)

    def write_history(self, sim: RunView) -> dict[str, Any]:
        """Write ``history.json.gz`` now; returns its content."""
        history = build_history(sim, self.rounds, self.evaluations, self.clients)
        write_history(self.run_dir, history)
        self.history = history
        return history

    def on_interrupt(self, sim: RunView, round: int) -> None:
        if sim.rank == 0:
            self.write_history(sim)

    def on_fit_end(self, sim: RunView, results: dict[str, Any]) -> None:
        if sim.rank == 0:
            if not self.evaluations or self.evaluations[-1]["round"] != results["summary"].get("rounds"):
                # the final evaluation came after the round callbacks (e.g. resumed at the end)
                self.evaluations.append(evaluation_record(results["summary"].get("rounds", 0), results))
            self.write_history(sim)
            atomic_write_json(self.run_dir / "results.json", results)


class PlotFiles:
    """Draws the PNGs of :mod:`fedfew.reporting.plots` into ``<run_dir>/plots`` on rank 0, from the
    history that :class:`ResultFiles` (placed before it) has just written: at
    evaluation rounds (at most every :data:`PLOT_INTERVAL_S` seconds) and at the end. Given that
    ``ResultFiles`` as ``source``, it takes the history from memory instead of reading the file back.

    Config (``logger`` node): ``plots`` (default true), ``plot_rounds`` (rounds with a w / L
    heatmap; null: first, middle and last).
    """

    def __init__(self, run_dir: Path, interval_s: float = PLOT_INTERVAL_S,
                 source: ResultFiles | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.interval_s = interval_s
        self.source = source
        self.enabled = False
        self.rounds: list[int] | None = None
        self.last = float("-inf")
        self.written: list[Path] = []

    def on_fit_start(self, sim: RunView) -> None:
        logger_cfg = sim.cfg.get("logger") or {}
        self.enabled = sim.rank == 0 and bool(logger_cfg.get("plots", True))
        chosen = logger_cfg.get("plot_rounds")
        self.rounds = [int(r) for r in chosen] if chosen else None

    def draw(self) -> list[Path]:
        """Redraw every picture now (never raises)."""
        try:
            from fedfew.reporting.plots import write_plots

            history = self.source.history if self.source is not None else None  # None: read the file
            self.written = write_plots(self.run_dir, history=history, w_rounds=self.rounds)
        except Exception as err:  # pictures must never stop a run
            warnings.warn(f"plots skipped: {type(err).__name__}: {err}")
        self.last = time.monotonic()
        return self.written

    def on_round_end(self, sim: RunView, round: int, logs: dict[str, Any], evaluation: dict[str, Any] | None) -> None:
        if self.enabled and evaluation is not None and round < int(sim.cfg.rounds) \
                and time.monotonic() - self.last >= self.interval_s:
            self.draw()

    def on_interrupt(self, sim: RunView, round: int) -> None:
        if self.enabled:
            self.draw()

    def on_fit_end(self, sim: RunView, results: dict[str, Any]) -> None:
        if self.enabled:
            self.draw()


def _is_wandb(logger) -> bool:
    from fedfew.reporting.loggers import WandbLogger

    return isinstance(logger, WandbLogger)


class LoggerBridge:
    """Sends each round's scalars to Fabric's loggers (CSV) with the round as step.

    W&B loggers are left to :class:`fedfew.reporting.wandb_monitor.WandbMonitor`, which logs the scalars
    under sectioned names together with the media of the same round.
    """

    @staticmethod
    def _loggers(sim: RunView) -> list:
        return [lg for lg in sim.loggers if not _is_wandb(lg)] if sim.rank == 0 else []

    def on_fit_start(self, sim: RunView) -> None:
        for logger in self._loggers(sim):
            if hasattr(logger, "start_at"):  # fedfew.reporting.loggers.RoundCSVLogger: keep the rows before a resume
                logger.start_at(getattr(sim, "start_round", 1))
            logger.log_hyperparams(OmegaConf.to_container(sim.cfg, resolve=True))

    def on_round_end(self, sim: RunView, round: int, logs: dict[str, Any], evaluation: dict[str, Any] | None) -> None:
        for logger in self._loggers(sim):
            logger.log_metrics(round_scalars(logs, evaluation, sim.log_keys), step=round)

    def on_fit_end(self, sim: RunView, results: dict[str, Any]) -> None:
        for logger in self._loggers(sim):
            logger.log_metrics({f"final/{k}": results["summary"][k] for k in SUMMARY_KEYS},
                               step=int(results["summary"].get("rounds", len(sim.history))))
            logger.finalize("success")


class ConsoleReport:
    """Progress on rank 0, and at the end the per-client table, the headline figures and where
    the run is (:func:`print_client_table`, :func:`fedfew.core.run_folders.where_lines`; on interruption
    too).

    On a terminal (stderr): a rich progress bar over rounds (elapsed, ETA, loss, g, last mean
    accuracy, training time per round). Otherwise (a log file, Slurm): one plain line per round
    on stdout, at most one every ``interval_s`` seconds except for the first, the last and
    every evaluation round, which always get theirs::

        round 12/50  loss 0.4321  g 2.5600  acc 0.8123  train 0.12 s/round  wall 0.16 s/round  eta 0:00:06

    ``loss``: mean training loss over participants and models (``train_loss_mean``), ``g``:
    FedFew's objective, ``acc``: client-mean personalized accuracy (evaluation rounds only),
    ``train``: local training and aggregation per round, ``wall``: training, evaluation and
    logging per round (both averaged over the rounds since the previous line), ``eta``: the
    rounds left times the mean wall time per round so far.

    While the rounds run, the run folder holds :data:`fedfew.core.run_folders.PID_FILE` (this process), so
    ``make runs`` tells a live run from a stopped one.

    Args:
        interval_s: least seconds between two plain lines (evaluation, first and last rounds excepted).
        plain: force plain lines (True) or the bar (False); None: plain when stderr is not a terminal.
    """

    LOG_INTERVAL_S = 10.0

    def __init__(self, interval_s: float = LOG_INTERVAL_S, plain: bool | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self.plain = plain
        self.clock = clock  # seconds; a test passes its own rather than patching the time module
        self.progress = None
        self.task = None
        self.last_acc: float | None = None
        self.run_dir: Path | None = None
        self._start = self._last_time = 0.0
        self._last_round = 0
        self._first_round = 1
        self._train_s = 0.0
        self.log_keys: LogKeys = LOOP_KEYS

    def on_fit_start(self, sim: RunView) -> None:
        if sim.rank != 0:
            return
        self.log_keys = sim.log_keys
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        self.run_dir = Path(sim.run_dir)
        from fedfew.core.run_folders import mark_running

        mark_running(self.run_dir)  # `make runs` tells a live run from a stopped one
        if self.plain is None:
            self.plain = not sys.stderr.isatty()
        self.progress = Progress(
            TextColumn("round {task.completed}/{task.total}"), BarColumn(), TimeElapsedColumn(),
            TextColumn("eta"), TimeRemainingColumn(), TextColumn("{task.fields[info]}"),
            console=Console(stderr=True), disable=self.plain,
        )
        self.task = self.progress.add_task("rounds", total=int(sim.cfg.rounds), completed=sim.start_round - 1, info="")
        self.progress.start()
        self._start = self._last_time = self.clock()
        self._first_round = self._last_round = int(sim.start_round)
        self._last_round -= 1
        self._train_s = 0.0

    def progress_line(self, round: int, total: int, logs: dict[str, Any], evaluation: dict[str, Any] | None,
                      now: float) -> str:
        """The plain progress line of ``round`` (see the class docstring); resets the per-line
        averages."""
        scalars = train_scalars(logs, self.log_keys)
        rounds = max(1, round - self._last_round)
        parts = [f"round {round}/{total}"]
        if "train_loss_mean" in scalars:
            parts.append(f"loss {scalars['train_loss_mean']:.4f}")
        if "g" in scalars:
            parts.append(f"g {scalars['g']:.4f}")
        if evaluation is not None:
            parts.append(f"acc {evaluation['summary']['acc_mean']:.4f}")
        parts.append(f"train {self._train_s / rounds:.2f} s/round")
        parts.append(f"wall {(now - self._last_time) / rounds:.2f} s/round")
        done = round - self._first_round + 1
        if round < total:
            parts.append(f"eta {_clock((now - self._start) / done * (total - round))}")
        self._last_time, self._last_round, self._train_s = now, round, 0.0
        return "  ".join(parts)

    def on_round_end(self, sim: RunView, round: int, logs: dict[str, Any], evaluation: dict[str, Any] | None) -> None:
        if sim.rank != 0:
            return
        now = self.clock()
        total = int(sim.cfg.rounds)
        self._train_s += float(logs.get("round_time_s", 0.0))
        if evaluation is not None:
            self.last_acc = evaluation["summary"]["acc_mean"]
        if self.plain:
            due = (evaluation is not None or round == total or round == self._first_round
                   or now - self._last_time >= self.interval_s)
            if due:
                print(self.progress_line(round, total, logs, evaluation, now), flush=True)
            return
        scalars = train_scalars(logs, self.log_keys)
        info = f"loss {scalars['train_loss_mean']:.4f} " if "train_loss_mean" in scalars else ""
        info += f"g {scalars['g']:.4f} " if "g" in scalars else ""
        info += f"acc {self.last_acc:.4f} " if self.last_acc is not None else ""
        info += f"train {float(logs.get('round_time_s', 0.0)):.2f} s/round"
        self.progress.update(self.task, completed=round, info=info)

    def on_interrupt(self, sim: RunView, round: int) -> None:
        if sim.rank != 0:
            return
        if self.progress is not None:
            self.progress.stop()
        from fedfew.core.run_folders import clear_running, where_lines

        clear_running(sim.run_dir)
        print("\n".join(where_lines(sim.run_dir, finished=False)), flush=True)

    def on_fit_end(self, sim: RunView, results: dict[str, Any]) -> None:
        if sim.rank != 0:
            return
        self.progress.stop()
        from fedfew.core.run_folders import clear_running

        clear_running(sim.run_dir)
        print_client_table(results, run_dir=sim.run_dir)


def _clock(seconds: float) -> str:
    """``h:mm:ss`` of a number of seconds."""
    seconds = int(round(max(seconds, 0.0)))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def models_line(summary: dict[str, Any]) -> str:
    """How many server models serve clients, e.g. "models serving clients: 4 of 4 (clients per model
    [5, 5, 5, 5]); assignment vs the true groups: ARI 1.000"."""
    served = summary["models_served"]
    line = f"clients per model {served}"
    if len(served) > 1:
        line = f"models serving clients: {sum(1 for n in served if n)} of {len(served)} ({line})"
    if summary.get("assignment_ari") is not None:
        line += f"; assignment vs the true groups: ARI {summary['assignment_ari']:.3f}"
    if summary.get("collapse_warnings"):
        line += f"; {len(summary['collapse_warnings'])} collapse warning(s) (summary.collapse_warnings)"
    return line


def summary_lines(results: dict[str, Any]) -> list[str]:
    """The headline figures of a run's results, one finding per line (printed under the table;
    append a line here to add one): accuracy, clients per model, speed."""
    s = results["summary"]
    lines = [
        f"client-mean acc {s['acc_mean']:.4f} ± {s['acc_std']:.4f} (min {s['acc_min']:.4f}, max {s['acc_max']:.4f}); "
        f"sample-weighted {s['acc_weighted']:.4f}; majority-label baseline {s['majority_acc_mean']:.4f}",
        models_line(s),
    ]
    from fedfew.core.run_folders import diverged_clients

    diverged = diverged_clients(results)
    if diverged:
        lines.append(f"DIVERGED: the scored model of {len(diverged)} of {len(results['clients'])} clients has a "
                     f"non-finite loss (clients {diverged}), so it predicts one class; the figures above count "
                     "them. Look at train_loss in metrics.csv: a lower optim.lr is the usual cure")
    nonfinite = describe_nonfinite(results.get("nonfinite"), int(s.get("rounds") or 0))
    if nonfinite:  # a diverged run says so before any figure
        lines.insert(0 if s.get("verdict") == "diverged" else len(lines), nonfinite)
    if s.get("K_changes") is not None:  # FedFew K=auto (fedfew.stch.auto_k)
        retired = ", ".join(f"{c['model']} at round {c['round']} ({c['reason']}"
                            + (f" of {c['partner']})" if c.get("partner") is not None else ")") for c in s["K_changes"])
        lines.append(f"K=auto: {s['K']} of {s['K_initial']} models left, ids {s['model_ids']}; retired: {retired or 'none'}")
    if s.get("optimistic"):
        lines.append(f"protocol {s.get('protocol')}: OPTIMISTIC, the best of the evaluation rounds on test data "
                     f"(round {s.get('best_round')}; the final round scored {s.get('final_round_acc_mean', float('nan')):.4f})")
    elif s.get("protocol", "final") != "final" or s.get("eval_split", "test") != "test":
        lines.append(f"protocol {s.get('protocol')}, scored on the {s.get('eval_split')} split")
    if "balanced_acc_mean" in s:
        lines.append(f"balanced accuracy {s['balanced_acc_mean']:.4f}, macro-F1 {s['macro_f1_mean']:.4f} (client means)")
    budget = results.get("budget")
    if budget:
        steps = "" if budget.get("local_steps") is None else f", {budget['local_steps']:,} local SGD steps"
        lines.append(f"budget: {budget['rounds']} rounds, {budget['server_models']} server model(s), "
                     f"{budget['bytes_up_per_round'] / 1e6:.3f} MB up / {budget['bytes_down_per_round'] / 1e6:.3f} MB down "
                     f"per round{steps}")
    speed = f"speed: wall {results['seconds_per_round']:.2f} s/round (training, evaluation, logging)"
    if results.get("train_seconds_per_round") is not None:
        speed += f"; train {results['train_seconds_per_round']:.2f} s/round (local training and aggregation)"
    lines.append(speed)
    if results.get("peak_host_memory_mib") is not None:
        device = results.get("peak_device_memory_mib")
        before, rounds = results.get("host_memory_before_rounds_mib"), results.get("host_memory_max_after_round_mib")
        lines.append(f"peak memory: host {results['peak_host_memory_mib'] / 1024:.2f} GiB"
                     + ("" if before is None or rounds is None else
                        f" (resident before round 1 {before / 1024:.2f} GiB, largest after a round {rounds / 1024:.2f} GiB)")
                     + ("" if device is None else f", GPU {device / 1024:.2f} GiB (torch's allocator)"))
    return lines


def print_client_table(results: dict[str, Any], run_dir: str | Path | None = None, max_rows: int = 40) -> None:
    """Per-client table (size, chosen model, accuracy, majority baseline), the headline figures
    (:func:`summary_lines`) and, with ``run_dir``, where the run is and the commands that open
    its notebook and plots (:func:`fedfew.core.run_folders.where_lines`). Above ``max_rows``
    clients the table holds the ``max_rows // 2`` lowest accuracies, lowest first (every client
    is in results.json)."""
    from rich.console import Console
    from rich.table import Table

    clients, heading = results["clients"], None
    if len(clients) > max_rows:
        clients = sorted(clients, key=lambda c: (c["acc"], c["id"]))[:max_rows // 2]
        heading = (f"personalized test accuracy: the {len(clients)} lowest of {len(results['clients'])} clients "
                   "(every client's: results.json)")
    table = Table(title=None if heading else "personalized test accuracy per client")
    for col in ("client", "n_train", "n_test", "model", "acc", "majority acc"):
        table.add_column(col, justify="right")
    for c in clients:
        table.add_row(str(c["id"]), str(c["n_train"]), str(c["n_test"]), str(c["model"]),
                      f"{c['acc']:.4f}", f"{c['majority_acc']:.4f}")
    console = Console(width=120)
    if heading:
        console.print(heading, soft_wrap=True, markup=False, highlight=False)
    console.print(table)
    lines = summary_lines(results)
    if run_dir is not None:
        from fedfew.core.run_folders import where_lines

        lines += where_lines(run_dir)
    for line in lines:  # whole lines (a path is never wrapped), no rich markup in paths
        console.print(line, soft_wrap=True, markup=False, highlight=False)
