"""Flower's simulation engine beside the simulator on the same job (``make bench``'s ``flower`` section).

The job: ``dataset=digits num_clients=M algorithm=A rounds=R trainer.threads=1`` (everything else
the defaults of ``make train``, tuned presets included), run once by the simulator (what
``python -m fedfew.train`` does: :func:`fedfew.experiments.training.run`) and once by Flower's
simulation engine (what ``python -m fedfew.flower`` does: :func:`fedfew.flower.__main__.simulate`,
one virtual SuperNode per client, ``--workers`` = the CPU count ClientApps at a time, one thread
each), each in a fresh interpreter (:func:`~fedfew.bench.cases.run_case`). One torch thread per
process: on a few shared cores, more threads than free cores make the simulator's rounds several
times slower and far noisier.
Both run the one round loop, :meth:`fedfew.simulator.simulation.Simulation.fit`, which the case
wraps to note when it starts and ends. Per engine:

* ``round_time_s``: the loop's own time of each round (metrics.csv's ``round_time_s``: from the
  broadcast to the end of aggregation; for Flower the messages there and back included);
  ``s_per_round`` is their mean over the rounds after the first; ``first_round_s`` is the first
  (Flower's first train message to each ClientApp pays its first optimizer's imports);
* ``startup_s``: from the interpreter's launch to the first round: imports, the config, the data
  (simulator) or Ray's start and every virtual node building its partition and answering the
  server's query (Flower), Fabric;
* ``fit_s``: the rounds, the final evaluation and the logging; ``teardown_s``: from the loop's end
  to the process's exit (results, plots, Ray's shutdown);
* ``acc_mean``: the final client-mean accuracy (Flower is the simulator bit for bit: the same figure).
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from fedfew.bench.cases import run_case
from fedfew.bench.common import _f, _log
from fedfew.config.compose import compose

ENGINES = ("simulator", "flower")
DATASET = "digits"


def job_overrides(M: int, algorithm: str, rounds: int) -> list[str]:
    """The Hydra overrides of the job both engines run."""
    return [f"dataset={DATASET}", f"num_clients={M}", f"algorithm={algorithm}", f"rounds={rounds}", "trainer.threads=1"]


def case_federation(spec: dict) -> dict:
    """One run of the job ``spec["overrides"]`` by ``spec["engine"]`` (simulator | flower) in this
    process; ``spec["launched"]``: the parent's ``time.time()`` just before it started this
    interpreter. Returns the figures of the module docstring (seconds) and the job's config hash."""
    from omegaconf import OmegaConf

    from fedfew.simulator.simulation import Simulation

    marks: dict[str, Any] = {}
    fit = Simulation.fit

    def timed_fit(self):  # the one round loop of both engines (FlowerSimulation inherits it)
        marks["fit_start"] = time.time()
        try:
            return fit(self)
        finally:
            marks["fit_end"] = time.time()
            marks["round_time_s"] = [float(h["round_time_s"]) for h in self.history]

    Simulation.fit = timed_fit
    cfg = compose(spec["overrides"])
    resolved = OmegaConf.to_container(cfg, resolve=True)
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        if spec["engine"] == "flower":
            from fedfew.core.threads import apply_threads
            from fedfew.experiments.training import preflight, quiet_console
            from fedfew.flower.__main__ import simulate

            preflight(cfg, run_dir)
            quiet_console()
            apply_threads(cfg)
            results = simulate(cfg, run_dir)
        else:
            from fedfew.experiments.training import run

            results = run(cfg, run_dir)
    rounds = marks["round_time_s"]
    later = rounds[1:] or rounds
    return {"engine": spec["engine"], "rounds": len(rounds), "round_time_s": rounds, "first_round_s": rounds[0],
            "s_per_round": sum(later) / len(later), "startup_s": marks["fit_start"] - spec["launched"],
            "fit_s": marks["fit_end"] - marks["fit_start"], "fit_end_s": marks["fit_end"] - spec["launched"],
            "acc_mean": results["summary"]["acc_mean"], "num_clients": int(cfg.num_clients),
            "algorithm": str(cfg.algorithm.name), "config_sha": hashlib.sha256(
                json.dumps(resolved, sort_keys=True, default=str).encode()).hexdigest()[:16]}


def flower_section(clients: list[int], algorithms: list[str], rounds: int) -> dict:
    """The section: for each M and algorithm, the job run by each engine, and Flower's seconds per
    round over the simulator's. Skipped (with the reason) when flwr is not installed."""
    out: dict[str, Any] = {"dataset": DATASET, "rounds": rounds, "engines": list(ENGINES), "points": [],
                           "threads": 1, "flower_workers": os.cpu_count() or 1,
                           "round_time": "mean of round_time_s (the round loop's own timing) over the rounds after the first",
                           "startup": "from the interpreter's launch to the first round"}
    if importlib.util.find_spec("flwr") is None:
        out["skipped"] = "flwr is not installed (make install: the flower extra)"
        return out
    for M in clients:
        for algorithm in algorithms:
            point: dict[str, Any] = {"M": M, "algorithm": algorithm, "overrides": job_overrides(M, algorithm, rounds)}
            for engine in ENGINES:
                _log(f"flower section: {engine} M={M} algorithm={algorithm} rounds={rounds}")
                launched = time.time()
                res = run_case({"kind": "federation", "engine": engine, "overrides": point["overrides"],
                                "launched": launched}, timeout=3600)
                if "error" not in res:
                    res["wall_s"] = res["case_wall_s"]
                    res["teardown_s"] = max(0.0, res["wall_s"] - res["fit_end_s"])
                point[engine] = res
            sim, flw = point["simulator"], point["flower"]
            if "s_per_round" in sim and "s_per_round" in flw:
                point["flower_over_simulator"] = flw["s_per_round"] / sim["s_per_round"]
                point["same_config"] = sim["config_sha"] == flw["config_sha"]
            out["points"].append(point)
    return out


def flower_lines(section: dict) -> list[str]:
    """bench.md's table of the section."""
    lines = [f"## Flower's simulation engine beside the simulator ({section['dataset']}, {section['rounds']} rounds, "
             "the same job)", ""]
    if "skipped" in section:
        return lines + [f"Skipped: {section['skipped']}.", ""]
    lines += ["| M | algorithm | simulator s/round | Flower s/round | Flower / simulator | first round s (sim / Flower) | "
              "startup s (sim / Flower) | teardown s (sim / Flower) | accuracy (sim / Flower) |",
              "|---|---|---|---|---|---|---|---|---|"]
    for p in section["points"]:
        sim, flw = p.get("simulator", {}), p.get("flower", {})
        errors = [f"{e}: {p[e]['error'][-200:]!r}" for e in ENGINES if "error" in p.get(e, {})]
        if errors:
            lines.append(f"| {p['M']} | {p['algorithm']} | error: {'; '.join(errors)} |")
            continue

        def pair(key: str, fmt: str = "{:.2f}") -> str:
            return f"{_f(sim.get(key), fmt)} / {_f(flw.get(key), fmt)}"

        lines.append(f"| {p['M']} | {p['algorithm']} | {sim['s_per_round']:.3f} | {flw['s_per_round']:.3f} | "
                     f"{_f(p.get('flower_over_simulator'), '{:.2f}x')} | {pair('first_round_s')} | {pair('startup_s', '{:.1f}')} | "
                     f"{pair('teardown_s', '{:.1f}')} | {pair('acc_mean', '{:.4f}')} |")
    lines += ["", f"s/round: {section['round_time']} (metrics.csv's round_time_s: from the broadcast to the end of "
              "aggregation; Flower's includes its messages). Startup: "
              f"{section['startup']} (imports, config, data; Flower: Ray and every virtual node building its partition). "
              "Teardown: from the loop's end to the process's exit. One torch thread per process; Flower runs "
              f"{section['flower_workers']} ClientApp(s) at a time. One run each, on a shared machine: noisy.", ""]
    return lines

