"""Pictures of a run as PNG files (matplotlib, Agg; no display needed).

Every function reads the run's history (see :func:`fedfew.reporting.callbacks.build_history`)
and returns a matplotlib :class:`~matplotlib.figure.Figure` built without pyplot, so importing
this module never changes the global matplotlib backend (the analysis notebook uses the same
functions inline). :func:`write_plots` saves them into ``<run_dir>/plots``:

    accuracy.png          client-mean accuracy (band: +- std), min, max, sample-weighted,
                          majority-label baseline, over the evaluation rounds (before two
                          evaluations: the training loss per round)
    alpha.png             alpha_i over rounds: one line per client (up to 30) and a
                          clients x rounds image
    assignment.png        model assignment during training, argmax_k w_ik (or the algorithm's
                          assignment) per client and round, beside the final selection that
                          scores each client (argmin_k eval loss), and how many clients each
                          model serves (legends: only the models in use)
    w_round_<t>.png       the M x K heatmap of w at chosen rounds (default: first, middle, last)
    loss_round_<t>.png    the M x K loss matrix L at the same rounds
    client_accuracy.png   distribution of per-client accuracy at the last evaluation, and
                          accuracy per client coloured by its chosen model

Regenerate them from a finished run with ``python -m fedfew.reporting.plots RUN_DIR``.
"""
from __future__ import annotations

import io
import sys
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from fedfew.core.io import atomic_write_bytes
from fedfew.reporting.history_file import HISTORY_FILE, history_path, load_history

#: clients drawn as individual lines in the alpha plot (above: the image only)
MAX_LINES = 30
DPI = 100


# -- reading a history -----------------------------------------------------------------------

def rounds_with(history: dict[str, Any], key: str) -> list[dict[str, Any]]:
    """The per-round records that hold ``key``."""
    return [r for r in history.get("rounds", []) if r.get(key) is not None]


def per_client_matrix(history: dict[str, Any], key: str, fill: float = np.nan) -> tuple[np.ndarray, np.ndarray]:
    """(rounds R, values (R, M)) of a per-participant vector ``key`` (alpha, assignment...),
    spread over all M clients; clients not taking part in a round get ``fill``."""
    recs = rounds_with(history, key)
    M = int(history["num_clients"])
    out = np.full((len(recs), M), fill, dtype=float)
    for j, rec in enumerate(recs):
        ids = rec.get("participants") or list(range(M))
        values = np.asarray(rec[key], dtype=float)
        out[j, ids] = values.reshape(len(ids), -1)[:, 0]
    return np.array([r["round"] for r in recs], dtype=int), out


def client_rows(history: dict[str, Any], rec: dict[str, Any], key: str) -> tuple[np.ndarray, list[int]]:
    """(M x K array, participant ids) of a per-participant matrix ``key`` (w, loss) of one
    round; rows of clients not taking part are NaN."""
    M = int(history["num_clients"])
    ids = rec.get("participants") or list(range(M))
    values = np.asarray(rec[key], dtype=float)
    if values.ndim == 1:
        values = values[:, None]
    out = np.full((M, values.shape[1]), np.nan)
    out[ids] = values
    return out, ids


def default_rounds(history: dict[str, Any], key: str = "w") -> list[int]:
    """First, middle and last round that logged ``key``."""
    rounds = [r["round"] for r in rounds_with(history, key)]
    if not rounds:
        return []
    return sorted({rounds[0], rounds[len(rounds) // 2], rounds[-1]})


# -- figures ---------------------------------------------------------------------------------

def _figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _integer_axes(*axes, x: bool = True, y: bool = False) -> None:
    from matplotlib.ticker import MaxNLocator

    for ax in axes:
        if x:
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if y:
            ax.yaxis.set_major_locator(MaxNLocator(integer=True))


def training_loss(history: dict[str, Any]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(rounds R, {label: (R,) values}) of the training loss per round: from the logged loss
    matrix L (participants x models), its mean over participants and models
    (``train_loss_mean``) and the participants' mean of min_k L_ik (``train_loss_best_mean``);
    without L, FedFew's objective g. Empty when a run logs neither."""
    recs = rounds_with(history, "loss")
    if recs:
        mats = [np.asarray(r["loss"], dtype=float).reshape(len(np.atleast_1d(r["loss"])), -1) for r in recs]
        return np.array([r["round"] for r in recs], dtype=int), {
            "mean loss (all clients and models)": np.array([np.nanmean(m) for m in mats]),
            "best model's loss (client mean)": np.array([np.nanmean(np.nanmin(m, axis=1)) for m in mats]),
        }
    recs = rounds_with(history, "g")
    if recs:
        return np.array([r["round"] for r in recs], dtype=int), {"g (STCH-Set objective)": np.array([r["g"] for r in recs], dtype=float)}
    return np.array([], dtype=int), {}


def _loss_figure(history: dict[str, Any], evals: list[dict[str, Any]]) -> Figure | None:
    """The training loss per round, standing in for the accuracy curve before two evaluations."""
    rounds, series = training_loss(history)
    if not len(rounds):
        return None
    fig = _figure(8, 4)
    ax = fig.add_subplot()
    marker = "o" if len(rounds) <= 30 else None
    for label, values in series.items():
        ax.plot(rounds, values, marker=marker, label=label)
    note = "; ".join(f"round {e['round']}: client-mean acc {e['summary']['acc_mean']:.4f}" for e in evals
                     if e.get("summary", {}).get("acc_mean") is not None)
    ax.set(xlabel="round", ylabel="training loss")
    ax.set_title(f"{history.get('algorithm', '')} on {history.get('dataset', '')}: training loss\n"
                 f"(accuracy curve from two evaluations on{'; ' + note if note else ''})", fontsize="medium")
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize="small")
    ax.grid(alpha=0.3)
    _integer_axes(ax)
    return fig


def accuracy_figure(history: dict[str, Any]) -> Figure | None:
    """Personalized accuracy over the evaluation rounds; before two evaluations (one point is
    no curve), the training loss per round instead (:func:`training_loss`), with the
    evaluation's accuracy in the title."""
    evals = history.get("evaluations") or []
    if len(evals) < 2:
        fig = _loss_figure(history, evals)
        if fig is not None or not evals:
            return fig
    x = np.array([e["round"] for e in evals])
    s = {k: np.array([e["summary"].get(k, np.nan) for e in evals], dtype=float)
         for k in ("acc_mean", "acc_std", "acc_min", "acc_max", "acc_weighted", "majority_acc_mean")}
    fig = _figure(8, 4)
    ax = fig.add_subplot()
    marker = "o" if len(x) <= 30 else None
    ax.fill_between(x, s["acc_mean"] - s["acc_std"], s["acc_mean"] + s["acc_std"], alpha=0.2, label="mean ± std")
    ax.plot(x, s["acc_mean"], marker=marker, label="client mean")
    ax.plot(x, s["acc_weighted"], marker=marker, linestyle="--", label="sample-weighted")
    ax.plot(x, s["acc_min"], linestyle=":", label="min client")
    ax.plot(x, s["acc_max"], linestyle=":", label="max client")
    ax.plot(x, s["majority_acc_mean"], color="grey", linestyle="-.", label="majority-label baseline")
    ax.set(xlabel="round", ylabel="personalized test accuracy", ylim=(0, 1.02),
           title=f"{history.get('algorithm', '')} on {history.get('dataset', '')}: accuracy")
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize="small")
    ax.grid(alpha=0.3)
    _integer_axes(ax)
    return fig


def alpha_figure(history: dict[str, Any]) -> Figure | None:
    """alpha_i (weight on struggling clients) over rounds."""
    rounds, alpha = per_client_matrix(history, "alpha")
    if not len(rounds):
        return None
    M = alpha.shape[1]
    fig = _figure(11, 4)
    ax_lines, ax_img = fig.subplots(1, 2, width_ratios=[1.2, 1])
    if M <= MAX_LINES:
        shown = range(M)
    else:  # the 10 largest means over the rounds a client took part in; never sampled (all NaN): last
        sampled = np.isfinite(alpha).sum(axis=0)
        mean = np.where(sampled > 0, np.nansum(alpha, axis=0) / np.maximum(sampled, 1), -np.inf)
        shown = np.argsort(-mean, kind="stable")[:10]
    for i in shown:
        ax_lines.plot(rounds, alpha[:, i], marker="o" if len(rounds) <= 20 else None, markersize=3, label=f"client {i}")
    # alpha sums to 1 over a round's P participants (the rest are NaN here): uniform is 1/P, not 1/M
    participants = np.maximum(np.isfinite(alpha).sum(axis=1), 1)
    ax_lines.plot(rounds, 1 / participants, color="grey", linestyle="--", linewidth=1, label="uniform 1/P (P: participants)")
    title = "alpha_i per client" if M <= MAX_LINES else "alpha_i of the 10 clients with the largest mean"
    ax_lines.set(xlabel="round", ylabel="alpha_i", title=title)
    if M <= 12 or M > MAX_LINES:
        ax_lines.legend(fontsize="x-small", ncol=2)
    ax_lines.grid(alpha=0.3)
    im = ax_img.imshow(alpha.T, aspect="auto", interpolation="nearest", cmap="magma",
                       extent=(rounds[0] - 0.5, rounds[-1] + 0.5, M - 0.5, -0.5))
    fig.colorbar(im, ax=ax_img, label="alpha_i")
    ax_img.set(xlabel="round", ylabel="client", title="alpha (clients x rounds)")
    _integer_axes(ax_lines)
    _integer_axes(ax_img, y=True)
    return fig


def matrix_figure(history: dict[str, Any], rnd: int, key: str = "w") -> Figure | None:
    """Heatmap of a per-client x per-model matrix (``w`` or ``loss``) at round ``rnd``; the
    largest entry of each row is outlined."""
    rec = next((r for r in rounds_with(history, key) if r["round"] == rnd), None)
    if rec is None:
        return None
    values, _ = client_rows(history, rec, key)
    M, K = values.shape
    fig = _figure(min(2.2 + 0.9 * K, 9), min(1.6 + 0.22 * M, 14))
    ax = fig.add_subplot()
    kw = dict(vmin=0, vmax=1, cmap="viridis") if key == "w" else dict(cmap="cividis")
    im = ax.imshow(values, aspect="auto", interpolation="nearest", **kw)
    fig.colorbar(im, ax=ax, label=key)
    pick = "argmin" if key == "loss" else "argmax"
    if K > 1:
        for i in range(M):
            if np.all(np.isnan(values[i])):
                continue
            k = int(np.nanargmin(values[i]) if key == "loss" else np.nanargmax(values[i]))
            ax.add_patch(_rect(k, i))
    if M <= 40:
        ax.set_yticks(range(M))
        ax.tick_params(axis="y", labelsize=7)
    ax.set_xticks(range(K), [str(m) for m in (rec.get("model_ids") or range(K))])  # ids: K=auto retires models
    name = {"w": "w (client-model weights)", "loss": "L (loss of model k on client i)"}.get(key, key)
    ax.set(xlabel="model k", ylabel="client i", title=f"{name}\nround {rnd}; boxes: {pick}")
    return fig


def _rect(k: int, i: int):
    from matplotlib.patches import Rectangle

    return Rectangle((k - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="red", linewidth=1.2)


def final_selection(history: dict[str, Any]) -> tuple[int | None, np.ndarray | None]:
    """(round, (M,) model per client) of the last evaluation that recorded the models chosen
    for scoring (argmin_k of the eval-mode loss on the client's selection split), or
    ``(None, None)``."""
    for e in reversed(history.get("evaluations") or []):
        if e.get("model") is not None:
            return int(e["round"]), np.asarray(e["model"], dtype=int)
    return None, None


def models_in_use(history: dict[str, Any]) -> list[int]:
    """Models that some client was assigned to: in a round's assignment during training or in
    the final selection."""
    _, assign = per_client_matrix(history, "assignment")
    used = set(np.unique(assign[~np.isnan(assign)]).astype(int).tolist()) if assign.size else set()
    _, final = final_selection(history)
    if final is not None:
        used |= set(final.tolist())
    return sorted(used)


def assignment_figure(history: dict[str, Any]) -> Figure | None:
    """Model assignment per client during training (argmax_k w_ik, or the algorithm's own
    assignment when it logs no w, e.g. IFCA's argmin of the training loss) over rounds,
    beside the final selection that scores each client (argmin_k eval loss at the last
    evaluation; the two can differ), and the clients per model. Legends list only the models
    in use (:func:`models_in_use`)."""
    rounds, assign = per_client_matrix(history, "assignment")
    if not len(rounds):
        return None
    K = int(history.get("K") or (np.nanmax(assign) + 1))
    M = assign.shape[1]
    final_round, final = final_selection(history)
    used = models_in_use(history)
    fig = _figure(12, 4.2)
    if final is not None:
        ax_img, ax_final, ax_count = fig.subplots(1, 3, width_ratios=[1.2, 0.12, 1])
    else:
        (ax_img, ax_count), ax_final = fig.subplots(1, 2, width_ratios=[1.2, 1]), None
    from matplotlib.colors import BoundaryNorm, ListedColormap
    import matplotlib as mpl

    colors = mpl.colormaps["tab10" if K <= 10 else "tab20"].colors[:K]
    cmap, norm = ListedColormap(colors), BoundaryNorm(np.arange(-0.5, K + 0.5), K)
    # colours: model k in tab10's k-th colour, keyed by the legend of the counts (models in use only)
    ax_img.imshow(assign.T, aspect="auto", interpolation="nearest", cmap=cmap, norm=norm,
                  extent=(rounds[0] - 0.5, rounds[-1] + 0.5, M - 0.5, -0.5))
    during = "argmax_k w_ik" if rounds_with(history, "w") else f"{history.get('algorithm', 'the algorithm')}'s assignment"
    ax_img.set(xlabel="round", ylabel="client", title=f"during training: {during}")
    if ax_final is not None:
        ax_final.imshow(final[:, None], aspect="auto", interpolation="nearest", cmap=cmap, norm=norm,
                        extent=(-0.5, 0.5, M - 0.5, -0.5))
        ax_final.set_xticks([])
        ax_final.set_yticks([])
        ax_final.set_title(f"final\nselection\n(round {final_round})", fontsize="small")
        ax_final.set_xlabel("argmin_k\neval loss", fontsize="x-small")
    for k in used:
        ax_count.plot(rounds, np.sum(assign == k, axis=1), color=colors[k], label=f"model {k}",
                      marker="o" if len(rounds) <= 20 else None, markersize=3)
        if final is not None:
            ax_count.plot([final_round], [int(np.sum(final == k))], color=colors[k], marker="*", markersize=12,
                          linestyle="none")
    if final is not None:
        ax_count.plot([], [], color="grey", marker="*", markersize=10, linestyle="none",
                      label=f"final selection (round {final_round})")
    ax_count.set(xlabel="round", ylabel="clients", title=f"clients per model (lines: {during})")
    ax_count.legend(fontsize="small")
    ax_count.grid(alpha=0.3)
    _integer_axes(ax_img, ax_count, y=True)
    return fig


def client_accuracy_figure(history: dict[str, Any]) -> Figure | None:
    """Per-client accuracy at the last evaluation: histogram and one bar per client."""
    evals = [e for e in history.get("evaluations") or [] if e.get("acc") is not None]
    if not evals:
        return None
    last = evals[-1]
    acc = np.asarray(last["acc"], dtype=float)
    model = np.asarray(last.get("model") or [0] * len(acc), dtype=int)
    fig = _figure(11, 4)
    ax_hist, ax_bar = fig.subplots(1, 2, width_ratios=[1, 1.4])
    ax_hist.hist(acc, bins=np.linspace(0, 1, 21), edgecolor="white")
    ax_hist.axvline(acc.mean(), color="black", linestyle="--", label=f"mean {acc.mean():.3f}")
    ax_hist.set(xlabel="test accuracy", ylabel="clients", title=f"per-client accuracy, round {last['round']}")
    ax_hist.legend(fontsize="small")
    _integer_axes(ax_hist, x=False, y=True)
    import matplotlib as mpl

    K = max(int(model.max()) + 1, 1)
    colors = mpl.colormaps["tab10" if K <= 10 else "tab20"].colors
    order = np.argsort(acc)
    ax_bar.bar(range(len(acc)), acc[order], color=[colors[m % len(colors)] for m in model[order]])
    if len(acc) <= 40:
        ax_bar.set_xticks(range(len(acc)), [str(i) for i in order], fontsize=7)
    from matplotlib.patches import Patch

    ax_bar.legend(handles=[Patch(color=colors[k % len(colors)], label=f"model {k}") for k in np.unique(model).tolist()],
                  fontsize="small", loc="upper left")
    ax_bar.set(xlabel="client (sorted by accuracy)", ylabel="test accuracy", ylim=(0, 1.02),
               title="accuracy per client, coloured by chosen model")
    return fig


# -- files -----------------------------------------------------------------------------------

def save_figure(fig: Figure, path: str | Path) -> Path:
    """Save ``fig`` as PNG atomically (a reader never sees half a file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    return atomic_write_bytes(path, buf.getvalue())  # mode 0666 & ~umask, like any result file


def figures(history: dict[str, Any], w_rounds: Iterable[int] | None = None) -> dict[str, Callable[[], Figure | None]]:
    """File name -> figure builder for every picture of a run (see the module docstring); the
    heatmaps are drawn for ``w`` and for a loss matrix with more than one model, when logged."""
    out: dict[str, Callable[[], Figure | None]] = {
        "accuracy.png": lambda: accuracy_figure(history),
        "alpha.png": lambda: alpha_figure(history),
        "assignment.png": lambda: assignment_figure(history),
        "client_accuracy.png": lambda: client_accuracy_figure(history),
    }
    for key in ("w", "loss"):
        recs = [r for r in rounds_with(history, key) if np.ndim(r[key]) == 2 and len(r[key]) and len(r[key][0]) > 1]
        available = {r["round"] for r in recs}
        chosen = list(w_rounds) if w_rounds else default_rounds({"rounds": recs}, key)
        for rnd in chosen:
            if rnd in available:
                out[f"{key}_round_{rnd:04d}.png"] = lambda rnd=rnd, key=key: matrix_figure(history, rnd, key)
    return out


def write_plots(run_dir: str | Path, history: dict[str, Any] | None = None,
                w_rounds: Sequence[int] | None = None, out_dir: str | Path | None = None) -> list[Path]:
    """Write every picture of the run into ``<run_dir>/plots`` (or ``out_dir``).

    A picture that cannot be drawn (nothing logged for it, or an error) is skipped with a
    warning; plotting never stops a run.

    Args:
        run_dir: the run directory (its history file is read unless ``history`` is given).
        history: the history content, when already in memory.
        w_rounds: rounds with a w / L heatmap (default: first, middle and last).
        out_dir: where to write (default ``<run_dir>/plots``).
    Returns:
        the paths written.
    """
    history = history if history is not None else load_history(run_dir)
    out_dir = Path(out_dir) if out_dir is not None else Path(run_dir) / "plots"
    written = []
    for name, build in figures(history, w_rounds).items():
        try:
            fig = build()
            if fig is not None:
                written.append(save_figure(fig, out_dir / name))
        except Exception as err:  # a picture must never stop a run
            warnings.warn(f"plot {name} skipped: {type(err).__name__}: {err}")
    # keep only the heatmaps of the chosen rounds (the middle round moves while a run goes on)
    keep = {p.name for p in written}
    for old in list(out_dir.glob("w_round_*.png")) + list(out_dir.glob("loss_round_*.png")):
        if old.name not in keep and not w_rounds:
            old.unlink(missing_ok=True)
    return written


def main(argv: list[str] | None = None) -> int:
    """``python -m fedfew.reporting.plots RUN_DIR [ROUND ...]``: (re)draw the PNGs of a run."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        from fedfew.core.run_folders import python_command

        print(f"usage: {python_command('fedfew.reporting.plots')} RUN_DIR [ROUND ...]  "
              "(w/L heatmaps at ROUNDs; default first, middle, last)")
        return 0 if argv else 2
    run_dir = Path(argv[0])
    if history_path(run_dir) is None:
        print(f"error: {run_dir / HISTORY_FILE} not found (is {run_dir} a fedfew run directory?)", file=sys.stderr)
        return 2
    for path in write_plots(run_dir, w_rounds=[int(a) for a in argv[1:]] or None):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
