"""Tune every method the same way, on validation data, and write presets (``make tune``).

    python -m fedfew.tune --dataset digits --algorithms fedfew fedavg fedrep --trials 12 --jobs 2 \\
        -- trainer.threads=1

For each algorithm, an Optuna study (TPE sampler, seeded) runs the same number of trials. A
trial is one isolated ``python -m fedfew.train`` subprocess per tuning seed with the sampled
values, ``partition.val_fraction`` (``--val-fraction``, default 0.2: a stratified share of each
client's train split held out, never trained on), ``eval.split=val`` (clients select their model
on the train split and are scored on the validation split; the test split is never evaluated,
:mod:`fedfew.core.evaluation`), ``~tuned`` (no existing preset leaks into a trial) and the extra
overrides after ``--``. Its score is the client-mean validation accuracy, averaged over the
last three evaluations of the run (``--objective last3``, default; ``final``: the last one),
then over the tuning seeds.

Search spaces live in one place, one file per algorithm: ``conf/tune/common.yaml`` (the local
learning rate, log-uniform around the dataset's ``dataset.lr``, for every method) plus
``conf/tune/<algorithm>.yaml`` (the method's own keys; ``{}`` for lr only). A key fixed by the
extra overrides is left out of the search; an algorithm left with nothing to search is an
error.

Written to ``<out>`` (default ``<$FEDFEW_OUTPUT_DIR or outputs>/tune/<dataset><setup>``, the setup
named from the extra overrides as a run folder's name is, e.g. ``outputs/tune/digits`` for the
dataset's default setup and ``outputs/tune/digits_partition-pathological``;
:func:`fedfew.experiments.run_folders.setup_folder`):

- ``<algorithm>/study.db``: the Optuna study (SQLite). An interrupted tune resumes: finished
  trials are kept, a trial that was running is run again with the same values, continuing from
  its runs' last checkpoints (every 5 rounds, :mod:`fedfew.experiments.launch`).
- ``<algorithm>/trial<NNN>/seed<S>``: each trial's run folders; ``logs/``: their output.
- ``presets/<dataset>_<algorithm>.yaml``: the best values, with the search space, the trial
  budget, the best validation score, the seeds, the tuning setup and the command as comments.
- ``tune.md``: one line per algorithm (best score, values, trials, time).

With ``--install auto`` (default) the presets are also written to ``conf/tuned/``, where they
apply to every run of that (dataset, algorithm) pair (``optional tuned`` in conf/config.yaml).
When the extra overrides change the setup (the partition, the clients, the model, the rounds
...), they go to ``conf/tuned/<dataset><setup>/`` instead (e.g.
``conf/tuned/digits_partition-dirichlet/``, :func:`setup_presets_dir`): ``make compare`` uses a
preset from there for runs whose setup equals its ``# setup:`` line (:func:`preset_matches`),
and ``make train`` with ``tuned=<dataset><setup>/<dataset>_<algorithm>``. ``--install no``
keeps them in ``<out>/presets`` only (``make compare PRESETS=<out>/presets`` uses them).

The ``--jobs`` workers are shared by all algorithms' studies (:class:`Slots`), each study asking
for its next batch when its previous one has finished; a trial that fails stops its own study,
the others go on, and the error is raised at the end.

Every trial sequence is reproducible: the sampler of each batch of ``--jobs`` trials is seeded
from ``--sampler-seed`` and the number of finished trials, so the same command (same
``--jobs``) chooses the same values, and a resumed tune (``--trials`` may grow) continues as the
uninterrupted one would have. The first ``--startup`` trials (default 4) are random, TPE models
the rest. Hydra's Optuna sweeper (hydra-optuna-sweeper) is not used: it pins optuna < 3.
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import os
import queue
import shlex
import shutil
import sys
import threading
import time
import warnings
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from fedfew.config.compose import ComposeError
from fedfew.config.compose import compose as compose_config
from fedfew.core.checkpoint import ADDED_KEYS
from fedfew.core.io import atomic_write_text
from fedfew.experiments.launch import (Busy, check_not_training, exclusive, launch, outcome, pass_signals_on, progress,
                           refused_checkpoint, stopped_exit_code, tidy)
from fedfew.reporting.partition_report import partition_scheme
from fedfew.experiments.run_folders import diverged_clients, portable_command, portable_overrides, python_command
from fedfew.core.seeding import derive_seed

from fedfew.config import CONFIG_DIR
#: one search-space file per algorithm, plus common.yaml (the local lr, for every method)
SPACE_DIR = CONFIG_DIR / "tune"
#: the presets that apply automatically (conf/tuned/<dataset>_<algorithm>.yaml)
TUNED_DIR = CONFIG_DIR / "tuned"
OBJECTIVES = ("last3", "final")
#: override keys that do not change what a preset is tuned for (threads, logging, engines, paths)
SETUP_NEUTRAL = ("trainer.", "logger", "data_dir", "engine", "engine_clients", "compile", "checkpoint_every",
                 "save_models", "fail_on_nonfinite", "collapse.", "eval_every")
#: keys a comparison (make compare) sets for each run: never in its extra overrides
RUN_KEYS = ("dataset", "algorithm", "seed", "hydra.run.dir", "tuned", "resume")
#: keys the tune sets for each trial: never in its extra overrides
RESERVED = (*RUN_KEYS, "partition.val_fraction", "eval.split")
TRAIN_COMMAND = (sys.executable, "-m", "fedfew.train")
#: what precedes the algorithms runnable_algorithms left out, on the console
LEFT_OUT = "left out (they cannot run on this setup; name them in ALGORITHMS to see the error): "


class TuneError(RuntimeError):
    """The tune cannot run as asked (unknown algorithm, no or empty search space, bad
    overrides, a folder made by a different tune, a failed trial)."""


class TrialDiverged(Exception):
    """A trial's run went non-finite: a client's scored model, a local copy or a personal state
    (:mod:`fedfew.core.nonfinite`), or it stopped early because every client did. The trial is a failed
    trial: it counts in the budget and is never chosen. The message says which run and how."""


class TrialInterrupted(Exception):
    """A trial's run was stopped by a signal (Ctrl-C, SIGTERM, a kill), or the tune is stopping:
    the trial stays running in its study, so the next invocation repeats it from its checkpoint."""


# -- search spaces ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Dimension:
    """One searched key.

    Attributes:
        key: dotted config key (``optim.lr``, ``algorithm.mu``).
        low, high: bounds (inclusive); for ``scale``, multiples of that config value.
        log: sample log-uniformly (low > 0).
        kind: ``float`` | ``int`` | ``categorical``.
        choices: the options of a categorical key.
        scale: a config key whose value multiplies low and high (``dataset.lr``), or None.
    """

    key: str
    low: float | None = None
    high: float | None = None
    log: bool = False
    kind: str = "float"
    choices: tuple = ()
    scale: str | None = None

    @classmethod
    def parse(cls, key: str, spec: Any, source: Path) -> "Dimension":
        """From one entry of a space file (``key: {low, high, log, type, scale}`` or
        ``key: {choices: [...]}``).

        Raises:
            TuneError: a malformed entry (named with its file).
        """
        where = f"{source}: {key}"
        if not isinstance(spec, dict):
            raise TuneError(f"{where}: expected a mapping {{low, high[, log, type, scale]}} or {{choices: [...]}}, "
                            f"got {spec!r}")
        unknown = set(spec) - {"low", "high", "log", "type", "scale", "choices"}
        if unknown:
            raise TuneError(f"{where}: unknown field(s) {sorted(unknown)}; allowed: low, high, log, type, scale, choices")
        if "choices" in spec:
            choices = tuple(spec["choices"] or ())
            if len(choices) < 2:
                raise TuneError(f"{where}: choices needs at least two options, got {list(choices)}")
            return cls(key, kind="categorical", choices=choices)
        kind = str(spec.get("type", "float"))
        if kind not in ("float", "int"):
            raise TuneError(f"{where}: type={kind!r}; allowed: float, int (or choices: [...])")
        try:
            low, high = float(spec["low"]), float(spec["high"])
        except (KeyError, TypeError, ValueError):
            raise TuneError(f"{where}: needs numeric low and high, got {spec!r}") from None
        log = bool(spec.get("log", False))
        if not (math.isfinite(low) and math.isfinite(high) and low < high) or (log and low <= 0):
            raise TuneError(f"{where}: needs low < high (and low > 0 with log: true), got low={low}, high={high}")
        return cls(key, low, high, log, kind, (), spec.get("scale"))

    def resolve(self, cfg) -> "Dimension":
        """Bounds in the run's units: ``scale``'s value (from the composed ``cfg``) times
        low and high.

        Raises:
            TuneError: the key or the scale key is not in the config.
        """
        from omegaconf import OmegaConf

        if OmegaConf.select(cfg, self.key, default=_MISSING) is _MISSING:
            raise TuneError(f"search space key {self.key} is not in the config of algorithm "
                            f"{cfg.algorithm.name}; fix conf/tune/{cfg.algorithm.name}.yaml")
        if self.scale is None:
            return self
        factor = OmegaConf.select(cfg, self.scale, default=_MISSING)
        if factor is _MISSING or not isinstance(factor, (int, float)) or factor <= 0:
            raise TuneError(f"search space {self.key}: scale {self.scale} is not a positive number in the config "
                            f"({factor!r})")
        return Dimension(self.key, self.low * factor, self.high * factor, self.log, self.kind, self.choices, None)

    def suggest(self, trial) -> Any:
        """The value of this key for an Optuna trial: floats rounded to 3 significant digits
        (the run gets exactly the value the preset will hold), ints exact."""
        if self.kind == "categorical":
            return trial.suggest_categorical(self.key, list(self.choices))
        if self.kind == "int":
            return trial.suggest_int(self.key, int(self.low), int(self.high), log=self.log)
        return float(f"{trial.suggest_float(self.key, self.low, self.high, log=self.log):.3g}")

    def position(self, value: Any) -> float | None:
        """Where ``value`` lies in [low, high]: 0 at low, 1 at high, on the log scale for a log
        key (outside the range: below 0 or above 1, -inf for a value <= 0 on a log key); None for a
        categorical key or a value that is not a number (a config default such as apfl's
        ``alpha_lr: null``)."""
        if self.kind == "categorical" or isinstance(value, bool) or not isinstance(value, (int, float)):
            return None
        if self.log:
            return math.log(value / self.low) / math.log(self.high / self.low) if value > 0 else -math.inf
        return (value - self.low) / (self.high - self.low)

    def describe(self) -> str:
        if self.kind == "categorical":
            return f"{self.key} in {list(self.choices)}"
        shape = ("log-uniform" if self.log else "uniform") + (" integer" if self.kind == "int" else "")
        scale = f" x {self.scale}" if self.scale else ""
        return f"{self.key} {shape} [{self.low:.4g}, {self.high:.4g}]{scale}"


_MISSING = object()


def load_space(algorithm: str, space_dir: Path | None = None) -> list[Dimension]:
    """The search space of ``algorithm``: ``common.yaml`` (every method) then
    ``<algorithm>.yaml`` (its own keys), unresolved.

    Raises:
        TuneError: no file for the algorithm, or a malformed one.
    """
    import yaml

    space_dir = SPACE_DIR if space_dir is None else Path(space_dir)
    dims: list[Dimension] = []
    for path in (space_dir / "common.yaml", space_dir / f"{algorithm}.yaml"):
        if not path.exists():
            raise TuneError(f"no search space for algorithm {algorithm}: {path} is missing; add it with the method's "
                            "own keys ({} to tune the local lr only; docs/tuning.md)")
        content = yaml.safe_load(path.read_text()) or {}
        if not isinstance(content, dict):
            raise TuneError(f"{path}: expected a mapping of dotted keys to ranges, got {type(content).__name__}")
        dims += [Dimension.parse(str(k), v, path) for k, v in content.items()]
    return dims


def fixed_keys(extra: Sequence[str]) -> set[str]:
    """Dotted keys set by the extra overrides (``a.b=1``, ``+a.b=1``, ``++a.b=1``)."""
    return {o.split("=", 1)[0].lstrip("+~") for o in extra if "=" in o}


# -- configs ----------------------------------------------------------------------------------

def compose(overrides: Sequence[str]):
    """The run config ``python -m fedfew.train <overrides>`` would get (no run folder).

    Raises:
        TuneError: Hydra cannot compose it (unknown group option, malformed override).
    """
    try:
        return compose_config(overrides)
    except ComposeError as err:
        raise TuneError(f"cannot compose the config with {list(overrides)}: {err}") from err


def check_extra_keys(algorithms: Sequence[str], extra: Sequence[str]) -> None:
    """Refuse, before any run, an override key that none of ``algorithms`` defines (a typo), naming
    the closest valid key; a key only some of them define (``algorithm.mu_prox`` for fedprox) passes
    here and is judged per method by :func:`runnable_algorithms`.

    Raises:
        TuneError: the message of :func:`fedfew.config.overrides.check_overrides` for the first algorithm.
    """
    from fedfew.config.overrides import check_overrides

    first: ValueError | None = None
    for alg in algorithms:
        try:
            check_overrides([f"algorithm={alg}", *extra])
            return
        except ValueError as err:
            first = first or err
    if first is not None:
        raise TuneError(str(first)) from first


def runnable_algorithms(algorithms: Sequence[str], named: bool,
                        overrides_of: Callable[[str], Sequence[str]]) -> tuple[dict[str, Any], list[str]]:
    """The algorithms whose run config validates, with that config, checked before any run
    (``make tune`` and ``make compare`` both use it).

    Args:
        algorithms: the algorithms asked for.
        named: True when the user named them (``ALGORITHMS``): then one that cannot run is an
            error; otherwise (the default list) it is left out with a line saying why, e.g.
            ``oracle`` without client groups, ``fedbn`` on a model without BatchNorm, or a method
            without a key the overrides set (``algorithm.K=5`` for fedavg).
        overrides_of: an algorithm's run overrides, composed and validated exactly as
            ``python -m fedfew.train`` would.
    Returns:
        ({algorithm: its composed config} in the order asked for, ["<algorithm> (<why>)" for
        each one left out]).
    Raises:
        TuneError: a named algorithm's config does not compose or validate, or no algorithm
            can run.
    """
    from fedfew.config.rules import ConfigError, validate_config

    kept: dict[str, Any] = {}
    skipped: list[str] = []
    for alg in algorithms:
        try:
            cfg = compose(overrides_of(alg))
            validate_config(cfg)
        except (TuneError, ConfigError) as err:
            if named:
                raise TuneError(f"{alg} cannot run on this setup: {err}") from err
            why = err.__cause__ if isinstance(err, TuneError) and err.__cause__ else err  # Hydra's own words
            skipped.append(f"{alg} ({' '.join(str(why).split())})")
            continue
        kept[alg] = cfg
    if not kept:
        raise TuneError("no algorithm can run on this setup: " + "; ".join(skipped))
    return kept, skipped


def preset_overrides(path: str | Path) -> list[str]:
    """A preset file's values as command-line overrides (``optim.lr=0.2``, ``algorithm.mu=0.1``),
    to apply a preset that is not in ``conf/tuned`` (with ``~tuned``, which drops the default one).

    Raises:
        TuneError: the file is missing or not a mapping.
    """
    import yaml

    path = Path(path)
    if not path.is_file():
        raise TuneError(f"preset {path} does not exist")
    content = yaml.safe_load(path.read_text()) or {}
    if not isinstance(content, dict):
        raise TuneError(f"preset {path}: expected a mapping, got {type(content).__name__}")

    def flat(node: dict, prefix: str = "") -> list[str]:
        out = []
        for key, value in node.items():
            if isinstance(value, dict):
                out += flat(value, f"{prefix}{key}.")
            else:
                out.append(f"{prefix}{key}={_override_value(value)}")
        return out

    return flat(content)


def _override_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    return str(value)


def describe_setup(cfg) -> str:
    """The setup a preset is tuned for, in words (partition, clients, rounds, budget)."""
    return (f"{cfg.dataset.name}, {partition_scheme(cfg.partition)}, M={cfg.num_clients} clients, {cfg.rounds} rounds, "
            f"{cfg.local_epochs} local epoch(s), batch {cfg.dataset.batch_size}, participation {cfg.participation}, "
            f"model {cfg.model.name}")


def setup_keys(cfg) -> dict[str, Any]:
    """The setup a preset is tuned for, as data: the dataset config (less ``lr``, the search
    range's scale), the partition (less ``val_fraction``, which the tune sets for its trials), the
    model, the local optimizer (less ``lr``, which is searched), M, rounds, local epochs and
    participation. A preset records it in its ``# setup:`` header line; two setups are the same
    when these are equal. The algorithm's own keys are not in it (some are searched)."""
    from omegaconf import OmegaConf

    def plain(node, *drop: str) -> dict[str, Any]:
        out = OmegaConf.to_container(node, resolve=True)
        for key in drop:
            out.pop(key, None)
        return out

    return {"dataset": plain(cfg.dataset, "lr"), "partition": plain(cfg.partition, "val_fraction"),
            "model": plain(cfg.model), "optim": plain(cfg.optim, "lr"), "num_clients": cfg.num_clients,
            "rounds": cfg.rounds, "local_epochs": cfg.local_epochs, "participation": float(cfg.participation),
            "clients_per_round": cfg.get("clients_per_round")}


def preset_header(path: str | Path) -> dict[str, str]:
    """The ``# <field>: <value>`` lines of a preset's header, e.g. ``{"tuned for": "digits, ..."}``."""
    fields = {}
    for line in Path(path).read_text().splitlines():
        if not line.startswith("#"):
            break
        field, sep, value = line[1:].partition(":")
        if sep:
            fields.setdefault(field.strip(), value.strip())
    return fields


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1} (a key "" names its parent)."""
    if not isinstance(tree, dict):
        return {prefix.rstrip("."): tree}
    return {k: v for key, value in tree.items() for k, v in _flat(value, f"{prefix}{key}." if key else prefix).items()}


def setup_differences(path: str | Path, cfg) -> list[str] | None:
    """How ``cfg``'s setup differs from the one the preset at ``path`` was tuned for: ``[]`` when
    it is the same, e.g. ``["rounds: 50 in the preset, 1 here"]``, or None when the preset records
    no setup. Compared on its ``# setup:`` line with :func:`setup_keys`; a preset without one (or
    with one that does not parse) on its ``# tuned for:`` line with :func:`describe_setup`."""
    header = preset_header(path)
    try:
        tuned = json.loads(header["setup"]) if "setup" in header else None
    except json.JSONDecodeError:
        tuned = None
    if isinstance(tuned, dict):
        for dotted, default in ADDED_KEYS.items():  # a preset from before the key: it had the old behaviour
            section, _, key = dotted.partition(".")
            if isinstance(tuned.get(section), dict):
                tuned[section].setdefault(key, default)
        here = json.loads(json.dumps(setup_keys(cfg)))
        out = []
        for section in [*tuned, *(k for k in here if k not in tuned)]:
            a, b = tuned.get(section, "(absent)"), here.get(section, "(absent)")
            if a == b:
                continue
            if isinstance(a, dict) and isinstance(b, dict) and a.get("name") != b.get("name"):
                a, b = {"": a.get("name")}, {"": b.get("name")}  # another partition / model / ...: its name says it
            a, b = _flat(a, f"{section}."), _flat(b, f"{section}.")
            out += [f"{key}: {a.get(key, '(absent)')} in the preset, {b.get(key, '(absent)')} here"
                    for key in [*a, *(k for k in b if k not in a)] if a.get(key, "(absent)") != b.get(key, "(absent)")]
        return out
    if "tuned for" in header:
        here_words = describe_setup(cfg)
        return [] if header["tuned for"] == here_words else [f"{header['tuned for']} in the preset, {here_words} here"]
    return None


def preset_matches(path: str | Path, cfg) -> bool | None:
    """Whether the preset at ``path`` was tuned for ``cfg``'s setup (:func:`setup_differences`
    is empty); None when the preset records no setup (a hand-written file)."""
    differences = setup_differences(path, cfg)
    return None if differences is None else not differences


def setup_preset(name: str, cfg) -> Path | None:
    """The preset ``conf/tuned/<setup folder>/<name>`` tuned for ``cfg``'s setup (the first in
    folder order), or None."""
    return next((p for p in sorted(TUNED_DIR.glob(f"*/{name}")) if preset_matches(p, cfg)), None)


def preset_note(choice: str | None, cfg) -> str | None:
    """What a run should be told about its preset ``conf/tuned/<choice>.yaml`` (Hydra's ``tuned``
    choice; None under ``~tuned``): None when it is the run's algorithm's and was tuned for
    ``cfg``'s setup (or records none, or there is none), else what differs, and the ``tuned=``
    choice of a preset in a setup folder that was tuned for this setup."""
    path = TUNED_DIR / f"{choice}.yaml" if choice else None
    if path is None or not path.is_file():
        return None
    own = f"{cfg.dataset.name}_{cfg.algorithm.name}"
    if path.stem != own:
        return f"preset conf/tuned/{choice}.yaml is not {own}'s: its values were tuned for another method"
    differences = setup_differences(path, cfg)
    if not differences:
        return None
    match = setup_preset(path.name, cfg)
    fix = (f"add tuned={match.parent.name}/{match.stem}, tuned for this setup" if match else
           "no preset in conf/tuned was tuned for this setup (make tune with the same overrides makes one: "
           "docs/tuning.md)")
    return f"preset conf/tuned/{choice}.yaml was tuned for another setup ({'; '.join(differences)}): {fix}"


def setup_presets_dir(dataset: str, extra: Sequence[str]) -> Path:
    """Where ``--install`` puts presets: ``conf/tuned`` for the dataset's default setup, and
    ``conf/tuned/<dataset><setup>`` (named as :func:`fedfew.experiments.run_folders.setup_folder` names a tune's
    folder, e.g. ``conf/tuned/digits_partition-dirichlet``) when the extra overrides change the
    setup; ``make compare`` picks a preset from there when its setup equals the runs'."""
    from fedfew.experiments.run_folders import setup_folder

    changing = setup_changing(extra)
    return TUNED_DIR / setup_folder("tune", dataset, changing).name if changing else TUNED_DIR


# -- one algorithm's study --------------------------------------------------------------------

@dataclass
class Plan:
    """Everything a tune of one algorithm needs (the study's identity is ``settings``)."""

    dataset: str
    algorithm: str
    space: list[Dimension]
    seeds: list[int]
    trials: int
    jobs: int
    extra: list[str]
    val_fraction: float
    objective: str
    sampler_seed: int
    startup: int
    out: Path
    cfg: Any = None
    settings: dict[str, Any] = field(default_factory=dict)
    #: seeds the best candidate is confirmed on (the trials run on ``seeds``)
    confirm_seeds: list[int] = field(default_factory=list)
    #: the stability margin: the chosen values are also run at this multiple of their lr
    stability: float = 1.5

    @property
    def dir(self) -> Path:
        return self.out / self.algorithm

    def trial_overrides(self, values: dict[str, Any], seed: int, run_dir: Path) -> list[str]:
        """Hydra overrides of one trial run (the searched values after the extra overrides)."""
        return [f"dataset={self.dataset}", f"algorithm={self.algorithm}", f"seed={seed}", "~tuned", "logger=none",
                *self.extra, f"partition.val_fraction={self.val_fraction}", "eval.split=val",
                *(f"{k}={_override_value(v)}" for k, v in values.items()), f"hydra.run.dir={run_dir}"]


def score(results: dict[str, Any], objective: str) -> float:
    """A run's tuning score from its results.json: client-mean validation accuracy, the mean of
    the last three evaluations (``last3``) or the final one (``final``).

    Raises:
        TuneError: the run was not scored on the validation split.
    """
    split = results["summary"].get("eval_split")
    if split != "val":
        raise TuneError(f"a trial run was scored on the {split!r} split, not on validation; refusing to use it")
    if objective == "final":
        return float(results["summary"]["acc_mean"])
    accs = [float(e["acc_mean"]) for e in results.get("evaluations", [])][-3:]
    return sum(accs) / len(accs)


def run_trial(plan: Plan, name: str, values: dict[str, Any], command: Sequence[str],
              stop: threading.Event | None = None, seeds: Sequence[int] | None = None) -> tuple[float, float, float]:
    """Train one trial (one run per tuning seed, in turn) into ``<out>/<algorithm>/<name>``.

    A seed's folder left by an interrupted tune is picked up when it holds this run's results
    (reused) or checkpoint (continued, :mod:`fedfew.experiments.launch`); anything else there is removed and
    the run starts afresh, as it does when ``fedfew.train`` refuses the checkpoint (e.g. a config
    key added since).

    Args:
        name: ``trial<NNN>`` (Optuna's trial number) or ``defaults`` (the config defaults).
        values: the searched keys' values (none: the config defaults).
        stop: when set, no further seed is started.
        seeds: the seeds to run (default ``plan.seeds``; the confirmation runs ``plan.confirm_seeds``).

    Returns:
        (score: mean over seeds, wall seconds (a continued run counts its rounds before the
        interruption too), CPU seconds of this invocation's processes).
    Raises:
        TuneError: a run failed (its log's tail in the message; its checkpoint is deleted).
        TrialDiverged: a run went non-finite (:func:`nonfinite_reason`).
        TrialInterrupted: a run was stopped by a signal, or ``stop`` was set.
    """
    scores, wall, cpu = [], 0.0, 0.0
    for seed in (plan.seeds if seeds is None else seeds):
        if stop is not None and stop.is_set():
            raise TrialInterrupted(f"{plan.algorithm} {name}: the tune is stopping")
        run_dir = plan.dir / name / f"seed{seed}"
        log_path = plan.out / "logs" / f"{plan.algorithm}_{name}_seed{seed}.log"
        overrides = plan.trial_overrides(values, seed, run_dir)
        try:  # before anything in the folder is removed
            check_not_training(run_dir)
        except Busy as err:
            raise TuneError(f"{plan.algorithm} {name} (seed {seed}): {err}") from None
        state = progress(run_dir, overrides)
        if state in ("stale", "none"):
            shutil.rmtree(run_dir, ignore_errors=True)
        results_path = run_dir / "results.json"
        code, seconds = 0, 0.0
        if state == "done":
            tidy(run_dir, overrides)  # finished by a run a killed tune left behind
        else:
            code, seconds, used, resumed = launch(overrides, run_dir, log_path, command)
            cpu += used
            if resumed and code != 0 and refused_checkpoint(log_path):  # config changed since: start afresh
                shutil.rmtree(run_dir, ignore_errors=True)
                code, seconds, used, _ = launch(overrides, run_dir, log_path, command)
                cpu += used
        end = outcome(code, run_dir)
        if end == "interrupted":
            raise TrialInterrupted(f"{plan.algorithm} {name} (seed {seed}) was stopped by a signal "
                                   f"(exit code {code}); its checkpoint is kept")
        if end == "failed":
            shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # a failed trial is not repeated
            tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-15:])
            raise TuneError(f"{plan.algorithm} {name} (seed {seed}, {values or 'config defaults'}) failed; "
                            f"log {log_path}:\n{tail}")
        results = json.loads(results_path.read_text())
        wall += max(seconds, float(results.get("wall_time_s") or 0.0))
        why = nonfinite_reason(results)
        if end == "diverged" or why:
            raise TrialDiverged(f"seed {seed}: {why or 'every client went non-finite'}")
        scores.append(score(results, plan.objective))
    return sum(scores) / len(scores), wall, cpu


def nonfinite_reason(results: dict[str, Any]) -> str | None:
    """Why a run counts as diverged for tuning, or None: it stopped early (``verdict: diverged``),
    some client's scored model is non-finite (:func:`fedfew.experiments.run_folders.diverged_clients`), or some client's
    local copy, update or personal state went non-finite in some round (results.json
    ``nonfinite``, :mod:`fedfew.core.nonfinite`), e.g. ``client 3: local copy of model 2 from round 42``."""
    record = results.get("nonfinite") or {}
    if record.get("stopped_at") is not None:
        return f"every client non-finite, stopped after round {record['stopped_at']}"
    clients = record.get("clients") or {}
    if clients:
        cid, first = min(((c, r) for c, r in clients.items()), key=lambda cr: (cr[1]["first_round"], int(cr[0])))
        return (f"{len(clients)} client(s) non-finite, first client {cid}: {', '.join(first['what'])} "
                f"at round {first['first_round']}")
    diverged = diverged_clients(results)
    if diverged:
        return f"the scored model of client(s) {diverged} is non-finite"
    return None


_ECHO_LOCK = threading.Lock()


def _echo(line: str) -> None:
    """One whole line to stdout, flushed (the studies report from several threads)."""
    with _ECHO_LOCK:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def open_study(plan: Plan):
    """The algorithm's study in ``<out>/<algorithm>/study.db`` (created, or resumed).

    A study is resumed when it was made with the same settings, up to extra overrides that do not
    change results (:func:`fedfew.experiments.run_folders.result_overrides`: a thread count, a logger, ``data_dir``),
    and from the same data, by content: a new study records the ``data_fingerprint`` of the data in
    ``plan.cfg.data_dir`` (:mod:`fedfew.data.fingerprint`), which a resume compares; a study made
    before the fingerprint was recorded is compared through one of its finished runs
    (:func:`fedfew.experiments.run_folders.data_mismatch`). So a tune copied with the repository resumes from a
    clone anywhere, the data anywhere. Without ``plan.cfg`` the data is not checked.

    Raises:
        TuneError: the folder holds a study made with different settings, or from other data (the
            message names both fingerprints or partition hashes), or the data cannot be read.
    """
    import optuna

    from fedfew.data.fingerprint import data_check
    from fedfew.experiments.run_folders import data_mismatch, recorded_data, result_overrides

    plan.dir.mkdir(parents=True, exist_ok=True)
    storage = f"sqlite:///{plan.dir / 'study.db'}"
    study = optuna.create_study(study_name=f"{plan.dataset}_{plan.algorithm}", storage=storage,
                                direction="maximize", load_if_exists=True)

    # settings added since studies were first recorded that shape only the runs after the search (the
    # confirmation seeds, the stability margin), never its trials: a study recorded before them lacks
    # them and is the same study
    after_search = ("confirm_seeds", "stability")

    def identity(settings: dict[str, Any]) -> dict[str, Any]:
        # another thread count (JOBS=1 after JOBS=2), logger or data folder is the same study
        return {**settings, "extra": result_overrides(settings.get("extra", []))}

    recorded = study.user_attrs.get("settings")
    wanted = json.loads(json.dumps(plan.settings))
    if recorded is not None:
        wanted = {k: v for k, v in wanted.items() if k in recorded or k not in after_search}
    if recorded is not None and identity(recorded) != identity(wanted):
        old, new = identity(recorded), identity(wanted)
        changed = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
        raise TuneError(f"{plan.dir} holds a tune of {plan.algorithm} made with other settings ({', '.join(changed)}); "
                        f"use another --out (TUNE_OUT=...) or delete {plan.dir}")
    why, fingerprint = None, None
    if plan.cfg is not None:
        from omegaconf import OmegaConf

        data_dir = plan.cfg.data_dir
        check = data_check(data_dir)
        try:
            config = OmegaConf.to_container(plan.cfg, resolve=True)
            fingerprint = check.fingerprint(config)
            if recorded is not None and study.user_attrs.get("data_fingerprint"):
                why = check.mismatch({"config": config, "data_fingerprint": study.user_attrs["data_fingerprint"]})
            elif recorded is not None:  # made before studies recorded their data: a finished run of it tells
                run = next((r.parent for r in sorted(plan.dir.glob("*/seed*/results.json"))
                            if check.recorded(recorded_data(r.parent) or {})), None)
                why = None if run is None else data_mismatch(run, data_dir)
        except (OSError, ValueError) as err:  # DataNotFoundError, a malformed file, a partition that fails
            raise TuneError(f"cannot read the data of the tune of {plan.algorithm} in {check.data_dir} (to compare it "
                            f"with the data its study was made from): {type(err).__name__}: {err}") from err
    if why:
        raise TuneError(f"{plan.dir} holds a tune of {plan.algorithm} made from other data ({why}); a tune resumes on "
                        f"the same data only, wherever that lies: point data_dir at the data it was made from, use "
                        f"another --out (TUNE_OUT=...) or delete {plan.dir}")
    if recorded is None:
        study.set_user_attr("settings", plan.settings)
        if fingerprint:
            study.set_user_attr("data_fingerprint", fingerprint)
    return study


def _requeue_interrupted(study, plan: Plan, echo) -> None:
    """Trials left running by an interrupted tune: their values queued again, with the folder to
    continue from (``resume_from``, :func:`_take_over`), then the trial marked failed."""
    from optuna.trial import TrialState

    trials = study.get_trials(deepcopy=False)
    for trial in trials:
        if trial.state != TrialState.RUNNING:
            continue
        source = trial.number  # a repeat killed before it took its folder over: that folder's owner
        while not (plan.dir / f"trial{source:03d}").is_dir() and trials[source].user_attrs.get("resume_from") is not None:
            source = int(trials[source].user_attrs["resume_from"])
        study.enqueue_trial(dict(trial.params), user_attrs={"resume_from": source})
        study.tell(trial.number, state=TrialState.FAIL)
        echo(f"  {plan.algorithm}: trial {trial.number} did not finish in the last invocation; running it again with "
             "the same values, from its checkpoint where it has one")


def _take_over(plan: Plan, trial) -> None:
    """Move the folder of the interrupted trial that ``trial`` repeats (if any) to ``trial``'s, so
    its finished seeds are reused and its checkpoints continued (:func:`run_trial`)."""
    source = trial.user_attrs.get("resume_from")
    if source is None:
        return
    old, new = plan.dir / f"trial{int(source):03d}", plan.dir / f"trial{trial.number:03d}"
    if old.is_dir() and old != new:
        shutil.rmtree(new, ignore_errors=True)
        old.rename(new)
        for seed in plan.seeds:  # the logs go with it (a continued run appends to its log)
            log = plan.out / "logs" / f"{plan.algorithm}_trial{int(source):03d}_seed{seed}.log"
            if log.exists():
                log.rename(plan.out / "logs" / f"{plan.algorithm}_trial{trial.number:03d}_seed{seed}.log")


def completed(study) -> list:
    """The study's finished trials (the sampled ones; the defaults are a study attribute)."""
    from optuna.trial import TrialState

    return study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))


def default_values(plan: Plan) -> dict[str, Any]:
    """The searched keys' values in the method's own config (what a run without a preset uses)."""
    from omegaconf import OmegaConf

    return {d.key: OmegaConf.select(plan.cfg, d.key) for d in plan.space}


@dataclass(frozen=True)
class Choice:
    """The preset's values: the best finite candidate confirmed on the confirmation seeds
    (:func:`_confirm`), with what the stability margin showed."""

    value: float
    values: dict[str, Any]
    label: str  # "trial 7" or "the config defaults"
    seed: int = 0  # the trial seed that ``value`` is from
    confirmed: dict = field(default_factory=dict)  # confirmation seed (str) -> validation score
    rejected: dict = field(default_factory=dict)  # label -> why it diverged on a confirmation seed
    margin: dict | None = None  # lr, factor, diverged (why, or None), value


class Slots:
    """``jobs`` worker threads shared by every algorithm's study (``--jobs``).

    A free worker takes the waiting run of the earliest-listed algorithm (``priority``), so while
    one algorithm waits for the last run of a batch (with 6 trials and 2 jobs, its config
    defaults run alone at the end), the next algorithm's trial fills the idle worker. The values
    a study chooses do not depend on this packing: it asks for its next batch only once its
    previous batch has finished, whatever else runs. After :meth:`stop`, nothing new starts.
    """

    def __init__(self, jobs: int):
        self.stopped = threading.Event()
        self._queue: queue.PriorityQueue = queue.PriorityQueue()
        self._order = itertools.count()
        self._workers = [threading.Thread(target=self._work, daemon=True) for _ in range(max(1, jobs))]
        for worker in self._workers:
            worker.start()

    def submit(self, priority: int, fn: Callable[..., Any], *args: Any) -> Future:
        """Queue ``fn(*args)``; lower ``priority`` first, then first come first served. After
        :meth:`stop`: a cancelled future."""
        future: Future = Future()
        if self.stopped.is_set():
            future.cancel()
        else:
            self._queue.put((priority, next(self._order), fn, args, future))
        return future

    def _work(self) -> None:
        while True:
            _, _, fn, args, future = self._queue.get()
            if fn is None:
                return
            if self.stopped.is_set():
                future.cancel()
            elif future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as err:  # handed to whoever waits on the future
                    future.set_exception(err)

    def stop(self) -> None:
        """Start nothing new: queued runs are cancelled, later submissions too; running ones go on."""
        self.stopped.set()
        while True:
            try:
                _, _, fn, _, future = self._queue.get_nowait()
            except queue.Empty:
                return
            if fn is not None:
                future.cancel()

    def close(self, wait: bool = True) -> None:
        """Stop the workers once the queue is done (``wait``: and wait for them)."""
        for _ in self._workers:
            self._queue.put((math.inf, next(self._order), None, (), None))
        if wait:
            for worker in self._workers:
                worker.join()


# TPESampler's construction silences an ExperimentalWarning: warnings filters are process-wide
_SAMPLER_LOCK = threading.Lock()


def tune_algorithm(plan: Plan, command: Sequence[str] = TRAIN_COMMAND, echo: Callable[[str], None] = _echo,
                   slots: Slots | None = None, priority: int = 0, queued: threading.Event | None = None):
    """Run ``plan.trials`` trials of one algorithm (``plan.jobs`` at a time); returns the study.

    Args:
        slots: the workers shared with other algorithms' studies (None: this study's own).
        priority: this study's place in the algorithm list (:class:`Slots`).
        queued: set once the first batch is queued (or the study has nothing to run).
    Raises:
        TuneError: a trial failed (the study keeps the finished ones; rerun to resume).
        TrialInterrupted: a run was stopped by a signal or ``slots`` stopped (the running trials
            stay running in the study: the next invocation repeats them from their checkpoints).
    """
    own = slots is None
    slots = Slots(plan.jobs) if slots is None else slots
    try:
        return _tune(plan, command, echo, slots, priority, queued or threading.Event())
    finally:
        if queued is not None:
            queued.set()
        if own:
            slots.close()


def _tune(plan: Plan, command: Sequence[str], echo: Callable[[str], None], slots: Slots, priority: int,
          queued: threading.Event):
    import optuna
    from optuna.trial import TrialState

    study = open_study(plan)
    _requeue_interrupted(study, plan, echo)
    while True:
        if slots.stopped.is_set():
            raise TrialInterrupted(f"{plan.algorithm}: the tune is stopping")
        done = len(finished(study))
        batch = min(plan.jobs, plan.trials - done)
        with_defaults = "defaults" not in study.user_attrs and batch < plan.jobs
        if batch <= 0 and not with_defaults:
            break
        asked: list[tuple[Any, dict[str, Any]]] = []
        if batch > 0:
            with _SAMPLER_LOCK, warnings.catch_warnings():  # multivariate and constant_liar are experimental
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                study.sampler = optuna.samplers.TPESampler(
                    seed=derive_seed(plan.sampler_seed, "tune", plan.dataset, plan.algorithm, done) % 2**32,
                    n_startup_trials=plan.startup, multivariate=True, constant_liar=batch > 1)
            for _ in range(batch):
                trial = study.ask()
                values = {d.key: d.suggest(trial) for d in plan.space}
                trial.set_user_attr("values", values)
                asked.append((trial, values))
        if with_defaults:  # the method's own defaults, once, in the room left by the last batch
            asked.append((None, {}))

        for trial, _ in asked:
            if trial is not None:
                _take_over(plan, trial)
        futures = [slots.submit(priority, run_trial, plan, "defaults" if trial is None else f"trial{trial.number:03d}",
                                values, command, slots.stopped) for trial, values in asked]
        queued.set()
        # the batch's results, in the order asked
        errors, stopped = [], None
        for (trial, values), future in zip(asked, futures):
            try:
                value, wall, cpu = future.result()
            except (TrialInterrupted, CancelledError) as err:  # not told: it stays running, to be repeated
                stopped = stopped or err
                continue
            except TuneError as err:
                if trial is not None:
                    study.tell(trial, state=TrialState.FAIL)
                errors.append(err)
                continue
            except TrialDiverged as err:  # a failed trial: it counts in the budget, it is never chosen
                label = "config defaults" if trial is None else f"trial {trial.number}"
                if trial is None:
                    study.set_user_attr("defaults", {"value": None, "values": default_values(plan), "diverged": str(err)})
                else:
                    trial.set_user_attr("diverged", str(err))
                    study.tell(trial, state=TrialState.FAIL)
                echo(f"  {plan.algorithm} {label}: {_fmt_values(values or default_values(plan))} -> DIVERGED ({err}); "
                     "a failed trial")
                continue
            if trial is None:
                values = default_values(plan)
                study.set_user_attr("defaults", {"value": value, "values": values, "wall_s": wall, "cpu_s": cpu})
                echo(f"  {plan.algorithm} config defaults: {_fmt_values(values)} -> validation acc {value:.4f} "
                     f"({wall:.0f} s wall, {cpu:.0f} s CPU)")
                continue
            trial.set_user_attr("wall_s", wall)
            trial.set_user_attr("cpu_s", cpu)
            study.tell(trial, value)
            echo(f"  {plan.algorithm} trial {trial.number} ({len(finished(study))}/{plan.trials}): "
                 f"{_fmt_values(values)} -> validation acc {value:.4f} ({wall:.0f} s wall, {cpu:.0f} s CPU)")
        if errors:
            raise errors[0]
        if stopped is not None:
            raise stopped if isinstance(stopped, TrialInterrupted) else TrialInterrupted(
                f"{plan.algorithm}: the tune is stopping")
    _confirm(plan, study, command, echo, slots, priority)
    return study


def finished(study) -> list:
    """The trials that count in the budget: the completed ones and those that diverged (failed
    trials); not those an interruption left to be repeated."""
    from optuna.trial import TrialState

    return [t for t in study.get_trials(deepcopy=False) if t.state == TrialState.COMPLETE
            or (t.state == TrialState.FAIL and t.user_attrs.get("diverged"))]


def ranked_candidates(study) -> list[tuple[str, dict[str, Any], float, str]]:
    """The finite candidates, best validation score first: ``(folder name, the values the run
    used, score, label)`` of every completed trial and of the config defaults (whose values are
    ``{}``: the run uses the config itself). On a tie a trial comes before the defaults and an
    earlier trial before a later one (the defaults win only when strictly better, as before)."""
    out = [(f"trial{t.number:03d}", dict(t.user_attrs["values"]), float(t.value), f"trial {t.number}", (0, t.number))
           for t in completed(study)]
    defaults = study.user_attrs.get("defaults") or {}
    if defaults.get("value") is not None:
        out.append(("defaults", {}, float(defaults["value"]), "the config defaults", (1, 0)))
    return [c[:4] for c in sorted(out, key=lambda c: (-c[2], c[4]))]


def margin_values(plan: Plan, values: dict[str, Any]) -> dict[str, Any]:
    """``values`` with the local lr at ``plan.stability`` times its value (3 significant digits)."""
    from omegaconf import OmegaConf

    lr = float(values.get("optim.lr", OmegaConf.select(plan.cfg, "optim.lr")))
    return {**values, "optim.lr": float(f"{lr * plan.stability:.3g}")}


def _confirm(plan: Plan, study, command: Sequence[str], echo: Callable[[str], None], slots: Slots,
             priority: int) -> None:
    """Choose the preset: the best finite candidate (:func:`ranked_candidates`) that stays finite
    on every confirmation seed (``plan.confirm_seeds``; a candidate that diverges there is
    rejected and the next one confirmed), and its stability margin (the same values at
    ``plan.stability`` x its lr on the first trial seed, run beside the confirmation; whether it
    diverged is reported, not a reason to reject). The result is the study's ``choice`` attribute
    (:func:`choice`); every run is a folder (``<name>/seed<S>``, ``<name>_lr<x>x/seed<S>``) reused
    on the next invocation.

    Raises:
        TuneError: no candidate stayed finite, or a run failed.
        TrialInterrupted: the tune is stopping.
    """
    rejected: dict[str, str] = {}
    for name, values, value, label in ranked_candidates(study):
        margin = margin_values(plan, values)
        margin_future = slots.submit(priority, run_trial, plan, f"{name}_lr{plan.stability:g}x", margin, command,
                                     slots.stopped, plan.seeds[:1])
        confirmed: dict[str, float] = {}
        try:
            if plan.confirm_seeds:
                for seed in plan.confirm_seeds:
                    future = slots.submit(priority, run_trial, plan, name, values, command, slots.stopped, [seed])
                    confirmed[str(seed)] = future.result()[0]
        except TrialDiverged as err:
            rejected[label] = str(err)
            echo(f"  {plan.algorithm} {label}: DIVERGED on a confirmation seed ({err}); rejected, the next candidate "
                 "is confirmed")
            _wait_quietly(margin_future)
            continue
        except CancelledError:
            raise TrialInterrupted(f"{plan.algorithm}: the tune is stopping") from None
        try:
            margin_value, _, _ = margin_future.result()
            stability = {"lr": margin["optim.lr"], "factor": plan.stability, "diverged": None, "value": margin_value}
        except TrialDiverged as err:
            stability = {"lr": margin["optim.lr"], "factor": plan.stability, "diverged": str(err), "value": None}
        except CancelledError:
            raise TrialInterrupted(f"{plan.algorithm}: the tune is stopping") from None
        chosen_values = values if name != "defaults" else dict(study.user_attrs["defaults"]["values"])
        study.set_user_attr("choice", {"name": name, "label": label, "values": chosen_values, "value": value,
                                       "seed": plan.seeds[0], "confirmed": confirmed, "rejected": rejected,
                                       "margin": stability})
        scores = ", ".join(f"seed {s}: {v:.4f}" for s, v in confirmed.items()) or "not confirmed (one tuning seed)"
        margin_text = (f"diverged ({stability['diverged']})" if stability["diverged"] else
                       f"finite, validation {stability['value']:.4f}")
        echo(f"  {plan.algorithm}: {label} confirmed ({scores}); at {plan.stability:g}x its lr "
             f"(optim.lr={margin['optim.lr']}): {margin_text}")
        return
    raise TuneError(f"{plan.algorithm}: no configuration stayed finite: every trial and the config defaults diverged "
                    f"on the tuning or a confirmation seed ({'; '.join(f'{k}: {v}' for k, v in rejected.items()) or 'see above'}); "
                    "set optim.clip_norm, or lower the lr range of conf/tune/common.yaml (for every method)")


def _wait_quietly(future: Future) -> None:
    """Wait for a run whose result is no longer needed (its folder stays for a later invocation)."""
    try:
        future.result()
    except (TrialDiverged, TuneError, TrialInterrupted, CancelledError):
        pass


def choice(study) -> Choice:
    """What the preset holds: the candidate :func:`_confirm` chose (the best finite one that
    stayed finite on the confirmation seeds; the config defaults only when strictly better than
    every trial, so a preset never scores below the defaults it replaces).

    Raises:
        TuneError: the study has not been through the confirmation yet.
    """
    chosen = study.user_attrs.get("choice")
    if chosen is None:
        raise TuneError("the study has no confirmed choice yet; run the same make tune command again")
    return Choice(float(chosen["value"]), dict(chosen["values"]), chosen["label"], int(chosen.get("seed", 0)),
                  dict(chosen.get("confirmed", {})), dict(chosen.get("rejected", {})), chosen.get("margin"))


#: a chosen value this close to a bound (a fraction of the range, log scale for a log key) is reported
EDGE = 0.1


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


def _fmt_values(values: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in values.items())


# -- presets ----------------------------------------------------------------------------------

def nest(values: dict[str, Any]) -> dict[str, Any]:
    """{"optim.lr": 0.2, "algorithm.mu": 0.1} -> {"optim": {"lr": 0.2}, "algorithm": {"mu": 0.1}}."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        node = out
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


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
        f"# made by: {os.environ.get('FEDFEW_TUNE_MADE_BY') or 'python -m fedfew.tune'} on "
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


def setup_changing(extra: Sequence[str]) -> list[str]:
    """The extra overrides that change what a preset is tuned for (not threads, logging, paths)."""
    return [o for o in extra if not o.split("=", 1)[0].lstrip("+~").startswith(SETUP_NEUTRAL)]


# -- command line -----------------------------------------------------------------------------

def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    argv = list(argv)
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    parser = argparse.ArgumentParser(prog=python_command("fedfew.tune"), description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", default="digits", help="dataset config value (default digits)")
    parser.add_argument("--algorithms", nargs="+", required=False, default=None,
                        help="algorithm config values (default: every registered one that can run on the setup)")
    parser.add_argument("--trials", type=int, default=12, help="finished trials per algorithm (default 12)")
    parser.add_argument("--jobs", type=int, default=1, help="trials at a time (default 1)")
    parser.add_argument("--seeds", nargs="*", type=int, default=[0, 1],
                        help="tuning seeds: every trial runs on the first; the best candidate is confirmed on the others "
                             "(default 0 1; a candidate that goes non-finite there is rejected)")
    parser.add_argument("--stability", type=float, default=1.5,
                        help="the chosen values are also run at this multiple of their lr, to report how close to the "
                             "edge of stability the preset sits (default 1.5; > 1)")
    parser.add_argument("--val-fraction", type=float, default=0.2,
                        help="partition.val_fraction of the trials (default 0.2; must be in (0, 1))")
    parser.add_argument("--objective", choices=OBJECTIVES, default="last3",
                        help="last3: mean validation acc of the last 3 evaluations (default) | final")
    parser.add_argument("--sampler-seed", type=int, default=0, help="seed of the TPE sampler (default 0)")
    parser.add_argument("--startup", type=int, default=4,
                        help="random trials before TPE starts modelling (default 4)")
    parser.add_argument("--out", default=None,
                        help="output folder (default $FEDFEW_OUTPUT_DIR or outputs, then tune/<dataset>, plus the "
                             "extra overrides as in a run folder's name, e.g. outputs/tune/digits_partition-pathological)")
    parser.add_argument("--install", choices=("auto", "yes", "no"), default="auto",
                        help="also write the presets to conf/tuned (auto, the default; yes is the same): to "
                             "conf/tuned/<dataset><setup>/ when the extra overrides change the setup | no")
    parser.add_argument("--print-overrides", metavar="PRESET", default=None,
                        help="print a preset file's values as overrides and exit (apply with ~tuned)")
    args = parser.parse_args(argv)
    args.extra = [e for e in extra if e.strip()]
    if args.algorithms is not None:
        args.algorithms = [a for item in args.algorithms for a in item.split()]
    return args


def plans(args: argparse.Namespace) -> list[Plan]:
    """Check everything and compose each algorithm's trial config, before any run.

    Without ``--algorithms``, every registered algorithm whose config validates on this setup
    (e.g. not ``oracle`` without client groups, not ``fedbn`` on a model without BatchNorm).

    Raises:
        TuneError: bad counts, reserved or zero-validation overrides, an unknown algorithm,
            a missing/malformed/empty search space, a named algorithm whose config does not
            validate.
    """
    from fedfew.algorithms import ALGORITHMS
    from fedfew.experiments.run_folders import setup_folder

    if args.trials < 1 or args.jobs < 1:
        raise TuneError(f"--trials ({args.trials}) and --jobs ({args.jobs}) must be >= 1")
    if not args.seeds or len(set(args.seeds)) != len(args.seeds) or min(args.seeds) < 0:
        raise TuneError(f"--seeds {' '.join(map(str, args.seeds)) or '(none)'}: give one or more distinct seeds >= 0, "
                        "e.g. TUNE_SEEDS=\"0 1\" (trials on 0, the best confirmed on 1)")
    if not (args.stability > 1 and math.isfinite(args.stability)):
        raise TuneError(f"--stability {args.stability}: the margin run uses this multiple of the chosen lr; give a "
                        "number > 1, e.g. 1.5")
    if args.startup < 0:
        raise TuneError(f"--startup must be >= 0, got {args.startup}")
    if not 0 < args.val_fraction < 1:
        raise TuneError(f"--val-fraction={args.val_fraction}: tuning scores each client on its validation split, "
                        "so it must be in (0, 1), e.g. 0.2 (VAL_FRACTION=0.2 with make tune)")
    reserved = [o for o in args.extra if o.split("=", 1)[0].lstrip("+~") in RESERVED]
    if reserved:
        raise TuneError(f"{reserved}: dataset, algorithm, seed, run folder, validation split and presets are set by "
                        "the tune, which also resumes interrupted runs itself "
                        "(use --dataset/--algorithms/--seeds/--val-fraction)")
    algorithms = args.algorithms or sorted(ALGORITHMS.names(), key=lambda n: (n != "fedfew", n))
    unknown = [a for a in algorithms if a not in ALGORITHMS.names()]
    if unknown:
        raise TuneError(f"unknown algorithm(s) {unknown}; known: {', '.join(sorted(ALGORITHMS.names()))}")
    if len(set(algorithms)) != len(algorithms):
        raise TuneError(f"an algorithm is listed twice: {algorithms}")
    check_extra_keys(algorithms, args.extra)
    out = Path(args.out).expanduser().resolve() if args.out else setup_folder("tune", args.dataset, args.extra)
    startup = args.startup
    fixed = fixed_keys(args.extra)
    made: dict[str, Plan] = {}
    for alg in algorithms:
        dims = [d for d in load_space(alg) if d.key not in fixed]
        if not dims:
            raise TuneError(f"empty search space for {alg}: every key of conf/tune/common.yaml and "
                            f"conf/tune/{alg}.yaml is fixed by the extra overrides ({sorted(fixed)}); "
                            "drop those overrides or add keys to the space")
        made[alg] = Plan(args.dataset, alg, dims, list(args.seeds[:1]), args.trials, args.jobs, list(args.extra),
                         args.val_fraction, args.objective, args.sampler_seed, startup, out,
                         confirm_seeds=list(args.seeds[1:]), stability=args.stability)
    # a trial of each algorithm with its config defaults is what must validate
    configs, left_out = runnable_algorithms(
        algorithms, named=bool(args.algorithms),
        overrides_of=lambda alg: made[alg].trial_overrides({}, args.seeds[0], out / "probe")[:-1])
    if left_out:
        _echo(LEFT_OUT + "; ".join(left_out))
    result: list[Plan] = []
    for alg, cfg in configs.items():
        plan = made[alg]
        plan.space = [d.resolve(cfg) for d in plan.space]
        plan.cfg = cfg
        # what makes two tunes the same study (--trials may grow and --jobs change on a resume)
        plan.settings = {"space": [d.describe() for d in plan.space], "seeds": plan.seeds,
                         "confirm_seeds": plan.confirm_seeds, "stability": plan.stability, "extra": plan.extra,
                         "val_fraction": plan.val_fraction, "objective": plan.objective,
                         "sampler_seed": plan.sampler_seed, "startup": startup}
        result.append(plan)
    return result


def main(argv: Sequence[str] | None = None, command: Sequence[str] = TRAIN_COMMAND,
         echo: Callable[[str], None] = _echo) -> int:
    """``python -m fedfew.tune``; ``command`` is what runs a trial (``python -m fedfew.train``)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.print_overrides:
        print(" ".join(["~tuned", *preset_overrides(args.print_overrides)]))
        return 0
    import optuna

    from fedfew.experiments.run_folders import older_setup_note

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    all_plans = plans(args)
    out = all_plans[0].out
    note = None if args.out else older_setup_note("tune", args.dataset, out)
    if note:
        echo(note)
    install = None if args.install == "no" else setup_presets_dir(args.dataset, args.extra)
    command_line = " ".join(shlex.quote(a) for a in ["python", "-m", "fedfew.tune", *argv])
    with exclusive(out, "make tune"):  # one tool at a time writes into out
        for plan in all_plans:  # a folder holding another tune is refused before anything runs
            open_study(plan)
        start = time.perf_counter()
        lines, errors, interrupted = [], [], []
        trials_wall = 0.0  # every invocation's trials: a re-run that only rewrites presets keeps the figure
        for plan in all_plans:
            echo(f"{plan.algorithm}: {plan.trials} trials on {describe_setup(plan.cfg)}; search "
                 + "; ".join(d.describe() for d in plan.space))
        # every study runs in its own thread on the shared workers (Slots), started in the listed order:
        # the earlier-listed algorithm's runs first, the next one filling any idle worker
        slots = Slots(args.jobs)
        try:
            with ThreadPoolExecutor(max_workers=len(all_plans)) as studies:
                try:
                    futures = []
                    for i, plan in enumerate(all_plans):
                        queued = threading.Event()
                        futures.append(studies.submit(tune_algorithm, plan, command, echo, slots, i, queued))
                        queued.wait()
                    for plan, future in zip(all_plans, futures):
                        try:
                            study = future.result()
                        except TuneError as err:  # the other algorithms go on; said now, raised at the end
                            echo(f"  {plan.algorithm} stopped: {str(err).splitlines()[0]}")
                            errors.append((plan.algorithm, err))
                            continue
                        except TrialInterrupted as err:
                            interrupted.append((plan.algorithm, err))
                            continue
                        lines.append(_write_preset(plan, study, out, install, command_line, echo))
                        trials_wall += tuning_seconds(study)
                except BaseException:  # Ctrl-C: start nothing new (the running trials save a checkpoint and stop)
                    slots.stop()
                    raise
        finally:
            slots.close(wait=False)
        if lines:
            table = ["# tune: " + args.dataset, "", f"command: `{command_line}`", "",
                     "| algorithm | best validation acc | confirmed on | values | config defaults' validation acc | "
                     f"sampled trials | at {args.stability:g}x its lr | trials' wall time, summed (min) | "
                     "at a range edge (the range may bind) |",
                     "|---|---|---|---|---|---|---|---|---|",
                     *lines, "", f"total wall time of this invocation: {(time.perf_counter() - start) / 60:.1f} min; "
                     f"the trials' wall time summed over every invocation: {trials_wall / 60:.1f} min "
                     f"({args.jobs} at a time)"]
            if errors or interrupted:
                table.append(f"not finished: {', '.join(a for a, _ in errors + interrupted)}")
            atomic_write_text(out / "tune.md", "\n".join(table) + "\n")
        if interrupted:
            raise TuneError(f"interrupted ({'; '.join(str(e) for _, e in interrupted)}); run the same command again to "
                            "continue: the running trials resume from their checkpoints")
        if errors:
            raise TuneError("\n\n".join(str(e) for _, e in errors)
                            + (f"\n\n(the presets of the other algorithms are written to {out / 'presets'})" if lines else ""))
        if install is None:
            echo(f"presets written to {out / 'presets'} only (--install no); use them with "
                 f"make compare PRESETS={out / 'presets'} (or {python_command('fedfew.compare')} --presets ...)")
        elif install != TUNED_DIR:
            echo(f"presets installed in {install} (the overrides {setup_changing(args.extra)} change the setup): "
                 "make compare with the same overrides uses them; make train with tuned="
                 f"{install.name}/{args.dataset}_<algorithm>")
        echo(f"tune done in {(time.perf_counter() - start) / 60:.1f} min; summary {out / 'tune.md'}")
    return 0


def _write_preset(plan: Plan, study, out: Path, install: Path | None, command_line: str, echo) -> str:
    """Write one algorithm's preset (``<out>/presets``, and the folder ``install`` unless None);
    returns its row of tune.md."""
    best = choice(study)
    text = preset_text(plan, study, command_line, best)
    name = f"{plan.dataset}_{plan.algorithm}.yaml"
    atomic_write_text(out / "presets" / name, text)
    written = [out / "presets" / name]
    if install is not None:
        atomic_write_text(install / name, text)
        written.append(install / name)
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


if __name__ == "__main__":
    pass_signals_on()
    try:
        sys.exit(main())
    except (TuneError, Busy) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt as err:  # Ctrl-C, or SIGTERM / SIGHUP passed on to the runs
        print("\ntune stopped: the finished trials are kept and the running ones saved a checkpoint; run the "
              "same command again to continue", file=sys.stderr)
        sys.exit(stopped_exit_code(err))
