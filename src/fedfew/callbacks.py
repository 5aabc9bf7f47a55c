"""Fabric callbacks of a run: result files, experiment loggers, progress and the final table.

Fabric calls ``on_fit_start(sim)``, ``on_round_end(sim, round, logs, evaluation)`` and
``on_fit_end(sim, results)`` on each callback; only rank 0 writes or prints.
"""
from __future__ import annotations

import csv
import io
import sys
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from fedfew.io import atomic_write_json, atomic_write_text

SUMMARY_KEYS = ("acc_mean", "acc_std", "acc_min", "acc_max", "acc_weighted", "majority_acc_mean")


def round_scalars(logs: dict[str, Any], evaluation: dict[str, Any] | None) -> dict[str, float]:
    """The scalar metrics of one round (what metrics.csv and the loggers get)."""
    out: dict[str, float] = {"round": logs["round"], "round_time_s": logs["round_time_s"], "lr": logs["lr"]}
    if "g" in logs:
        out["g"] = logs["g"]
    if isinstance(logs.get("loss"), torch.Tensor):
        loss = logs["loss"]
        out["train_loss_mean"] = float(loss.mean())
        out["train_loss_best_mean"] = float(loss.min(dim=1).values.mean())
    if isinstance(logs.get("effective_step"), torch.Tensor):
        for k, v in enumerate(logs["effective_step"].tolist()):
            out[f"effective_step/{k}"] = v
    if isinstance(logs.get("assignment"), torch.Tensor):
        served = torch.bincount(logs["assignment"].long(), minlength=len(logs.get("effective_step", [])))
        for k, v in enumerate(served.tolist()):
            out[f"clients_served/{k}"] = v
    if evaluation is not None:
        for key in SUMMARY_KEYS:
            out[key] = evaluation["summary"][key]
    return out


class ResultFiles:
    """Writes ``config.yaml`` at the start, ``metrics.csv`` after every round and
    ``results.json`` at the end, each atomically, on rank 0."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self.rows: list[dict[str, float]] = []

    def on_fit_start(self, sim) -> None:
        if sim.fabric.global_rank == 0:
            atomic_write_text(self.run_dir / "config.yaml", OmegaConf.to_yaml(sim.cfg, resolve=True))

    def on_round_end(self, sim, round: int, logs: dict[str, Any], evaluation: dict[str, Any] | None) -> None:
        if sim.fabric.global_rank != 0:
            return
        self.rows.append(round_scalars(logs, evaluation))
        fields: list[str] = []
        for row in self.rows:
            fields += [k for k in row if k not in fields]
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=fields)
        writer.writeheader()
        writer.writerows(self.rows)
        atomic_write_text(self.run_dir / "metrics.csv", buf.getvalue())

    def on_fit_end(self, sim, results: dict[str, Any]) -> None:
        if sim.fabric.global_rank == 0:
            atomic_write_json(self.run_dir / "results.json", results)


class LoggerBridge:
    """Sends each round's scalars to Fabric's loggers (CSV, W&B) with the round as step."""

    def on_fit_start(self, sim) -> None:
        if sim.fabric.global_rank == 0 and sim.fabric.loggers:
            for logger in sim.fabric.loggers:
                logger.log_hyperparams(OmegaConf.to_container(sim.cfg, resolve=True))

    def on_round_end(self, sim, round: int, logs: dict[str, Any], evaluation: dict[str, Any] | None) -> None:
        if sim.fabric.global_rank == 0 and sim.fabric.loggers:
            sim.fabric.log_dict(round_scalars(logs, evaluation), step=round)

    def on_fit_end(self, sim, results: dict[str, Any]) -> None:
        if sim.fabric.global_rank == 0:
            for logger in sim.fabric.loggers:
                logger.log_metrics({f"final/{k}": results["summary"][k] for k in SUMMARY_KEYS}, step=len(sim.history))
                logger.finalize("success")


class ConsoleReport:
    """A progress bar over rounds (rich; plain lines when not a terminal) and the per-client
    table at the end, on rank 0."""

    def __init__(self) -> None:
        self.progress = None
        self.task = None
        self.last_acc: float | None = None

    def on_fit_start(self, sim) -> None:
        if sim.fabric.global_rank != 0:
            return
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        self.progress = Progress(
            TextColumn("round {task.completed}/{task.total}"), BarColumn(), TimeElapsedColumn(),
            TextColumn("eta"), TimeRemainingColumn(), TextColumn("{task.fields[info]}"),
            disable=not sys.stderr.isatty(),
        )
        self.task = self.progress.add_task("rounds", total=int(sim.cfg.rounds), completed=sim.start_round - 1, info="")
        self.progress.start()

    def on_round_end(self, sim, round: int, logs: dict[str, Any], evaluation: dict[str, Any] | None) -> None:
        if sim.fabric.global_rank != 0:
            return
        if evaluation is not None:
            self.last_acc = evaluation["summary"]["acc_mean"]
        info = f"g={logs['g']:.4f} " if "g" in logs else ""
        info += f"acc={self.last_acc:.4f}" if self.last_acc is not None else ""
        self.progress.update(self.task, completed=round, info=info)
        if not sys.stderr.isatty() and evaluation is not None:
            print(f"round {round}/{sim.cfg.rounds} {info} ({logs['round_time_s']:.2f} s/round)", flush=True)

    def on_fit_end(self, sim, results: dict[str, Any]) -> None:
        if sim.fabric.global_rank != 0:
            return
        self.progress.stop()
        print_client_table(results)


def print_client_table(results: dict[str, Any]) -> None:
    """Per-client table (size, chosen model, accuracy, majority baseline) and the summary."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="personalized test accuracy per client")
    for col in ("client", "n_train", "n_test", "model", "acc", "majority acc"):
        table.add_column(col, justify="right")
    for c in results["clients"]:
        table.add_row(str(c["id"]), str(c["n_train"]), str(c["n_test"]), str(c["model"]),
                      f"{c['acc']:.4f}", f"{c['majority_acc']:.4f}")
    console = Console(width=120)
    console.print(table)
    s = results["summary"]
    console.print(
        f"client-mean acc {s['acc_mean']:.4f} ± {s['acc_std']:.4f} (min {s['acc_min']:.4f}, max {s['acc_max']:.4f}); "
        f"sample-weighted {s['acc_weighted']:.4f}; majority-label baseline {s['majority_acc_mean']:.4f}; "
        f"clients per model {s['models_served']}; {results['seconds_per_round']:.2f} s/round"
    )
