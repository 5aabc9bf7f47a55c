"""Live monitoring in Weights & Biases: what a run logs, under which names, and how to read an
offline run back.

:class:`WandbMonitor` is the Fabric callback that sends everything to the W&B logger(s) of a
run (:class:`fedfew.reporting.loggers.WandbLogger`), on rank 0, one ``run.log`` per round with the round
as W&B step. It logs only what the algorithm's round logs hold, each key by the kind the method
declares (:mod:`fedfew.algorithms.round_log`), so baselines plug in:

every round
    ``round``; ``train/g`` (the STCH-Set value), ``train/lr``, ``train/round_time_s``,
    ``train/loss_mean`` / ``train/loss_best_mean`` (mean of L, and of min_k L_ik),
    ``effective_step/<k>`` (the fraction of a client-sized step model k took: eta_s with
    ``normalize=true``, eta_s sum_i alpha_i w_ik with the reference rule), ``weight_share/<k>``
    (sum_i alpha_i w_ik), ``effective_clients/<k>``, ``clients_served/<k>`` (clients whose
    argmax_k w_ik (or the algorithm's assignment) is k), ``assignment/changed`` (clients
    whose assignment moved since their previous round), ``train/<name>`` for any other
    scalar an algorithm logs, ``<name>/<k>`` for its other per-model vectors
    (``weight_per_model/<k>``...);
    ``alpha/client_<i>`` (one line per client, up to ``logger.per_client_scalars`` clients),
    ``alpha/hist`` (histogram over rounds), ``alpha/max``, ``alpha/effective_clients``
    (1 / sum_i alpha_i^2); ``w/mean_max`` (mean_i max_k w_ik);
    every ``logger.media_every`` rounds: ``w/heatmap`` and ``loss/heatmap`` (M x K images,
    the row's pick outlined) and ``clients/round`` (a table, one row per participant:
    client, n_train, alpha, w_<k>, loss_<k>, model, and any other per-client vector);
    FedFew also logs ``train/K`` and ``train/mu`` (the round's models and mu), its per-model
    names use the models' original ids, and under ``K=auto`` a round that retires a model
    logs ``model_set/changes`` (a table of every change so far: round, model, reason, text)
every evaluation
    ``eval/acc_mean``, ``eval/acc_std``, ``eval/acc_min``, ``eval/acc_max``,
    ``eval/acc_weighted``, ``eval/majority_acc_mean`` (and any other number of the summary),
    ``eval/models_served/<k>``, ``eval/acc_hist`` (per-client accuracy histogram, 20 bins
    on [0, 1]) and ``eval/clients`` (table: client, n_test, model, acc, majority_acc)
at the end
    ``summary/clients`` (table per client: size, label distribution, chosen model,
    accuracy), ``summary/acc_by_client`` and ``summary/clients_per_model`` (bar charts),
    ``summary/alpha_over_rounds`` (one line per client), ``summary/K_changes`` (K=auto: a
    table of the retirements), ``plots/<name>`` (the PNGs of
    :mod:`fedfew.reporting.plots`), and ``final/<summary key>`` in the run summary.

The dashboard layout built from these names is described in ``docs/dashboard.md``.

Reading an offline run back (no network, no account): :func:`read_wandb_run` runs W&B's own
transaction-log reader, ``wandb leet inspect --json <run-*.wandb>`` (wandb >= 0.2x; it ships
with the ``wandb`` package), and returns the history rows, config and summary; media such
as tables are files under the run's ``files/`` folder (:func:`load_table`).
"""
from __future__ import annotations

import io
import json
import subprocess
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from omegaconf import OmegaConf

from fedfew.algorithms.round_log import Kind, LogKeys, classify
from fedfew.reporting.callbacks import client_info, eval_scalars, train_scalars

if TYPE_CHECKING:
    from fedfew.simulator.run_view import RunView

TRAIN_NAMES = {"train_loss_mean": "train/loss_mean", "train_loss_best_mean": "train/loss_best_mean"}
#: largest M for which the alpha-over-rounds line chart is logged at the end
MAX_SERIES_CLIENTS = 100


def wandb_scalars(logs: dict[str, Any], evaluation: dict[str, Any] | None, keys: LogKeys) -> dict[str, float]:
    """The round's scalars (:func:`fedfew.reporting.callbacks.train_scalars`: each key by its
    declared kind in ``keys``, per-model vectors as ``<name>/<model id>``) under their W&B names
    (``train/``, ``eval/`` sections)."""
    out: dict[str, float] = {}
    for key, value in train_scalars(logs, keys).items():
        out[key if key == "round" or "/" in key else TRAIN_NAMES.get(key, f"train/{key}")] = value
    for key, value in eval_scalars(evaluation).items():
        out[f"eval/{key}"] = value
    if evaluation is not None:
        for k, n in enumerate(evaluation["summary"].get("models_served") or []):
            out[f"eval/models_served/{k}"] = int(n)
    return out


def _as_2d(value: torch.Tensor, rows: int) -> np.ndarray:
    arr = value.detach().cpu().double().numpy()
    return arr.reshape(rows, -1)


def client_columns(logs: dict[str, Any], keys: LogKeys) -> dict[str, np.ndarray]:
    """Per-participant values of a round (the keys ``keys`` declares per_client or
    per_client_model), name -> (P, c) array, in a stable order: alpha, w, loss, assignment, then
    the others by name."""
    P = len(logs.get("participants") or [])
    kinds = classify(logs, keys)
    per_client = {n for n, kind in kinds.items() if kind in (Kind.PER_CLIENT, Kind.PER_CLIENT_MODEL)}
    names = [n for n in ("alpha", "w", "loss", "assignment") if n in per_client]
    names += sorted(per_client - set(names))
    return {name: _as_2d(logs[name], P) for name in names if P}


def _png_image(fig, caption: str):
    import wandb
    from PIL import Image

    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    buf.seek(0)
    return wandb.Image(Image.open(buf), caption=caption)


def heatmap_image(logs: dict[str, Any], key: str, num_clients: int):
    """The M x K ``key`` (w or loss) of one round as a ``wandb.Image`` (same picture as the
    PNG files), or None."""
    from fedfew.reporting.plots import matrix_figure

    rec = {"round": logs["round"], "participants": list(logs["participants"]), "model_ids": logs.get("model_ids"),
           key: logs[key].detach().cpu().double().reshape(len(logs["participants"]), -1).tolist()}
    fig = matrix_figure({"num_clients": num_clients, "rounds": [rec]}, logs["round"], key)
    return None if fig is None else _png_image(fig, f"{key}, round {logs['round']}")


@dataclass
class WandbMonitor:
    """Fabric callback: everything a run shows in W&B (names in the module docstring).

    Config (``logger`` node): ``media_every`` (rounds between heatmaps / round tables,
    default 1), ``per_client_scalars`` (most clients with an ``alpha/client_<i>`` line,
    default 64).
    """

    media_every: int = 1
    per_client_scalars: int = 64
    loggers: list = field(default_factory=list)
    clients: list[dict[str, Any]] = field(default_factory=list)
    previous_assignment: dict[int, int] = field(default_factory=dict)
    alpha_rounds: list[tuple[int, list[int], list[float]]] = field(default_factory=list)
    model_set_changes: list[list[Any]] = field(default_factory=list)  # K=auto: [round, text] rows
    log_keys: LogKeys = field(default_factory=dict)  # the run's declared round-log keys (on_fit_start)
    _warned: bool = False

    def _guard(self, what: str, fn):
        try:
            return fn()
        except Exception as err:  # W&B must never stop a run
            if not self._warned:
                warnings.warn(f"W&B {what} skipped: {type(err).__name__}: {err}")
                self._warned = True
            return None

    def _log(self, payload: dict[str, Any] | None, step: int) -> None:
        for logger in self.loggers:
            if payload:
                logger.log(payload, step=step)

    # -- callbacks -----------------------------------------------------------------------------

    def on_fit_start(self, sim: RunView) -> None:
        from fedfew.reporting.loggers import WandbLogger

        if sim.rank != 0:
            return
        self.log_keys = sim.log_keys
        self.loggers = [lg for lg in sim.loggers if isinstance(lg, WandbLogger)]
        if not self.loggers:
            return
        cfg = sim.cfg.get("logger") or {}
        self.media_every = max(1, int(cfg.get("media_every") or self.media_every))
        self.per_client_scalars = int(cfg.get("per_client_scalars", self.per_client_scalars) or 0)
        config = OmegaConf.to_container(sim.cfg, resolve=True)
        state = getattr(sim, "logger_state", None)  # kept in checkpoints: a resumed run continues its W&B run
        for logger in self.loggers:
            logger.start(config=config, run_id=(state or {}).get("wandb_run_id"))
            if isinstance(state, dict) and logger.version:
                state["wandb_run_id"] = logger.version
        self.loggers = [lg for lg in self.loggers if lg.active]
        self.clients = self._guard("client info", lambda: client_info(sim)) or []
        for logs in getattr(sim, "history", []):  # rounds before a resume
            self._guard("resume", lambda: self._remember(logs))

    def _remember(self, logs: dict[str, Any]) -> None:
        if logs.get("model_set_change"):
            self.model_set_changes.append([int(logs["round"]), str(logs["model_set_change"])])
        columns = client_columns(logs, self.log_keys)
        participants = [int(c) for c in logs.get("participants") or []]
        if "alpha" in columns:
            self.alpha_rounds.append((int(logs["round"]), participants, columns["alpha"][:, 0].tolist()))
        if "assignment" in columns:
            self.previous_assignment.update(zip(participants, columns["assignment"][:, 0].astype(int).tolist()))

    def on_round_end(self, sim: RunView, round: int, logs: dict[str, Any], evaluation: dict[str, Any] | None) -> None:
        if not self.loggers:
            return
        payload = self._guard("round payload", lambda: self.round_payload(sim, round, logs, evaluation))
        self._log(payload, round)

    def on_interrupt(self, sim: RunView, round: int) -> None:
        for logger in self.loggers:
            logger.finalize("interrupted")
        self.loggers = []

    def on_fit_end(self, sim: RunView, results: dict[str, Any]) -> None:
        if not self.loggers:
            return
        step = int(results["summary"].get("rounds") or len(sim.history))
        payload = self._guard("final payload", lambda: self.final_payload(sim, results))
        self._log(payload, step)
        final = {f"final/{k}": v for k, v in eval_scalars(results).items()}
        final["final/seconds_per_round"] = float(results.get("seconds_per_round", 0.0))
        for logger in self.loggers:
            logger.update_summary(final)
            logger.finalize("success")

    # -- payloads ------------------------------------------------------------------------------

    def round_payload(self, sim: RunView, round: int, logs: dict[str, Any], evaluation: dict[str, Any] | None) -> dict[str, Any]:
        """Everything logged for one round (see the module docstring)."""
        import wandb

        M, keys = int(sim.num_clients), sim.log_keys
        participants = [int(c) for c in logs.get("participants") or []]
        out: dict[str, Any] = wandb_scalars(logs, evaluation, keys)
        if logs.get("model_set_change"):  # K=auto retired a model after this round
            self.model_set_changes.append([round, str(logs["model_set_change"])])
            out["model_set/changes"] = wandb.Table(columns=["round", "change"], data=[list(r) for r in self.model_set_changes])
        columns = client_columns(logs, keys)
        if "alpha" in columns:
            alpha = columns["alpha"][:, 0]
            if M <= self.per_client_scalars:
                width = len(str(M - 1))
                out.update({f"alpha/client_{cid:0{width}d}": float(a) for cid, a in zip(participants, alpha)})
            out["alpha/hist"] = wandb.Histogram(alpha, num_bins=int(min(64, max(10, len(alpha)))))
            out["alpha/max"] = float(alpha.max())
            out["alpha/effective_clients"] = float(1.0 / np.square(alpha).sum())
            self.alpha_rounds.append((round, participants, alpha.tolist()))
        if "w" in columns:
            out["w/mean_max"] = float(columns["w"].max(axis=1).mean())
        if "assignment" in columns:
            assign = columns["assignment"][:, 0].astype(int).tolist()
            out["assignment/changed"] = sum(
                1 for cid, k in zip(participants, assign)
                if cid in self.previous_assignment and self.previous_assignment[cid] != k
            )
            self.previous_assignment.update(zip(participants, assign))
        if (round - 1) % self.media_every == 0 or round == int(sim.cfg.rounds):
            for key in ("w", "loss"):
                if key in columns and isinstance(logs.get(key), torch.Tensor) and logs[key].dim() == 2:
                    image = heatmap_image(logs, key, M)
                    if image is not None:
                        out[f"{key}/heatmap"] = image
            if columns:
                out["clients/round"] = self.round_table(participants, columns)
        if evaluation is not None:
            acc = np.array([c["acc"] for c in evaluation["clients"]], dtype=float)
            out["eval/acc_hist"] = wandb.Histogram(np_histogram=np.histogram(acc, bins=20, range=(0.0, 1.0)))
            out["eval/clients"] = wandb.Table(
                columns=["client", "n_test", "model", "acc", "majority_acc"],
                data=[[c["id"], c["n_test"], c["model"], c["acc"], c["majority_acc"]] for c in evaluation["clients"]],
            )
        return out

    def round_table(self, participants: list[int], columns: dict[str, np.ndarray]):
        """``clients/round``: one row per participant, exact values."""
        import wandb

        names = ["client", "n_train"]
        for name, values in columns.items():
            label = "model" if name == "assignment" else name
            names += [label] if values.shape[1] == 1 else [f"{label}_{k}" for k in range(values.shape[1])]
        rows = []
        for j, cid in enumerate(participants):
            row: list[Any] = [cid, self.clients[cid]["n_train"] if cid < len(self.clients) else None]
            for name, values in columns.items():
                cast = int if name == "assignment" else float
                row += [cast(v) for v in values[j]]
            rows.append(row)
        return wandb.Table(columns=names, data=rows)

    def final_payload(self, sim: RunView, results: dict[str, Any]) -> dict[str, Any]:
        """The end-of-run tables and charts."""
        import wandb

        out: dict[str, Any] = {}
        C = int(sim.host_data.num_classes)
        cols = ["client", "n_train", "n_test", "labels", "model", "acc", "majority_acc", "selection_loss"]
        per_class = C <= 20
        if per_class:
            cols += [f"n_label_{c}" for c in range(C)]
        rows = []
        for c in results["clients"]:
            info = self.clients[c["id"]] if c["id"] < len(self.clients) else {"label_counts": []}
            counts = info.get("label_counts") or []
            total = max(1, sum(counts))
            top = sorted(range(len(counts)), key=lambda k: -counts[k])[:5]
            labels = " ".join(f"{k}:{counts[k] / total:.0%}" for k in top if counts[k])
            row = [c["id"], c["n_train"], c["n_test"], labels, c["model"], c["acc"], c["majority_acc"],
                   c.get("selection_loss")]
            if per_class:
                row += list(counts) + [0] * (C - len(counts))
            rows.append(row)
        table = wandb.Table(columns=cols, data=rows)
        out["summary/clients"] = table
        bars = wandb.Table(columns=["client", "acc"], data=[[f"client {c['id']}", c["acc"]] for c in results["clients"]])
        out["summary/acc_by_client"] = wandb.plot.bar(bars, "client", "acc", title="personalized accuracy per client")
        served = results["summary"].get("models_served") or []
        if served:
            models = wandb.Table(columns=["model", "clients"], data=[[f"model {k}", int(n)] for k, n in enumerate(served)])
            out["summary/clients_per_model"] = wandb.plot.bar(models, "model", "clients", title="clients per model")
        changes = results["summary"].get("K_changes")
        if changes is not None:
            cols = ["round", "model", "reason", "partner", "K", "mu", "gap", "pair_weight", "text"]
            out["summary/K_changes"] = wandb.Table(columns=cols, data=[[c.get(k) for k in cols] for c in changes])
        M = int(sim.num_clients)
        if self.alpha_rounds and M <= MAX_SERIES_CLIENTS:
            xs = [r for r, _, _ in self.alpha_rounds]
            ys = np.zeros((M, len(xs)))
            for j, (_, ids, alpha) in enumerate(self.alpha_rounds):
                ys[ids, j] = alpha
            out["summary/alpha_over_rounds"] = wandb.plot.line_series(
                xs=xs, ys=ys.tolist(), keys=[f"client {i}" for i in range(M)], title="alpha_i over rounds", xname="round",
            )
        plots_dir = Path(sim.run_dir) / "plots"
        for png in sorted(plots_dir.glob("*.png")) if plots_dir.is_dir() else []:
            out[f"plots/{png.stem}"] = wandb.Image(str(png), caption=png.stem)
        return out


# -- reading a run back offline ----------------------------------------------------------------

@dataclass
class WandbRunRecord:
    """A W&B run read from its transaction log (``run-<id>.wandb``).

    Attributes:
        path: the ``.wandb`` file.
        run_id: the W&B run id.
        history: one dict per logged step (``_step`` = our round), media as nested dicts
            (``{"_type": "table-file", "path": ...}``).
        config: the run config (the resolved fedfew config).
        summary: the final summary values.
        exit_code: the exit code recorded by ``finish`` (None when it never finished).
    """

    path: Path
    run_id: str
    history: list[dict[str, Any]]
    config: dict[str, Any]
    summary: dict[str, Any]
    exit_code: int | None

    @property
    def files_dir(self) -> Path:
        return self.path.parent / "files"


def find_wandb_runs(root: str | Path) -> list[Path]:
    """The ``run-*.wandb`` transaction logs under ``root`` (a run directory or a wandb dir)."""
    return sorted(Path(root).rglob("run-*.wandb"))


def _unflatten_media(item: dict[str, Any]) -> dict[str, Any]:
    """``{"k._type": t, "k.path": p}`` -> ``{"k": {"_type": t, "path": p}}`` (the inspector
    prints nested history keys joined by dots)."""
    out: dict[str, Any] = {}
    media = {key[: -len("._type")] for key in item if key.endswith("._type")}
    for key, value in item.items():
        base = next((m for m in media if key.startswith(m + ".")), None)
        if base is None:
            out[key] = value
        else:
            out.setdefault(base, {})[key[len(base) + 1:]] = value
    return out


def _merge(dst: dict[str, Any], src: dict[str, Any]) -> None:
    for key, value in src.items():
        if isinstance(value, dict) and isinstance(dst.get(key), dict):
            _merge(dst[key], value)
        else:
            dst[key] = value


def read_wandb_run(path: str | Path, timeout: float = 60) -> WandbRunRecord:
    """Read a W&B run offline with W&B's own reader (``wandb leet inspect --json``).

    Args:
        path: a ``run-*.wandb`` file, or a folder holding exactly one (a run directory, its
            ``wandb/`` folder or an ``offline-run-*`` folder).
    Raises:
        FileNotFoundError: no (or more than one) transaction log under ``path``.
        RuntimeError: the reader failed.
    """
    path = Path(path)
    if path.is_dir():
        found = find_wandb_runs(path)
        if len(found) != 1:
            raise FileNotFoundError(f"expected one run-*.wandb under {path}, found {len(found)}: {found}")
        path = found[0]
    proc = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(path)],
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"wandb leet inspect failed ({proc.returncode}): {proc.stderr[-2000:]}")
    history, config, summary, exit_code, run_id = [], {}, {}, None, path.stem.removeprefix("run-")
    for line in proc.stdout.splitlines():
        if not line.strip().startswith("{"):
            continue
        rec = json.loads(line)
        kind = rec.get("type")
        body = rec.get(kind) or {}
        if kind == "history":
            history.append(_unflatten_media(body.get("item") or {}))
        elif kind == "config":
            _merge(config, (body.get("update") or {}))
        elif kind == "summary":
            summary.update(body.get("update") or {})
        elif kind == "run":
            run_id = body.get("run_id", run_id)
            _merge(config, ((body.get("config") or {}).get("update") or {}))
        elif kind == "exit":
            exit_code = int(body.get("exit_code", 0))
    config = {k: v for k, v in config.items() if not k.startswith("_wandb")}  # W&B's own (chart specs...)
    return WandbRunRecord(path, run_id, history, config, summary, exit_code)


def load_table(run: WandbRunRecord, value: dict[str, Any]) -> list[dict[str, Any]]:
    """Rows (column -> value) of a table logged in ``run`` (a history value of
    ``_type`` ``table-file``)."""
    data = json.loads((run.files_dir / value["path"]).read_text())
    return [dict(zip(data["columns"], row)) for row in data["data"]]
