"""The partition summary of a run: ``partition.json``, a class-by-client heatmap
``partition.png``, a compact table in the terminal and, with the W&B logger, the same in W&B.

:class:`PartitionReport` is a Fabric callback: on ``on_fit_start`` (rank 0 only) it
summarises ``sim.host_data`` with :func:`fedfew.data.partition.partition_summary` and writes
into the run directory, before the first round.

``partition.json``::

    {"dataset", "partition": {<partition config>}, "partition_seed", "partition_hash",
     "num_clients", "num_classes",
     "clients": [{"id", "n_train", "n_test", "n_val", "label_counts": [C ints]}, ...],
     "totals": {"n_samples", "n_assigned", "n_unassigned", "n_train", "n_test", "n_val",
                "label_counts"}}

``label_counts`` count all of a client's samples (train + test + val).
"""
from __future__ import annotations

import io
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from omegaconf import OmegaConf

from fedfew.core.io import atomic_write_bytes, atomic_write_json
from fedfew.data.partition import partition_scheme

if TYPE_CHECKING:
    from fedfew.simulator.run_view import RunView

__all__ = ["PartitionReport", "build_report", "partition_line", "partition_scheme", "partition_table", "partition_title", "write_heatmap"]


def build_report(sim: RunView) -> dict[str, Any]:
    """``partition.json``'s content for a :class:`~fedfew.simulator.simulation.Simulation`."""
    from fedfew.data.federated import partition_seed
    from fedfew.data.partition import partition_summary

    data, cfg = sim.host_data, sim.cfg
    summary = partition_summary(data.clients, data.targets.cpu().numpy(), data.num_classes)
    return {
        "dataset": str(cfg.dataset.name),
        "partition": OmegaConf.to_container(cfg.partition, resolve=True),
        "partition_seed": partition_seed(cfg),
        "partition_hash": data.partition_hash,
        **summary,
    }


def write_heatmap(report: dict[str, Any], path: str | Path) -> Path:
    """Class-by-client heatmap of the label counts (classes as rows, clients as columns; empty
    cells white, counts written in the cells when the matrix is small), saved atomically as PNG.

    Uses matplotlib's object API with the Agg canvas: no pyplot state, no display needed.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    counts = np.array([c["label_counts"] for c in report["clients"]], dtype=np.int64).T  # (C, M)
    C, M = counts.shape
    fig = Figure(figsize=(min(20.0, max(6.0, 2.5 + 0.3 * M)), min(16.0, max(4.0, 1.5 + 0.22 * C))), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    masked = np.ma.masked_equal(counts, 0)
    import matplotlib

    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="white")
    im = ax.imshow(masked, aspect="auto", interpolation="nearest", cmap=cmap, origin="upper")
    fig.colorbar(im, ax=ax, label="samples (train + test)")
    ax.set_xlabel("client")
    ax.set_ylabel("class")
    if M <= 50:
        ax.set_xticks(range(M))
        ax.set_xticklabels([str(c["id"]) for c in report["clients"]], fontsize=7 if M > 25 else 9)
    if C <= 40:
        ax.set_yticks(range(C))
        ax.tick_params(axis="y", labelsize=7 if C > 20 else 9)
    if C * M <= 400:
        peak = max(int(counts.max()), 1)
        for (r, c), v in np.ndenumerate(counts):
            if v:
                ax.text(c, r, str(v), ha="center", va="center", fontsize=7,
                        color="white" if v < 0.6 * peak else "black")
    p = report["partition"]
    detail = ", ".join(f"{k}={p[k]}" for k in ("alpha", "classes_per_client") if p.get(k) is not None)
    ax.set_title(f"{report['dataset']}: {p.get('name')} partition{f' ({detail})' if detail else ''}, "
                 f"{M} clients, hash {report['partition_hash'][:12]}", fontsize=10)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    path = Path(path)
    atomic_write_bytes(path, buf.getvalue())
    return path


def _top_labels(counts: list[int], k: int = 3) -> str:
    arr = np.asarray(counts)
    total = int(arr.sum())
    if total == 0:
        return "-"
    order = np.lexsort((np.arange(len(arr)), -arr))[:k]
    return " ".join(f"{int(j)}:{int(arr[j])}" for j in order if arr[j] > 0)


def partition_table(report: dict[str, Any], max_rows: int = 20):
    """A compact :class:`rich.table.Table`: one row per client (the first and last ones when
    there are more than ``max_rows``) with sizes, number of labels and the top-3 labels
    (:func:`partition_line` gives the totals)."""
    from rich.table import Table

    clients = report["clients"]
    has_val = any(c["n_val"] for c in clients)
    table = Table()
    for col in ("client", "train", "test", *(("val",) if has_val else ()), "labels", "top labels (label:count)"):
        table.add_column(col, justify="left" if col.startswith("top") else "right")
    if len(clients) > max_rows:
        head, tail = max_rows - max_rows // 4, max_rows // 4
        shown = clients[:head] + [None] + clients[-tail:]
    else:
        shown = clients
    for c in shown:
        if c is None:
            table.add_row("...", *[""] * (len(table.columns) - 1))
            continue
        n_labels = sum(1 for v in c["label_counts"] if v)
        table.add_row(str(c["id"]), str(c["n_train"]), str(c["n_test"]), *((str(c["n_val"]),) if has_val else ()),
                      str(n_labels), _top_labels(c["label_counts"]))
    return table


def partition_title(report: dict[str, Any]) -> str:
    """One line naming the dataset, the scheme with the keys that shaped it, and M, e.g.
    ``partition: digits, dirichlet (alpha=0.5), 20 clients`` or ``partition: digits, clustered
    (4 groups, rotate, split; within iid), 20 clients``."""
    return f"partition: {report['dataset']}, {partition_scheme(report['partition'])}, {report['num_clients']} clients"


def partition_line(report: dict[str, Any]) -> str:
    """Two lines of totals: samples per split, unassigned, hash; spread of client sizes and labels."""
    clients = report["clients"]
    t = report["totals"]
    sizes = np.array([c["n_train"] + c["n_test"] + c["n_val"] for c in clients])
    labels = np.array([sum(1 for v in c["label_counts"] if v) for c in clients])
    val = f" / {t['n_val']} val" if t["n_val"] else ""
    return (
        f"{t['n_samples']} samples: {t['n_train']} train / {t['n_test']} test{val}, {t['n_unassigned']} unassigned; "
        f"partition hash {report['partition_hash'][:12]}\n"
        f"client size min {sizes.min()} / median {int(np.median(sizes))} / max {sizes.max()}; "
        f"labels per client {labels.min()}-{labels.max()} of {report['num_classes']}"
    )


class PartitionReport:
    """Fabric callback writing ``partition.json`` and ``partition.png`` into ``run_dir`` and
    printing the compact table, on rank 0 in ``on_fit_start``; with a W&B logger the heatmap,
    the per-client table and the partition hash go to W&B too.

    Args:
        run_dir: the run directory.
        max_rows: table rows shown in the terminal (more clients: first and last ones).
        console: optional :class:`rich.console.Console` (default: stdout, 120 columns).
    """

    def __init__(self, run_dir: str | Path, max_rows: int = 20, console=None) -> None:
        self.run_dir = Path(run_dir)
        self.max_rows = max_rows
        self.console = console
        self.report: dict[str, Any] | None = None
        self._drawing = None

    def on_fit_start(self, sim: RunView) -> None:
        if sim.rank != 0:
            return
        self.report = build_report(sim)
        atomic_write_json(self.run_dir / "partition.json", self.report)
        png = self.run_dir / "partition.png"
        if self._wandb_loggers(sim):
            write_heatmap(self.report, png)  # W&B logs the picture right away
        else:
            # Importing matplotlib and drawing takes ~0.5 s: done beside round 1 instead of
            # before it (matplotlib's object API with the Agg canvas is safe off the main
            # thread); the write is atomic and on_fit_end waits for it.
            import threading

            self._drawing = threading.Thread(target=write_heatmap, args=(self.report, png), name="partition-heatmap")
            self._drawing.start()
        from rich.console import Console

        console = self.console or Console(width=120)
        console.print(partition_title(self.report), soft_wrap=True)
        console.print(partition_table(self.report, self.max_rows))
        console.print(partition_line(self.report))
        console.print(f"partition summary: {self.run_dir / 'partition.json'}, heatmap: {png}")
        self._log_wandb(sim, png)

    def on_fit_end(self, sim: RunView, results: dict[str, Any]) -> None:
        self.wait()

    def wait(self) -> None:
        """Block until ``partition.png`` is written (no-op when it already is)."""
        if self._drawing is not None:
            self._drawing.join()
            self._drawing = None

    @staticmethod
    def _wandb_loggers(sim: RunView) -> list:
        return [lg for lg in sim.loggers if type(lg).__name__ == "WandbLogger"]

    def _log_wandb(self, sim: RunView, png: Path) -> None:
        loggers = self._wandb_loggers(sim)
        if not loggers:
            return
        try:
            import wandb

            rows = [[c["id"], c["n_train"], c["n_test"], c["n_val"], *c["label_counts"]] for c in self.report["clients"]]
            columns = ["client", "n_train", "n_test", "n_val", *[f"label_{j}" for j in range(self.report["num_classes"])]]
            for lg in loggers:
                exp = lg.experiment
                exp.log({"partition/heatmap": wandb.Image(str(png)), "partition/clients": wandb.Table(columns=columns, data=rows)})
                exp.summary["partition_hash"] = self.report["partition_hash"]
                exp.summary["partition_unassigned"] = self.report["totals"]["n_unassigned"]
        except Exception as err:  # noqa: BLE001 - W&B must never stop a run
            warnings.warn(f"W&B: could not log the partition summary: {err}")
