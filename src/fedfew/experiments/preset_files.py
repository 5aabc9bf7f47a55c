"""What ``make tune`` writes for an algorithm: the preset file with its provenance comments, and its
line of ``tune.md``. The format is read by :mod:`fedfew.config.presets`."""
from __future__ import annotations

import datetime
import json
import os
from pathlib import Path
from typing import Any, Sequence

from fedfew.config.presets import describe_setup, nest, setup_keys
from fedfew.core.io import atomic_write_text
from fedfew.core.run_folders import portable_command, portable_overrides
from fedfew.experiments.search_space import Dimension
from fedfew.experiments.studies import Choice, choice, completed, finished
from fedfew.experiments.tuning import Plan, _fmt_values

#: a chosen value this close to a bound (a fraction of the range, log scale for a log key) is reported
EDGE = 0.1
MADE_BY = "# made by:"  # the line a resumed tune leaves as it was (_write_unless_only_made_by_differs)


def range_edges(space: Sequence[Dimension], values: dict[str, Any]) -> list[str]:
    """The chosen values that lie within :data:`EDGE` of a bound of their (resolved) range, or
    outside it (a config default): there the range may stop short of the optimum, and widening
    it, for every method, is the fix (docs/tuning.md). Each as ``key=value (top tenth of [low, high])``.
    """
    out = []
    for dim in space:
        if dim.key not in values or (where := dim.position(values[dim.key])) is None:
            continue
        span = f"[{dim.low:.4g}, {dim.high:.4g}]"
        if where < 0 or where > 1:
            out.append(f"{dim.key}={values[dim.key]} (outside {span})")
        elif where >= 1 - EDGE or where <= EDGE:
            out.append(f"{dim.key}={values[dim.key]} ({'top' if where >= 1 - EDGE else 'bottom'} tenth of {span}"
                       + (", log scale)" if dim.log else ")"))
    return out


def tuning_seconds(study) -> float:
    """Wall seconds of every finished trial and of the defaults run, summed."""
    defaults = study.user_attrs.get("defaults") or {}
    return sum(t.user_attrs.get("wall_s", 0.0) for t in completed(study)) + float(defaults.get("wall_s", 0.0))


def preset_text(plan: Plan, study, command: str, best: Choice | None = None) -> str:
    """The preset file of one tuned algorithm: ``# @package _global_``, the provenance as
    comments, then the chosen values (``best``: :func:`choice` of the study, when known)."""
    import yaml

    best = best or choice(study)
    values = best.values
    trials = finished(study)
    wall = tuning_seconds(study)
    edges = range_edges(plan.space, values)
    header = [
        "# @package _global_",
        f"# Tuned preset: dataset={plan.dataset} x algorithm={plan.algorithm}, written by make tune "
        "(python -m fedfew.tune; docs/tuning.md).",
        "# In conf/tuned/ it applies to every run of this (dataset, algorithm) pair; in conf/tuned/<setup>/ make "
        "compare uses it for runs of its setup; command-line overrides win.",
        f"# tuned for: {describe_setup(plan.cfg)}",
        f"# setup: {json.dumps(setup_keys(plan.cfg))}",
        f"# extra overrides: {' '.join(portable_overrides(plan.extra)) or '(none)'}",
        "# search space: " + "; ".join(d.describe() for d in plan.space),
        f"# trials: {len(trials)} sampled (the same for every method) + the method's config defaults, Optuna TPE "
        f"sampler seeded from {plan.sampler_seed}, {plan.startup} random start-up trials, {plan.jobs} at a time; "
        "a trial in which anything went non-finite is a failed trial (counted, never chosen)",
        f"# diverged: {diverged_text(study)}",
        f"# objective: client-mean accuracy on the validation split (partition.val_fraction={plan.val_fraction} of "
        f"each client's train split, never trained on; eval.split=val: the test split is never read), "
        + ("mean of the last 3 evaluations" if plan.objective == "last3" else "final round")
        + f", trials on seed {plan.seeds[0]}",
        f"# best validation score: {best.value:.4f} ({best.label}, seed {best.seed}); the config defaults scored "
        f"{_fmt_score(study.user_attrs.get('defaults'))}; trials' wall time, summed: {wall / 60:.1f} min",
        f"# confirmed: {confirmed_text(best)}",
        f"# stability margin: {margin_text(best)}",
        *([f"# at a range edge, the range may bind: {'; '.join(edges)} (docs/tuning.md)"] if edges else []),
        f"{MADE_BY} {os.environ.get('FEDFEW_TUNE_MADE_BY') or 'python -m fedfew.tune'} on "
        f"{datetime.date.today().isoformat()}",
        f"# command: {portable_command(command)}",
    ]
    body = yaml.safe_dump(nest(values), sort_keys=False, default_flow_style=False)
    return "\n".join(header) + "\n" + body


def _fmt_score(defaults: dict[str, Any] | None) -> str:
    if not defaults:
        return "(not run)"
    return "DIVERGED" if defaults.get("value") is None else f"{float(defaults['value']):.4f}"


def diverged_text(study) -> str:
    """The failed (diverged) trials and defaults, e.g. ``trial 2 (optim.lr=1.41: seed 0: ...)``, or ``none``."""
    out = [f"trial {t.number} ({_fmt_values(t.user_attrs.get('values', {}))}: {t.user_attrs['diverged']})"
           for t in finished(study) if t.user_attrs.get("diverged")]
    defaults = study.user_attrs.get("defaults") or {}
    if defaults.get("diverged"):
        out.append(f"the config defaults ({defaults['diverged']})")
    return "; ".join(out) or "none"


def confirmed_text(best: Choice) -> str:
    """The confirmation seeds' validation scores and the rejected candidates, in words."""
    if not best.confirmed:
        return "not confirmed on a second seed (one tuning seed: --seeds 0 1 confirms on seed 1)"
    text = ", ".join(f"seed {s}: {v:.4f}" for s, v in best.confirmed.items())
    mean = (best.value + sum(best.confirmed.values())) / (1 + len(best.confirmed))
    text += f" (mean with seed {best.seed}: {mean:.4f}), finite"
    if best.rejected:
        text += "; rejected first, diverged on a confirmation seed: " + "; ".join(f"{k} ({v})" for k, v in best.rejected.items())
    return text


def margin_text(best: Choice) -> str:
    """What the run at the stability factor times the chosen lr showed, in words."""
    m = best.margin
    if not m:
        return "(not run)"
    head = f"at {m['factor']:g}x the chosen lr (optim.lr={m['lr']}), seed {best.seed}: "
    return head + (f"DIVERGED ({m['diverged']}): the preset sits within {m['factor']:g}x of the edge of stability"
                   if m["diverged"] else f"finite, validation {m['value']:.4f}")


def _write_unless_only_made_by_differs(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` unless the file there holds the same preset with another
    ``# made by:`` line: a resumed tune keeps the command and date that chose a finished preset."""
    def content(t: str) -> list[str]:
        return [line for line in t.splitlines() if not line.startswith(MADE_BY)]

    if path.is_file() and content(path.read_text()) == content(text):
        return
    atomic_write_text(path, text)


def _write_preset(plan: Plan, study, out: Path, install: Path | None, command_line: str, echo) -> str:
    """Write one algorithm's preset (``<out>/presets``, and the folder ``install`` unless None);
    returns its row of tune.md."""
    best = choice(study)
    text = preset_text(plan, study, command_line, best)
    name = f"{plan.dataset}_{plan.algorithm}.yaml"
    written = [out / "presets" / name] + ([install / name] if install is not None else [])
    for path in written:
        _write_unless_only_made_by_differs(path, text)
    wall = tuning_seconds(study)
    edges = range_edges(plan.space, best.values)
    echo(f"{plan.algorithm}: best validation acc {best.value:.4f} with {_fmt_values(best.values)} "
         f"({best.label}) -> {', '.join(map(str, written))}"
         + (f"\n  {plan.algorithm}: at a range edge, the range may bind: {'; '.join(edges)}" if edges else ""))
    confirmed = ", ".join(f"{v:.4f} (seed {s_})" for s_, v in best.confirmed.items()) or "not confirmed"
    margin = best.margin or {}
    at_margin = "" if not margin else ("DIVERGED" if margin["diverged"] else f"finite, {margin['value']:.4f}")
    diverged = sum(1 for t in finished(study) if t.user_attrs.get("diverged"))
    return (f"| {plan.algorithm} | {best.value:.4f} ({best.label}, seed {best.seed}) | {confirmed} | "
            f"{_fmt_values(best.values)} | {_fmt_score(study.user_attrs.get('defaults'))} | "
            f"{len(finished(study))} ({diverged} diverged) | {at_margin} | {wall / 60:.1f} | {'; '.join(edges)} |")
