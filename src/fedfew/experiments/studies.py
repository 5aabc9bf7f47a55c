"""One algorithm's Optuna study in ``make tune``: open or resume it, run its trials on the shared
workers (:class:`Slots`), confirm the best candidate on the other tuning seeds and at 1.5x its lr,
and choose (:func:`choice`). What a trial is: :mod:`fedfew.experiments.tuning`."""
from __future__ import annotations

import itertools
import json
import math
import queue
import shutil
import threading
import warnings
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from fedfew.core.seeding import derive_seed
from fedfew.experiments.tune_errors import TrialDiverged, TrialInterrupted, TuneError
from fedfew.experiments.tuning import TRAIN_COMMAND, Plan, _echo, _fmt_values, run_trial


def open_study(plan: Plan):
    """The algorithm's study in ``<out>/<algorithm>/study.db`` (created, or resumed).

    A study is resumed when it was made with the same settings, up to extra overrides that do not
    change results (:func:`fedfew.core.run_folders.result_overrides`: a thread count, a logger, ``data_dir``),
    and from the same data, by content: a new study records the ``data_fingerprint`` of the data in
    ``plan.cfg.data_dir`` (:mod:`fedfew.data.fingerprint`), which a resume compares; a study made
    before the fingerprint was recorded is compared through one of its finished runs
    (:func:`fedfew.core.run_folders.data_mismatch`). So a tune copied with the repository resumes from a
    clone anywhere, the data anywhere. Without ``plan.cfg`` the data is not checked.

    Raises:
        TuneError: the folder holds a study made with different settings, or from other data (the
            message names both fingerprints or partition hashes), or the data cannot be read.
    """
    import optuna

    from fedfew.core.run_folders import data_mismatch, portable_overrides, recorded_data, result_overrides
    from fedfew.data.fingerprint import data_check

    plan.dir.mkdir(parents=True, exist_ok=True)
    storage = f"sqlite:///{plan.dir / 'study.db'}"
    study = optuna.create_study(study_name=f"{plan.dataset}_{plan.algorithm}", storage=storage,
                                direction="maximize", load_if_exists=True)

    # settings added since studies were first recorded that shape only the runs after the search (the
    # confirmation seeds, the stability margin), never its trials: a study recorded before them lacks
    # them and is the same study
    after_search = ("confirm_seeds", "stability")

    def portable(settings: dict[str, Any]) -> dict[str, Any]:
        # as the study records them: data_dir=<data_dir>, no folder of this machine (issue 35, item 4)
        return {**settings, "extra": portable_overrides(settings.get("extra", []))}

    def identity(settings: dict[str, Any]) -> dict[str, Any]:
        # another thread count (JOBS=1 after JOBS=2), logger or data folder is the same study
        return {**settings, "extra": result_overrides(portable_overrides(settings.get("extra", [])))}

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
    if recorded is None or recorded != portable(recorded):  # an older study's record is made portable too
        study.set_user_attr("settings", portable(plan.settings if recorded is None else recorded))
    if recorded is None and fingerprint:
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
            # Repeats of interrupted trials are asked first. Beside them (e.g. a tune resumed with more
            # --jobs than it was interrupted with), a new trial drawn from the seed of `done` alone can
            # replay a repeat's own draw, i.e. run its values twice: the seed then names the repeats too.
            repeats = len(study.get_trials(deepcopy=False, states=(TrialState.WAITING,)))
            seed_of = (done,) if repeats == 0 or repeats >= batch else (done, "after repeats", repeats)
            with _SAMPLER_LOCK, warnings.catch_warnings():  # multivariate and constant_liar are experimental
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                study.sampler = optuna.samplers.TPESampler(
                    seed=derive_seed(plan.sampler_seed, "tune", plan.dataset, plan.algorithm, *seed_of) % 2**32,
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
    # a study resumed at its confirmation queues nothing above: let the next algorithm start on the free worker
    queued.set()
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
