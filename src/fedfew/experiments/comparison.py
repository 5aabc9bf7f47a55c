"""Run several algorithms on the same partitions and seeds and tabulate them (``make compare``).

    python -m fedfew.compare --dataset digits --algorithms fedfew fedavg ifca --seeds 0 1 2 \\
        -- rounds=20 data_dir=/path/to/data     # -> outputs/compare/digits_rounds-20

Every (algorithm, seed) is one isolated subprocess ``python -m fedfew.train dataset=<dataset>
algorithm=<alg> seed=<seed> ~tuned <preset values> <extra overrides> hydra.run.dir=<out>/<alg>/seed<seed>``.
Each method gets its own tuned preset (``make tune``; docs/tuning.md): by default the one in a
setup folder ``conf/tuned/<dataset><setup>/`` tuned for exactly the runs' setup, else
``conf/tuned/<dataset>_<alg>.yaml`` when it exists; with ``--presets DIR`` the one in DIR
instead (a preset tuned for another setup), with ``--presets none`` none; its values are passed
as explicit overrides, so a changed preset is never mistaken for a finished run. The extra
overrides (after ``--``) go to every run and win over the presets. The partition is derived
from the seed alone, and its hash is checked to be the same for every algorithm of a seed. A run
whose ``results.json`` exists is reused, so an interrupted comparison resumes where it stopped;
reusing results produced with different overrides is refused (a thread count, logger or
``data_dir`` does not count: :func:`fedfew.core.run_folders.result_overrides`), and so is reusing results made
from other data: the data in the runs' ``data_dir`` must have the fingerprint the results record
(:mod:`fedfew.data.fingerprint`), so committed runs are reused from a clone anywhere with the data
anywhere. A run that was cut short continues from its last checkpoint (every 5 rounds,
:mod:`fedfew.experiments.launch`). User guide: docs/compare.md. compare.md and compare.csv name presets
relative to the repository and the data folder as ``<data_dir>`` (:func:`fedfew.core.run_folders.portable_path`).

An override for one method's own key (``algorithm.K=5``) fails for the algorithms without that
key; ``++algorithm.K=5`` adds it where missing (ignored there), or compare that method apart.

Written to ``<out>`` (atomically; :func:`summarize` defines every column):

- ``compare.csv``: one row per algorithm, then the majority-label row: over seeds the mean and
  (sample) std of ``acc_mean``, ``acc_weighted`` and ``acc_min`` at the reported round and as the
  mean of the last three evaluations (``*_last3``); balanced accuracy and macro-F1; the paired
  per-seed difference of ``acc_mean`` against the reference method (fedfew: ``diff_*``); the
  budget actually used (rounds, local SGD steps, server models, bytes up and down per round and
  per participating client per round, d); the learning rate and own keys of each method; per seed,
  how many clients' scored models diverged (``diverged_clients_per_seed``, "seed:count" where not 0).
- ``compare.md``: the same as two tables plus notes (what every method shared and what differs,
  the presets, whether fedfew is first, the protocol; ``reference`` is labelled OPTIMISTIC).
- ``accuracy_rounds.png`` and ``accuracy_bytes.png``: client-mean accuracy against rounds and
  against cumulative bytes communicated (up + down), one line per method (mean over seeds) with
  a band (mean +- std over seeds), the majority label dotted.

Subprocess output goes to ``<out>/logs/``.
"""
from __future__ import annotations

import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from fedfew.core.checkpoint import checkpoint_path
from fedfew.core.nonfinite import DIVERGED_EXIT
from fedfew.core.run_folders import data_mismatch, portable_command, portable_path
from fedfew.experiments.comparison_table import (
    MAJORITY,
    CompareError,
    also_protocols,
    describe,
    protocol_view,
    summarize,
    to_markdown,
    write_plots,
    write_tables,
)
from fedfew.experiments.launch import (
    FAILED_RESULTS,
    check_not_training,
    exclusive,
    launch,
    outcome,
    progress,
    recorded_overrides,
    refused_checkpoint,
    tidy,
)


@dataclass(frozen=True)
class Run:
    """One (algorithm, seed) run of a comparison.

    Attributes:
        preset: the method's preset as overrides (``~tuned`` and its values), before ``extra``.
        preset_source: where the preset came from (a path, or "" for none).
        data_dir: the data folder the run reads (its config's ``data_dir``), against whose content
            a run folder found finished or checkpointed is checked before it is reused
            (:func:`check_reusable`); "" skips that check.
    """

    algorithm: str
    seed: int
    out: Path
    extra: tuple[str, ...] = ()
    dataset: str = "digits"
    preset: tuple[str, ...] = ()
    preset_source: str = ""
    data_dir: str = ""

    @property
    def dir(self) -> Path:
        return self.out / self.algorithm / f"seed{self.seed}"

    @property
    def results_path(self) -> Path:
        return self.dir / "results.json"

    @property
    def log_path(self) -> Path:
        return self.out / "logs" / f"{self.algorithm}_seed{self.seed}.log"

    def overrides(self) -> list[str]:
        """Hydra overrides of the run (the run directory last, so it cannot be overridden)."""
        return [f"dataset={self.dataset}", f"algorithm={self.algorithm}", f"seed={self.seed}", *self.preset,
                *self.extra, f"hydra.run.dir={self.dir}"]

    def task_overrides(self) -> list[str]:
        """The overrides Hydra records in ``.hydra/overrides.yaml`` (all but ``hydra.*``)."""
        return [o for o in self.overrides() if not o.lstrip("+~").startswith("hydra.")]


def preset_for(dataset: str, algorithm: str, presets: str | None, extra: Sequence[str],
               cfg: Any = None) -> tuple[tuple[str, ...], str]:
    """The preset overrides of one method and their source.

    Args:
        presets: None (``conf/tuned``), ``"none"`` (no preset) or a folder of
            ``<dataset>_<algorithm>.yaml`` files (``make tune``'s ``<out>/presets``).
        extra: the comparison's extra overrides; a preset key they set is left out (they win).
        cfg: the runs' config, with ``presets`` None: a preset in a setup folder
            ``conf/tuned/<dataset><setup>/`` whose ``# setup:`` line matches it
            (:func:`fedfew.config.presets.preset_matches`) wins over ``conf/tuned/<dataset>_<algorithm>.yaml``.
    Returns:
        (``("~tuned", "optim.lr=...", ...)``, the preset's path or "").
    """
    from fedfew.config import presets as preset_config
    from fedfew.config.presets import fixed_keys, preset_matches, preset_overrides, setup_preset

    if presets == "none":
        return ("~tuned",), ""
    name = f"{dataset}_{algorithm}.yaml"
    path = (Path(presets).expanduser().resolve() if presets else preset_config.TUNED_DIR) / name
    if not presets and cfg is not None and not (path.is_file() and preset_matches(path, cfg)):
        path = setup_preset(name, cfg) or path
    if not path.is_file():
        return ("~tuned",), ""
    fixed = fixed_keys(extra)
    values = [o for o in preset_overrides(path) if o.split("=", 1)[0] not in fixed]
    return ("~tuned", *values), str(path)


def check_reusable(run: Run) -> str:
    """How far ``run`` got (:func:`fedfew.experiments.launch.progress`: ``done``, ``checkpoint`` or ``none``).

    A run folder is this run's when it was made with the same overrides, up to those that do not
    change results (:func:`fedfew.core.run_folders.result_overrides`: another thread count, e.g. JOBS=1 after
    JOBS=2, or another ``data_dir``), and from the same data: the data in ``run.data_dir`` has the
    fingerprint its results or checkpoint record (:func:`fedfew.core.run_folders.data_mismatch`; for a run
    recorded before the fingerprint, the same partition hash). So runs made in another folder or
    on another machine, the data elsewhere, are reused.

    Raises:
        CompareError: its results or checkpoint come from different overrides, or from other data
            (the message names both fingerprints or partition hashes), or the data in
            ``run.data_dir`` cannot be read to tell.
        Busy: a live process still trains it (:func:`fedfew.experiments.launch.check_not_training`).
    """
    from fedfew.core.run_folders import result_overrides

    check_not_training(run.dir)
    state = progress(run.dir, run.task_overrides())
    what = run.results_path if run.results_path.exists() else f"the checkpoint in {run.dir}"
    if state == "stale":
        raise CompareError(
            f"{what} was produced with overrides {result_overrides(recorded_overrides(run.dir) or [])}, this "
            f"comparison asks for {result_overrides(run.task_overrides())}; use another --out (COMPARE_OUT=...) "
            f"or delete {run.dir}"
        )
    if state != "none" and run.data_dir:
        try:
            why = data_mismatch(run.dir, run.data_dir)
        except (OSError, ValueError) as err:  # DataNotFoundError, a malformed file, a partition that fails
            raise CompareError(f"cannot tell whether {what} was made from the data this comparison reads: "
                               f"{type(err).__name__}: {err}") from err
        if why:
            raise CompareError(
                f"{what} was made from other data than this comparison reads ({why}); a run is reused on the "
                f"same data only, wherever that lies: point data_dir at the data it was made from, use another "
                f"--out (COMPARE_OUT=...) or delete {run.dir}"
            )
    return state


def execute(run: Run, python: str = sys.executable) -> tuple[str, float, float, bool]:
    """Train ``run`` in a subprocess (output to its log file), from its checkpoint when it has
    one (:func:`fedfew.experiments.launch.launch`).

    Returns:
        (``done`` | ``failed`` | ``interrupted`` (stopped by a signal: its checkpoint is kept), wall
        seconds, CPU seconds of the subprocess: user + system, whether it resumed).
    """
    code, wall, cpu, resumed = launch(run.overrides(), run.dir, run.log_path, (python, "-m", "fedfew.train"))
    return outcome(code, run.dir), wall, cpu, resumed


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


_ECHO_LOCK = threading.Lock()


def _echo(line: str) -> None:
    """One whole line to stdout, flushed (progress from several threads, into a log file)."""
    with _ECHO_LOCK:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def run_all(runs: Sequence[Run], jobs: int = 1, python: str = sys.executable,
            echo=_echo) -> dict[Run, str]:
    """Run every run without results (``jobs`` at a time; one with a checkpoint continues from
    it); returns run -> status (``reused`` | ``done`` | ``failed`` | ``interrupted``). Stale results
    or checkpoints raise before anything starts."""
    status: dict[Run, str] = {}
    todo = []
    for run in runs:
        if check_reusable(run) == "done":
            tidy(run.dir, run.overrides(), run.log_path)  # finished by a run a killed comparison left behind
            status[run] = "reused"
        else:
            todo.append(run)
    if status:
        echo(f"reusing {len(status)} finished run(s): " + ", ".join(f"{r.algorithm}/seed{r.seed}" for r in status))

    def one(item: tuple[int, Run]) -> tuple[Run, str, float, float, bool]:
        i, run = item
        cont = " (continuing from its checkpoint)" if checkpoint_path(run.dir).is_file() else ""
        echo(f"[{i}/{len(todo)}] {run.algorithm} seed {run.seed} -> {run.dir}{cont}")
        return (run, *execute(run, python))

    pool = ThreadPoolExecutor(max_workers=max(1, jobs))
    try:
        for future in [pool.submit(one, item) for item in enumerate(todo, 1)]:
            run, state, seconds, cpu, resumed = future.result()
            status[run] = state
            if state == "done":
                acc = json.loads(run.results_path.read_text())["summary"]["acc_mean"]
                part = " for its last part" if resumed else ""
                echo(f"    {run.algorithm} seed {run.seed}: client-mean acc {acc:.4f} "
                     f"({seconds:.0f} s wall, {cpu:.0f} s CPU{part})")
            elif state == "diverged":
                stopped_at = json.loads(run.results_path.read_text()).get("nonfinite", {}).get("stopped_at")
                echo(f"    {run.algorithm} seed {run.seed}: DIVERGED, every client non-finite, stopped after round "
                     f"{stopped_at} (exit code {DIVERGED_EXIT}); in the table, named in its warnings")
            elif state == "interrupted":
                echo(f"    {run.algorithm} seed {run.seed} was stopped by a signal after {seconds:.0f} s; its "
                     f"checkpoint is kept: run the same command again to continue it")
            else:
                hint = (f"\n    fedfew.train refused to continue from {checkpoint_path(run.dir)} (the log says why); "
                        f"delete {run.dir / 'checkpoints'} to start the run afresh") if refused_checkpoint(run.log_path) else ""
                if (run.dir / FAILED_RESULTS).exists():
                    hint += f"\n    (it failed after writing its results: kept as {run.dir / FAILED_RESULTS}, not used)"
                echo(f"    {run.algorithm} seed {run.seed} FAILED after {seconds:.0f} s; log {run.log_path}:\n"
                     + _tail(run.log_path) + hint)
    except BaseException:  # Ctrl-C: start no queued run (the running ones save a checkpoint and stop)
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()
    return status


def collect(runs: Sequence[Run]) -> dict[tuple[str, int], dict[str, Any]]:
    """(algorithm, seed) -> results.json of every finished run."""
    return {(r.algorithm, r.seed): json.loads(r.results_path.read_text()) for r in runs if r.results_path.exists()}


def default_algorithms() -> list[str]:
    """Every registered algorithm, FedFew first."""
    from fedfew.algorithms import ALGORITHMS

    names = ALGORITHMS.names()
    return sorted(names, key=lambda n: (n != "fedfew", n))


def default_out(dataset: str, extra: Sequence[str], presets: str | None) -> Path:
    """:func:`fedfew.core.run_folders.setup_folder` of kind ``compare``, plus ``_presets-<name>`` with
    ``--presets`` (the tune folder's name for make tune's ``<out>/presets``), e.g.
    ``outputs/compare/digits_partition-dirichlet_presets-digits``."""
    from fedfew.core.run_folders import setup_folder

    setup = list(extra)
    if presets:
        folder = Path(presets).expanduser().resolve()
        setup.append(f"presets={'none' if presets == 'none' else (folder.parent.name if folder.name == 'presets' else folder.name)}")
    return setup_folder("compare", dataset, setup)


def compare(args, argv: Sequence[str]) -> int:
    """Run (or reuse) every (algorithm, seed) of ``args`` (:func:`fedfew.compare.parse_args`) and write the
    tables and plots of each protocol; ``argv`` is the command line recorded in them.

    Returns:
        0, or 1 when a run failed, diverged or was stopped by a signal (said in the tables).

    Raises:
        CompareError: a bad override, preset folder or algorithm list, before any run starts.
    """
    algorithms = args.algorithms or default_algorithms()
    from fedfew.data.fingerprint import forget_data

    forget_data()  # the data is read afresh by each comparison (check_reusable)
    from fedfew.algorithms import ALGORITHMS
    from fedfew.core.run_folders import older_setup_note
    from fedfew.experiments.tune_errors import TuneError
    from fedfew.experiments.tuning import LEFT_OUT, RUN_KEYS, check_extra_keys, runnable_algorithms, warn_slow_precision

    for alg in algorithms:
        ALGORITHMS.get(alg)  # unknown names fail here, with the list of known ones
    bad = [e for e in args.extra if e.split("=", 1)[0].lstrip("+~") in RUN_KEYS]
    if bad:
        raise CompareError(f"{bad}: dataset, algorithm, seed, the run directory and the presets are set by the "
                           "comparison, which also resumes interrupted runs itself "
                           "(use --dataset/--algorithms/--seeds/--out/--presets)")
    if args.presets not in (None, "none") and not Path(args.presets).expanduser().is_dir():
        raise CompareError(f"--presets {args.presets}: no such folder (make tune writes <out>/presets; "
                           "'none' runs every method with its config defaults)")
    try:  # a key no method of the list defines, with the closest valid one
        check_extra_keys(algorithms, args.extra)
    except TuneError as err:
        raise CompareError(str(err)) from err
    if args.out:
        out = Path(args.out).expanduser().resolve()
    else:
        out = default_out(args.dataset, args.extra, args.presets)
        note = older_setup_note("compare", args.dataset, out)
        if note:
            _echo(note)
    presets = {alg: preset_for(args.dataset, alg, args.presets, args.extra) for alg in algorithms}
    def overrides_of(alg: str) -> list[str]:
        return Run(alg, args.seeds[0], out, tuple(args.extra), args.dataset, *presets[alg]).task_overrides()

    try:  # every run config is checked before any run starts (the default list leaves out what cannot run)
        configs, left_out = runnable_algorithms(algorithms, named=bool(args.algorithms), overrides_of=overrides_of)
        if args.presets is None:  # a preset tuned for exactly this setup (conf/tuned/<dataset><setup>/) wins
            for alg, cfg in list(configs.items()):
                chosen = preset_for(args.dataset, alg, None, args.extra, cfg)
                if chosen != presets[alg]:
                    presets[alg] = chosen
                    configs.update(runnable_algorithms([alg], named=True, overrides_of=overrides_of)[0])
    except TuneError as err:
        raise CompareError(str(err)) from err
    if left_out:
        _echo(LEFT_OUT + "; ".join(left_out))
    warn_slow_precision(configs.values())
    algorithms = list(configs)
    reference = args.reference if args.reference in algorithms else algorithms[0]
    runs = [Run(alg, seed, out, tuple(args.extra), args.dataset, *presets[alg], str(configs[alg].data_dir))
            for seed in args.seeds for alg in algorithms]
    with exclusive(out, "make compare"):  # one tool at a time writes into out
        start = time.perf_counter()
        status = run_all(runs, jobs=args.jobs)
        finished = [r for r in runs if status.get(r) in ("done", "reused", "diverged")]
        results = collect(finished)  # a failed run's results stay out
        failed = [f"{r.algorithm}/seed{r.seed}" for r, s in status.items() if s == "failed"]
        verdicts = {r: json.loads(r.results_path.read_text())["summary"].get("verdict", "finite") for r in finished}
        diverged = [f"{r.algorithm}/seed{r.seed}" for r, v in verdicts.items() if v == "diverged"]
        nonfinite = [f"{r.algorithm}/seed{r.seed}" for r, v in verdicts.items() if v == "nonfinite"]
        stopped = [f"{r.algorithm}/seed{r.seed}" for r, s in status.items() if s == "interrupted"]
        elapsed = time.perf_counter() - start
        run_wall = sum(float(r.get("wall_time_s") or 0.0) for r in results.values())
        trained = len(status) - sum(s == "reused" for s in status.values())
        written = []
        # the run's own protocol, then each eval.also protocol: the same runs, another table each
        for protocol in [None, *also_protocols(results)]:
            scored = results if protocol is None else {k: protocol_view(r, protocol) for k, r in results.items()}
            rows, warnings = summarize(scored, algorithms, reference, {a: p[1] for a, p in presets.items()})
            title, notes = describe(rows, scored, args.dataset, args.seeds, reference)
            if left_out:
                notes.append("left out (they cannot run on this setup): " + "; ".join(left_out))
            if failed:
                warnings.append(f"failed runs (left out; logs in {portable_path(out / 'logs')}): {', '.join(failed)}")
            if diverged:
                warnings.append(f"**runs that diverged** (every client non-finite, stopped early with exit code "
                                f"{DIVERGED_EXIT}; their figures are of the models as they were then, not a result): "
                                f"{', '.join(diverged)}")
            if nonfinite:
                warnings.append(f"runs where some client's update, local copy or personal state went non-finite in "
                                f"some rounds (left out of those rounds' aggregation; results.json nonfinite says who "
                                f"and when): {', '.join(nonfinite)}")
            if stopped:
                warnings.append(f"runs stopped by a signal (left out; run the same command again to continue them "
                                f"from their checkpoints): {', '.join(stopped)}")
            if protocol is not None:
                notes.append(f"the same runs as compare.md, scored under protocol {protocol} at the same evaluations "
                             f"(eval.also; a run trains the same under every protocol)")
            notes.append(f"command: `{portable_command(['python', '-m', 'fedfew.compare', *argv])}`; this "
                         f"invocation took {elapsed / 60:.1f} min with {args.jobs} job(s) ({trained} run(s) trained); "
                         f"the {len(results)} runs' round loops took {run_wall / 60:.1f} min in total")
            suffix = "" if protocol is None else f"_{protocol}"
            written += write_tables(out, rows, title, [*warnings, *notes], suffix)
            majority = next((r["acc_mean"] for r in rows if r["algorithm"] == MAJORITY), None)
            if scored:
                written += write_plots(out, scored, algorithms, majority, title, suffix)
            print(to_markdown(rows, title, [*warnings, *notes]))
        print(f"wrote {', '.join(str(w) if i == 0 else w.name for i, w in enumerate(written))} ({elapsed:.0f} s)")
    return 1 if failed or stopped or diverged else 0
