"""Tune every method the same way, on validation data, and write presets (``make tune``).

    python -m fedfew.tune --dataset digits --algorithms fedfew fedavg fedrep --trials 12 --jobs 2 \\
        -- trainer.threads=1

For each algorithm, an Optuna study (TPE sampler, seeded) runs the same number of trials. A
trial is one isolated ``python -m fedfew.train`` subprocess per tuning seed with the sampled
values, ``partition.val_fraction`` (``--val-fraction``, default 0.2: a stratified share of each
client's train split held out, never trained on), ``eval.split=val`` (clients select their model
on the train split and are scored on the validation split; the test split is never evaluated,
:mod:`fedfew.simulator.evaluation`), ``~tuned`` (no existing preset leaks into a trial) and the extra
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
:func:`fedfew.core.run_folders.setup_folder`):

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
uninterrupted one would have. Where a batch holds repeats of interrupted trials beside new ones (e.g.
a tune resumed with more ``--jobs``), the new ones are drawn from a seed that also names the
repeats, so no values run twice. The first ``--startup`` trials (default 4) are random, TPE models
the rest. Hydra's Optuna sweeper (hydra-optuna-sweeper) is not used: it pins optuna < 3.
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from fedfew.config import presets
from fedfew.config.compose import ComposeError
from fedfew.config.compose import compose as compose_config
from fedfew.config.presets import fixed_keys, override_value, setup_changing
from fedfew.core.run_folders import diverged_clients
from fedfew.experiments.launch import Busy, check_not_training, launch, outcome, progress, refused_checkpoint, tidy
from fedfew.experiments.search_space import Dimension, load_space
from fedfew.experiments.tune_errors import TrialDiverged, TrialInterrupted, TuneError

OBJECTIVES = ("last3", "final")


#: keys a comparison (make compare) sets for each run: never in its extra overrides
RUN_KEYS = ("dataset", "algorithm", "seed", "hydra.run.dir", "tuned", "resume")


#: keys the tune sets for each trial: never in its extra overrides
RESERVED = (*RUN_KEYS, "partition.val_fraction", "eval.split")


TRAIN_COMMAND = (sys.executable, "-m", "fedfew.train")


#: what precedes the algorithms runnable_algorithms left out, on the console
LEFT_OUT = "left out (they cannot run on this setup; name them in ALGORITHMS to see the error): "


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


def warn_slow_precision(configs: Iterable[Any]) -> None:
    """Say once, before any run, that the runs' precision is slow on this machine
    (:func:`fedfew.core.precision.slow_precision_note`), for the first config that is."""
    from fedfew.core.precision import slow_precision_note

    for cfg in configs:
        note = slow_precision_note(cfg)
        if note:
            _echo(f"warning: {note}")
            return


def setup_presets_dir(dataset: str, extra: Sequence[str]) -> Path:
    """Where ``--install`` puts presets: ``conf/tuned`` for the dataset's default setup, and
    ``conf/tuned/<dataset><setup>`` (named as :func:`fedfew.core.run_folders.setup_folder` names a tune's
    folder, e.g. ``conf/tuned/digits_partition-dirichlet``) when the extra overrides change the
    setup; ``make compare`` picks a preset from there when its setup equals the runs'."""
    from fedfew.core.run_folders import setup_folder

    changing = setup_changing(extra)
    return presets.TUNED_DIR / setup_folder("tune", dataset, changing).name if changing else presets.TUNED_DIR


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
                *(f"{k}={override_value(v)}" for k, v in values.items()), f"hydra.run.dir={run_dir}"]


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
            tidy(run_dir, overrides, log_path)  # finished by a run a killed tune left behind
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
    some client's scored model is non-finite (:func:`fedfew.core.run_folders.diverged_clients`), or some client's
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
    from fedfew.core.run_folders import setup_folder

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
    warn_slow_precision(configs.values())
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


_ECHO_LOCK = threading.Lock()


def _echo(line: str) -> None:
    """One whole line to stdout, flushed (the studies report from several threads)."""
    with _ECHO_LOCK:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def _fmt_values(values: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in values.items())
