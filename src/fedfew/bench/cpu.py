"""The CPU benchmark: ``python -m fedfew.bench [--full] [--out DIR]`` (``make bench``).

Writes ``bench.json`` (every figure) and ``bench.md`` (tables) atomically into ``--out``
(default ``outputs/bench``). Every measurement runs in its own subprocess, so each reports
its own peak host memory (``ru_maxrss``) and, on a GPU, peak device memory.

What is measured (FedFew rounds through :class:`fedfew.simulator.simulation.Simulation`, the real round
loop with aggregation and server step):

* **throughput** -- the paper's configs, ``engine=loop`` and ``engine=vmap`` in the same run:
  CIFAR-10 CNN (M=20, K=3, E=1, batch 50; synthetic pixels with CIFAR-10's shapes and sizes)
  and AG News TextCNN (M=20, K=3, E=1, batch 100; the real AG News files when the data
  directory has them, else synthetic texts). Figures: sample-passes per second (one sample
  through one model, forward + backward), their ratio vmap/loop; achieved FLOP/s of the round
  (useful FLOPs counted with ``FlopCounterMode`` per sample and sequence length) as a fraction
  of the machine's peak measured in the same subprocess (a large matmul); the round's
  overhead: round time over the pure forward/backward time of the very same batches (recorded
  during the round, replayed without data gathering, optimizer, deltas or aggregation).
* **reference** -- the reference implementation's AG News model (TextCNN, embedding 512,
  texts up to 200 tokens, M=20, K=3, E=1, batch 100): our seconds per round beside the
  reference's 220 s and 15 GB, plus the reference's round re-estimated on this machine now
  (its step time at length 200 times its number of steps, ``drop_last``).
* **scaling** -- round time and peak host/device memory for M in (10, 20, 50, 100) at K=3
  and K in (1, 3, 5, 10) at M=20 (CIFAR-10 CNN, one fixed pool of data split among the M
  clients, as when a dataset is partitioned), and M=500 on the full-size CIFAR-10 pool
  (60,000 samples) to show that memory does not grow with M.
* **devices** -- ``python -m fedfew.train`` on AG News with ``trainer.threads=1`` on one
  process versus two DDP CPU processes (``trainer.devices=2 trainer.strategy=ddp
  trainer.accelerator=cpu trainer.threads=1``): mean round time over the rounds (metrics.csv), all 20 clients per round
  and the speed-up.
* **projection** -- the paper's full CIFAR-10 run (2,000 rounds, M=20, K=3, evaluation
  every 10 rounds) from the measured sample-passes per second (meaningful on a GPU).
* **flower** -- Flower's simulation engine beside the simulator on the same digits job
  (``--flower-clients`` 20 200, ``--flower-algorithms`` fedavg fedfew, ``--flower-rounds`` 5):
  seconds per round and startup of each (:mod:`fedfew.bench.flower_speed`; ``--no-flower`` skips it).

Default sizes keep the whole run under ~10 minutes on 2 CPU cores (fewer samples per CIFAR
client, a subset of the AG News clients per round, projected to the full round); ``--full``
uses the paper's sizes (the default on a GPU). Timings on a shared machine are noisy: the
report states the load average before and after.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from fedfew.bench.cases import run_case
from fedfew.bench.common import REFERENCE_PEAK_HOST_GB, REFERENCE_ROUND_S, REFERENCE_STEP_S, _log, detect_device, load_average
from fedfew.bench.cpu_report import render_markdown
from fedfew.bench.flower_speed import flower_section
from fedfew.bench.synthetic import CIFAR_POOL


def agnews_available(data_dir: str | None) -> bool:
    return bool(data_dir) and all((Path(data_dir) / "ag_news_csv" / f).exists() for f in ("train.csv", "test.csv"))


def devices_run(data_dir: str | None, devices: int, rounds: int, participants: int | None, out_dir: Path) -> dict:
    """``python -m fedfew.train`` on AG News with one thread per process; round time of the
    last round from metrics.csv."""
    run_dir = out_dir / f"devices{devices}"
    args = [sys.executable, "-m", "fedfew.train", "dataset=agnews", f"rounds={rounds}", "eval_every=1000",
            "logger=csv", "trainer.threads=1", "trainer.accelerator=cpu", f"hydra.run.dir={run_dir}"]
    if participants:
        args.append(f"clients_per_round={participants}")
    if devices > 1:
        args += [f"trainer.devices={devices}", "trainer.strategy=ddp"]
    if data_dir:
        args.append(f"data_dir={data_dir}")
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    start = time.perf_counter()
    proc = subprocess.run(args, capture_output=True, text=True, env=env, timeout=3600)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        return {"error": (proc.stderr or proc.stdout)[-2000:], "devices": devices}
    import csv

    with open(run_dir / "metrics.csv") as fh:
        rows = list(csv.DictReader(fh))
    times = [float(r["round_time_s"]) for r in rows]
    results = json.loads((run_dir / "results.json").read_text())
    return {"devices": devices, "round_time_s": times, "last_round_s": times[-1],
            "seconds_per_round": results.get("seconds_per_round"), "wall_s": wall, "run_dir": str(run_dir)}


def drive(args) -> int:
    from fedfew.core.io import atomic_write_json, atomic_write_text

    device = detect_device(args.device)
    full = args.full or (device == "cuda" and not args.small)
    data_dir = str(Path(args.data_dir).expanduser().resolve()) if args.data_dir else None
    real_text = agnews_available(data_dir)
    sections = set(args.only or ["throughput", "reference", "scaling", "devices", "flower"]) - (
        {"flower"} if args.no_flower else set())
    out_dir = Path(args.out)
    started = time.perf_counter()
    import torch

    report: dict[str, Any] = {
        "machine": {"device": device, "cuda": torch.cuda.get_device_name(0) if device == "cuda" else None,
                    "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
                    "load_average_start": load_average()},
        "settings": {"full": full, "precision": args.precision, "compile": args.compile,
                     "agnews_data": "real" if real_text else "synthetic", "data_dir": data_dir},
    }
    common = {"device": device, "precision": args.precision, "compile": args.compile, "data_dir": data_dir}
    per_client_cifar = 3000 if full else 134  # pool per client (train 2,250 / 100 after the 25% test share)
    text_data = "real" if real_text else "synthetic-agnews"

    # ---- throughput: paper configs, both engines ------------------------------------------
    if "throughput" in sections:
        thr: dict[str, Any] = {}
        for name, spec in {
            "cifar10_cnn": {"dataset": "cifar10", "data": "synthetic-cifar10", "M": 20, "K": 3,
                            "pool": 20 * per_client_cifar, "warmup": True, "pure": True, "evaluate": True},
            "agnews_textcnn": {"dataset": "agnews", "data": text_data, "M": 20, "K": 3, "pure": True,
                               "participants": None if full else 5},
        }.items():
            thr[name] = {}
            for engine in ("loop", "vmap"):
                _log(f"throughput {name} engine={engine}")
                # the evaluation's cost does not depend on the engine: timed once
                thr[name][engine] = run_case({**common, **spec, "engine": engine,
                                              "evaluate": spec.get("evaluate", False) and engine == "loop"})
            lo, vm = thr[name]["loop"], thr[name]["vmap"]
            if "error" not in lo and "error" not in vm:
                thr[name]["vmap_over_loop"] = vm["sample_passes_per_s"] / lo["sample_passes_per_s"]
        report["throughput"] = thr
        cifar = thr.get("cifar10_cnn", {})
        report["projection"] = project_full_cifar(cifar, device)

    # ---- reference preset -------------------------------------------------------------------
    if "reference" in sections:
        ref: dict[str, Any] = {"reference_round_s": REFERENCE_ROUND_S, "reference_step_s": REFERENCE_STEP_S,
                               "reference_peak_host_gb": REFERENCE_PEAK_HOST_GB}
        # the reference's batches: plain shuffled order (no length grouping), its TextCNN
        spec = {"dataset": "agnews", "data": text_data, "M": 20, "K": 3,
                "overrides": ["model=textcnn_reference", "dataset.group_by_length=false"],
                "participants": None if full else 3}
        for engine in ("loop", "vmap"):
            _log(f"reference engine={engine}")
            res = run_case({**common, **spec, "engine": engine})
            if "error" not in res:
                scale = res["all_train_samples"] / res["train_samples"]
                res["projected_round_s"] = res["round_s"] * scale
                res["speedup_vs_reference"] = REFERENCE_ROUND_S / res["projected_round_s"]
            ref[engine] = res
        if args.precision != "bf16-mixed":
            _log("reference engine=loop precision=bf16-mixed")
            res = run_case({**common, **spec, "engine": "loop", "precision": "bf16-mixed"})
            if "error" not in res:
                res["projected_round_s"] = res["round_s"] * res["all_train_samples"] / res["train_samples"]
                res["speedup_vs_reference"] = REFERENCE_ROUND_S / res["projected_round_s"]
            ref["loop_bf16"] = res
        _log("reference step at length 200")
        step = run_case({**common, "kind": "reference_step"})
        ref["reference_step_here"] = step
        sizes = next((ref[e].get("client_sizes_all") for e in ("loop", "vmap") if "client_sizes_all" in ref[e]), None)
        if sizes and "step_s" in step:
            steps = 3 * sum(n // 100 for n in sizes)  # drop_last=True, K=3
            ref["reference_steps_per_round"] = steps
            ref["reference_round_here_s"] = steps * step["step_s"]
            for engine in ("loop", "vmap", "loop_bf16"):
                if "projected_round_s" in ref.get(engine, {}):
                    ref[engine]["speedup_vs_reference_here"] = ref["reference_round_here_s"] / ref[engine]["projected_round_s"]
        report["reference"] = ref

    # ---- scaling in M and K ------------------------------------------------------------------
    if "scaling" in sections:
        engine = best_engine(report.get("throughput", {}).get("cifar10_cnn", {}), device)
        pool = CIFAR_POOL if full else 2_700
        points: list[dict] = []
        for M, K in [(10, 3), (20, 3), (50, 3), (100, 3), (20, 1), (20, 5), (20, 10)]:
            _log(f"scaling M={M} K={K} engine={engine}")
            res = run_case({**common, "dataset": "cifar10", "data": "synthetic-cifar10", "M": M, "K": K,
                            "pool": pool, "warmup": True, "engine": engine})
            points.append({"M": M, "K": K, "pool": pool, **res})
        _log(f"scaling M=500 K=3 (full CIFAR-10 pool) engine={engine}")
        res = run_case({**common, "dataset": "cifar10", "data": "synthetic-cifar10", "M": 500, "K": 3, "pool": CIFAR_POOL,
                        "engine": engine, "participants": None if full else 50})
        points.append({"M": 500, "K": 3, "pool": CIFAR_POOL, **res})
        report["scaling"] = {"engine": engine, "points": points}

    # ---- devices=1 vs devices=2 (CPU DDP, one thread each) -----------------------------------
    if "devices" in sections and not real_text:
        report["devices"] = {"skipped": "the AG News files are not in the data directory (--data-dir)"}
    elif "devices" in sections:
        # the AG News config as users run it: all 20 clients every round. (A subset of clients
        # per round is not balanced across ranks: each client belongs to one rank for the run.)
        rounds = 2
        participants = None
        with tempfile.TemporaryDirectory() as tmp:
            runs = {}
            for devices in (1, 2):
                _log(f"devices={devices} threads=1 (AG News, rounds={rounds})")
                runs[devices] = devices_run(data_dir, devices, rounds, participants, Path(tmp))
        dev: dict[str, Any] = {"rounds": rounds, "clients_per_round": participants or 20, "runs": runs}
        if all("last_round_s" in r for r in runs.values()):
            mean = {d: sum(r["round_time_s"]) / len(r["round_time_s"]) for d, r in runs.items()}
            dev["speedup"] = mean[1] / mean[2]
        report["devices"] = dev

    # ---- Flower's simulation engine beside the simulator (digits) -----------------------------
    if "flower" in sections:
        report["flower"] = flower_section(args.flower_clients, args.flower_algorithms, args.flower_rounds)

    report["machine"]["load_average_end"] = load_average()
    report["bench_wall_s"] = time.perf_counter() - started
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out_dir / "bench.json", report)
    atomic_write_text(out_dir / "bench.md", render_markdown(report))
    _log(f"wrote {out_dir / 'bench.json'} and {out_dir / 'bench.md'} ({report['bench_wall_s']:.0f} s)")
    print(render_markdown(report))
    return 0


def best_engine(cifar: dict, device: str) -> str:
    """The engine with more sample-passes per second in the CIFAR-10 throughput case."""
    rates = {e: cifar[e]["sample_passes_per_s"] for e in ("loop", "vmap") if e in cifar and "sample_passes_per_s" in cifar[e]}
    if not rates:
        return "vmap" if device == "cuda" else "loop"
    return max(rates, key=rates.get)


def project_full_cifar(cifar: dict, device: str) -> dict:
    """Projected wall time of the paper's CIFAR-10 run (2,000 rounds, M=20, K=3, E=1,
    evaluation every 10 rounds) from the measured rates (round: sample-passes per second;
    evaluation: seconds per evaluated sample)."""
    out: dict[str, Any] = {"rounds": 2000, "M": 20, "K": 3, "device": device,
                           "note": "the target (under 10 minutes) is for one H200; a CPU projection is for scale only"}
    full_train = 20 * (3000 - 750)  # 45,000 train samples over 20 clients
    for engine in ("loop", "vmap"):
        res = cifar.get(engine, {})
        if "sample_passes_per_s" not in res:
            continue
        round_s = full_train * 3 / res["sample_passes_per_s"]
        timed = next((r for r in (res, *cifar.values()) if isinstance(r, dict) and "evaluate_s" in r), {})
        eval_s = timed.get("evaluate_s", 0.0) / max(1, timed.get("evaluated_samples", 1)) * CIFAR_POOL
        total = 2000 * round_s + 200 * eval_s
        out[engine] = {"round_s": round_s, "evaluation_s": eval_s, "total_s": total, "total_min": total / 60}
    return out
