"""Pictures of a run as PNG files (matplotlib, Agg; no display needed).

Every function reads the run's ``history.json`` content (see :func:`fedfew.callbacks.build_history`)
and returns a matplotlib :class:`~matplotlib.figure.Figure` built without pyplot, so importing
this module never changes the global matplotlib backend (the analysis notebook uses the same
functions inline). :func:`write_plots` saves them into ``<run_dir>/plots``:

    accuracy.png          client-mean accuracy (band: +- std), min, max, sample-weighted,
                          majority-label baseline, over the evaluation rounds
    alpha.png             alpha_i over rounds: one line per client (up to 30) and a
                          clients x rounds image
    assignment.png        model assignment argmax_k w_ik (or the algorithm's assignment) per
                          client and round, and how many clients each model serves
    w_round_<t>.png       the M x K heatmap of w at chosen rounds (default: first, middle, last)
    loss_round_<t>.png    the M x K loss matrix L at the same rounds
    client_accuracy.png   distribution of per-client accuracy at the last evaluation, and
                          accuracy per client coloured by its chosen model

Regenerate them from a finished run with ``python -m fedfew.plots RUN_DIR``.
"""
from __future__ import annotations

import io
import json
import os
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

#: clients drawn as individual lines in the alpha plot (above: the image only)
MAX_LINES = 30
DPI = 100


# -- reading a history -----------------------------------------------------------------------

def load_history(run_dir: str | Path) -> dict[str, Any]:
    """The ``history.json`` of a run directory."""
    return json.loads((Path(run_dir) / "history.json").read_text())


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


def accuracy_figure(history: dict[str, Any]) -> Figure | None:
    """Personalized accuracy over the evaluation rounds."""
    evals = history.get("evaluations") or []
    if not evals:
        return None
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
    shown = range(M) if M <= MAX_LINES else np.argsort(-np.nanmean(alpha, axis=0))[:10]
    for i in shown:
        ax_lines.plot(rounds, alpha[:, i], marker="o" if len(rounds) <= 20 else None, markersize=3, label=f"client {i}")
    ax_lines.axhline(1 / M, color="grey", linestyle="--", linewidth=1, label="uniform 1/M")
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
    ax.set_xticks(range(K))
    name = {"w": "w (client-model weights)", "loss": "L (loss of model k on client i)"}.get(key, key)
    ax.set(xlabel="model k", ylabel="client i", title=f"{name}\nround {rnd}; boxes: {pick}")
    return fig


def _rect(k: int, i: int):
    from matplotlib.patches import Rectangle

    return Rectangle((k - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="red", linewidth=1.2)


def assignment_figure(history: dict[str, Any]) -> Figure | None:
    """Model assignment per client over rounds and the number of clients per model."""
    rounds, assign = per_client_matrix(history, "assignment")
    if not len(rounds):
        return None
    K = int(history.get("K") or (np.nanmax(assign) + 1))
    M = assign.shape[1]
    fig = _figure(11, 4)
    ax_img, ax_count = fig.subplots(1, 2, width_ratios=[1.2, 1])
    from matplotlib.colors import BoundaryNorm, ListedColormap
    import matplotlib as mpl

    colors = mpl.colormaps["tab10" if K <= 10 else "tab20"].colors[:K]
    cmap, norm = ListedColormap(colors), BoundaryNorm(np.arange(-0.5, K + 0.5), K)
    im = ax_img.imshow(assign.T, aspect="auto", interpolation="nearest", cmap=cmap, norm=norm,
                       extent=(rounds[0] - 0.5, rounds[-1] + 0.5, M - 0.5, -0.5))
    fig.colorbar(im, ax=ax_img, ticks=range(K), label="model")
    ax_img.set(xlabel="round", ylabel="client", title="assignment (clients x rounds)")
    for k in range(K):
        ax_count.plot(rounds, np.sum(assign == k, axis=1), color=colors[k], label=f"model {k}",
                      marker="o" if len(rounds) <= 20 else None, markersize=3)
    ax_count.set(xlabel="round", ylabel="clients served", title="clients per model")
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

    ax_bar.legend(handles=[Patch(color=colors[k % len(colors)], label=f"model {k}") for k in range(K)],
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
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(buf.getvalue())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


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
        run_dir: the run directory (``history.json`` is read from it unless ``history`` is given).
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
    """``python -m fedfew.plots RUN_DIR [ROUND ...]``: (re)draw the PNGs of a run."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m fedfew.plots RUN_DIR [ROUND ...]  (w/L heatmaps at ROUNDs; default first, middle, last)")
        return 0 if argv else 2
    run_dir = Path(argv[0])
    if not (run_dir / "history.json").exists():
        print(f"error: {run_dir / 'history.json'} not found (is {run_dir} a fedfew run directory?)", file=sys.stderr)
        return 2
    for path in write_plots(run_dir, w_rounds=[int(a) for a in argv[1:]] or None):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
