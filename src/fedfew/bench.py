"""Simulator benchmark: ``python -m fedfew.bench [--full] [--out DIR]`` (``make bench``).

Writes ``bench.json`` (every figure) and ``bench.md`` (tables) atomically into ``--out``
(default ``outputs/bench``). Every measurement runs in its own subprocess, so each reports
its own peak host memory (``ru_maxrss``) and, on a GPU, peak device memory.

What is measured (FedFew rounds through :class:`fedfew.simulation.Simulation`, the real round
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

Default sizes keep the whole run under ~10 minutes on 2 CPU cores (fewer samples per CIFAR
client, a subset of the AG News clients per round, projected to the full round); ``--full``
uses the paper's sizes (the default on a GPU). Timings on a shared machine are noisy: the
report states the load average before and after.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

#: the reference implementation's AG News round on 2 CPU cores (pgg3/FedFew on PFLlib)
REFERENCE_ROUND_S = 220.0
REFERENCE_STEP_S = 1.2
REFERENCE_PEAK_HOST_GB = 15.0
#: targets of the issue
TARGET_REFERENCE_SPEEDUP = 3.0
TARGET_REFERENCE_HOST_GB = 2.0
TARGET_OVERHEAD = 0.20
TARGET_DEVICES_SPEEDUP = 1.7
TARGET_VMAP_GPU = 5.0
TARGET_PROJECTION_S = 600.0

CIFAR_POOL = 60_000           # CIFAR-10 train + test
CIFAR_TEST_FRACTION = 0.25    # our partitions' default held-out share


# ---------------------------------------------------------------------------------------------
# helpers (run inside the case subprocesses)
# ---------------------------------------------------------------------------------------------

def _sync(device) -> None:
    import torch

    if getattr(device, "type", str(device)) == "cuda":
        torch.cuda.synchronize(device)


def peak_host_mb() -> float:
    """Peak resident memory of this process so far (MiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def peak_matmul_flops(device, dtype_name: str = "float32", size: int | None = None, seconds: float = 1.0) -> float:
    """FLOP/s of a large square matmul on ``device`` (best of a few timed repetitions)."""
    import torch

    device = torch.device(device)
    dtype = getattr(torch, dtype_name)
    n = size or (8192 if device.type == "cuda" else 2048)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    a @ b
    _sync(device)
    best = math.inf
    deadline = time.perf_counter() + seconds
    while True:
        start = time.perf_counter()
        a @ b
        _sync(device)
        best = min(best, time.perf_counter() - start)
        if time.perf_counter() > deadline:
            break
    return 2.0 * n**3 / best


def compose(overrides: list[str]):
    """The run config as ``python -m fedfew.train <overrides>`` sees it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    conf = Path(__file__).resolve().parent / "conf"
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=list(overrides))


def synthetic_images(pool: int, num_clients: int, seed: int = 0, shape=(3, 32, 32), classes: int = 10):
    """CIFAR-10-shaped :class:`FederatedData`: ``pool`` random images split evenly among the
    clients (a quarter of each client held out for testing)."""
    import numpy as np
    import torch

    from fedfew.data.base import ClientSplit, FederatedData

    g = torch.Generator().manual_seed(seed)
    inputs = torch.randn((pool, *shape), generator=g)
    targets = torch.randint(0, classes, (pool,), generator=g)
    bounds = np.linspace(0, pool, num_clients + 1).astype(np.int64)
    clients = []
    for i in range(num_clients):
        ids = np.arange(bounds[i], bounds[i + 1], dtype=np.int64)
        n_test = max(1, int(round(len(ids) * CIFAR_TEST_FRACTION)))
        clients.append(ClientSplit(i, train=ids[n_test:], test=ids[:n_test]))
    return FederatedData(inputs=inputs, targets=targets, num_classes=classes, clients=clients,
                         partition_hash=f"synthetic-{pool}-{num_clients}-{seed}", name="synthetic-cifar10")


def synthetic_texts(num_clients: int, per_client: int = 480, vocab: int = 23_868, seed: int = 0):
    """AG-News-shaped texts (token ids, lengths ~ 44 +- 15 up to 200) when the real files are absent."""
    import numpy as np
    import torch

    from fedfew.data.base import ClientSplit, FederatedData

    g = torch.Generator().manual_seed(seed)
    n = num_clients * per_client
    lengths = (torch.randn(n, generator=g) * 15 + 44).round().clamp(8, 200).long()
    inputs = torch.randint(2, vocab, (n, 200), generator=g)
    inputs[torch.arange(200)[None, :] >= lengths[:, None]] = 0
    targets = torch.randint(0, 4, (n,), generator=g)
    clients = []
    for i in range(num_clients):
        ids = np.arange(i * per_client, (i + 1) * per_client, dtype=np.int64)
        n_test = per_client // 4
        clients.append(ClientSplit(i, train=ids[n_test:], test=ids[:n_test]))
    return FederatedData(inputs=inputs, targets=targets, num_classes=4, clients=clients, lengths=lengths,
                         vocab_size=vocab, partition_hash=f"synthetic-text-{n}", name="synthetic-agnews")


class Recorder:
    """Keeps what each local step consumed during one round, for the pure forward/backward
    replay: the loop engine's batch indices (``data.batch`` calls) or the vmap engine's
    step inputs (x, y, weight per vectorised step)."""

    def __init__(self, sim) -> None:
        self.engine = sim.algorithm.engine
        self.batches: list[Any] = []
        self._original = None

    def __enter__(self) -> "Recorder":
        if self.engine.name == "vmap":
            step = self._original = self.engine._step

            def recording_step(params, buffers, x, y, weight):
                self.batches.append((x, y, weight))
                return step(params, buffers, x, y, weight)

            self.engine._step = recording_step
        else:
            batch = self.engine.data.batch

            def recording_batch(index):
                self.batches.append(index)
                return batch(index)

            self.engine.data.batch = recording_batch  # an instance attribute shadowing the method
        return self

    def __exit__(self, *exc) -> None:
        if self.engine.name == "vmap":
            self.engine._step = self._original
        else:
            del self.engine.data.batch


def flops_per_sample(model, x_tail_shape: tuple[int, ...], sample: Any, device, cache: dict) -> float:
    """Forward + backward FLOPs of ``model`` per sample for inputs of shape (B, *tail)."""
    import torch
    import torch.nn.functional as F
    from torch.utils.flop_counter import FlopCounterMode

    key = tuple(x_tail_shape)
    if key not in cache:
        x = sample[:2]
        if x.shape[1:] != key:  # text: cut/pad to this length
            x = x[:, : key[0]] if x.shape[1] >= key[0] else F.pad(x, (0, key[0] - x.shape[1]))
        y = torch.zeros(len(x), dtype=torch.long, device=device)
        with FlopCounterMode(display=False) as counter:
            F.cross_entropy(model(x), y).backward()
        model.zero_grad(set_to_none=True)
        cache[key] = counter.get_total_flops() / len(x)
    return cache[key]


def replay_pure(sim, recorded: list[Any]) -> tuple[float, float, int]:
    """Time the forward+backward of the recorded batches alone.

    Returns:
        (seconds, useful FLOPs, sample-passes) of the replay.
    """
    import torch
    import torch.nn.functional as F

    engine = sim.algorithm.engine
    device = sim.fabric.device
    module = sim.module
    model = module.working
    model.train()
    cache: dict = {}
    sample = sim.data.batch(sim.ctx.train_index[0][:2])[0]
    autocast = engine._autocast
    flops, passes = 0.0, 0
    if engine.name == "vmap":
        steps = []
        for x, y, weight in recorded:
            counts = (weight > 0).sum(dim=1)
            n = int(counts.sum())
            passes += n
            flops += n * flops_per_sample(model, tuple(x.shape[2:]), sample, device, cache)
            steps.append((x, y, weight, int(x.shape[0])))
        params = {name: p for name, p in zip(engine._names, engine._params)}
        buffers = {name: b for name, b in zip(engine._buffer_names, engine._buffers)}
        _sync(device)
        start = time.perf_counter()
        with torch.no_grad():
            for x, y, weight, rows in steps:
                engine._step({k: v[:rows] for k, v in params.items()}, {k: v[:rows] for k, v in buffers.items()},
                             x, y, weight)
        _sync(device)
        return time.perf_counter() - start, flops, passes
    batches = [sim.data.batch(index) for index in recorded]
    for x, _ in batches:
        passes += len(x)
        flops += len(x) * flops_per_sample(model, tuple(x.shape[1:]), sample, device, cache)
    _sync(device)
    start = time.perf_counter()
    for x, y in batches:
        model.zero_grad(set_to_none=True)
        with autocast():
            loss = F.cross_entropy(model(x), y)
        loss.backward()
    _sync(device)
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - start, flops, passes


def _fabric(device: str, precision: str):
    from lightning.fabric import Fabric

    return Fabric(accelerator="cuda" if device == "cuda" else "cpu", devices=1, precision=precision)


def case_round(spec: dict) -> dict:
    """One FedFew configuration: optional warm-up round, a timed round (recorded for the
    pure replay when ``spec["pure"]``), optional evaluation timing."""
    import torch

    from fedfew.simulation import Simulation

    device = torch.device(spec["device"])
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    base_rss = peak_host_mb()
    overrides = [
        f"dataset={spec['dataset']}", f"num_clients={spec['M']}", f"algorithm.K={spec['K']}", "local_epochs=1",
        "logger=none", f"engine={spec['engine']}", f"compile={str(spec.get('compile', False)).lower()}",
        f"trainer.precision={spec.get('precision', '32-true')}", *spec.get("overrides", []),
    ]
    if spec.get("data_dir"):
        overrides.append(f"data_dir={spec['data_dir']}")
    cfg = compose(overrides)
    if spec["data"] == "synthetic-cifar10":
        data = synthetic_images(spec["pool"], spec["M"])
    elif spec["data"] == "synthetic-agnews":
        data = synthetic_texts(spec["M"])
    else:
        from fedfew.data.federated import build_federated_data

        data = build_federated_data(cfg)
    fabric = _fabric(spec["device"], spec.get("precision", "32-true"))
    with tempfile.TemporaryDirectory() as tmp:
        sim = Simulation(cfg, fabric, Path(tmp), data=data)
        participants = spec.get("participants")  # a fixed subset of clients (None: all)
        out: dict[str, Any] = {"base_host_mb": base_rss}
        if spec.get("warmup"):
            cfg.clients_per_round = min(2, sim.num_clients)
            sim.run_round(0)
        if participants:
            cfg.clients_per_round = int(participants)
        else:
            cfg.clients_per_round = None
        rnd = 1
        chosen = _participants(sim, rnd)
        sizes = [int(sim.num_train[c]) for c in chosen]
        recorder = Recorder(sim) if spec.get("pure") else contextlib.nullcontext()
        _sync(device)
        with recorder:
            start = time.perf_counter()
            logs = sim.run_round(rnd)
            _sync(device)
            round_s = time.perf_counter() - start
        passes = sum(sizes) * spec["K"]
        out.update(round_s=round_s, clients=len(chosen), train_samples=sum(sizes), sample_passes=passes,
                   sample_passes_per_s=passes / round_s, all_train_samples=int(sim.num_train.sum()),
                   client_sizes_all=[int(n) for n in sim.num_train.tolist()],
                   loss_finite=bool(torch.isfinite(logs["loss"]).all()), engine=spec["engine"],
                   engine_clients=getattr(sim.algorithm.engine, "max_clients", lambda: 1)())
        if spec.get("pure"):
            recorded = recorder.batches
            pure_s, flops, pure_passes = replay_pure(sim, recorded)
            del recorded, recorder
            peak = peak_matmul_flops(device, "bfloat16" if "bf16" in spec.get("precision", "") else "float32")
            out.update(pure_fwd_bwd_s=pure_s, overhead=round_s / pure_s - 1.0, round_flops=flops,
                       achieved_flops=flops / round_s, peak_flops=peak, flop_fraction=flops / round_s / peak,
                       pure_sample_passes=pure_passes)
        if spec.get("evaluate"):
            _sync(device)
            start = time.perf_counter()
            sim.evaluate(rnd)
            _sync(device)
            out["evaluate_s"] = time.perf_counter() - start
            out["evaluated_samples"] = sum(len(c.train) + len(c.test) for c in sim.host_data.clients)
    out["peak_host_mb"] = peak_host_mb()
    out["peak_device_mb"] = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
    return out


def _participants(sim, rnd: int) -> list[int]:
    from fedfew.simulation import select_participants

    return select_participants(sim.cfg, rnd, sim.num_clients)


def case_reference_step(spec: dict) -> dict:
    """The reference's training step on this machine now: TextCNN (embedding 512), a batch of
    100 texts padded to 200 tokens, forward + backward + SGD step, one model at a time."""
    import torch
    import torch.nn.functional as F

    from fedfew.models import MODELS, DataInfo

    device = torch.device(spec["device"])
    cfg = compose(["dataset=agnews", "model=textcnn_reference"])
    torch.manual_seed(0)
    model = MODELS.get("textcnn")(cfg.model, DataInfo((200,), 4, spec.get("vocab", 23_868))).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randint(2, spec.get("vocab", 23_868), (100, 200), device=device)
    y = torch.randint(0, 4, (100,), device=device)

    def step():
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()

    step()
    _sync(device)
    times = []
    for _ in range(spec.get("steps", 3)):
        start = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - start)
    return {"step_s": sorted(times)[len(times) // 2], "steps_timed": len(times)}


CASES = {"round": case_round, "reference_step": case_reference_step}


# ---------------------------------------------------------------------------------------------
# the driver (parent process)
# ---------------------------------------------------------------------------------------------

def run_case(spec: dict, timeout: float = 1800) -> dict:
    """Run one case in a fresh interpreter; returns its JSON result (``error`` on failure)."""
    env = dict(os.environ)
    env.setdefault("PYTHONWARNINGS", "ignore")
    start = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-m", "fedfew.bench", "--case", json.dumps(spec)], capture_output=True,
                              text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s", "spec": spec}
    wall = time.perf_counter() - start
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("BENCH_RESULT "):
            result = json.loads(line[len("BENCH_RESULT "):])
            result["case_wall_s"] = wall
            return result
    return {"error": (proc.stderr or proc.stdout)[-2000:], "spec": spec, "returncode": proc.returncode}


def load_average() -> list[float] | None:
    try:
        return list(os.getloadavg())
    except OSError:
        return None


def detect_device(choice: str) -> str:
    import torch

    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return choice


def agnews_available(data_dir: str | None) -> bool:
    return bool(data_dir) and all((Path(data_dir) / "ag_news_csv" / f).exists() for f in ("train.csv", "test.csv"))


def _log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fedfew.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--full", action="store_true", help="the paper's sizes (default on a GPU)")
    parser.add_argument("--small", action="store_true", help="the small default sizes even on a GPU")
    parser.add_argument("--out", default="outputs/bench", help="folder for bench.json and bench.md")
    parser.add_argument("--data-dir", default=os.environ.get("FEDFEW_DATA_DIR"),
                        help="data directory holding ag_news_csv/ (default $FEDFEW_DATA_DIR)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--precision", default="32-true", help="Fabric precision of the runs (32-true | bf16-mixed)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the local step (compile=true)")
    parser.add_argument("--only", nargs="*", default=None,
                        help="sections to run: throughput reference scaling devices (default: all)")
    parser.add_argument("--case", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.case:
        spec = json.loads(args.case)
        result = CASES[spec.get("kind", "round")](spec)
        print("BENCH_RESULT " + json.dumps(result), flush=True)
        return 0
    return drive(args)


def drive(args) -> int:
    from fedfew.io import atomic_write_json, atomic_write_text

    device = detect_device(args.device)
    full = args.full or (device == "cuda" and not args.small)
    data_dir = str(Path(args.data_dir).expanduser().resolve()) if args.data_dir else None
    real_text = agnews_available(data_dir)
    sections = set(args.only or ["throughput", "reference", "scaling", "devices"])
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


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------

def _f(value: Any, fmt: str = "{:.2f}") -> str:
    if value is None:
        return "n/a"
    if isinstance(value, (int, float)):
        return fmt.format(value)
    return str(value)


def _mb(value: Any) -> str:
    return "n/a" if value is None else f"{value:,.0f} MiB"


def render_markdown(report: dict) -> str:
    m = report["machine"]
    s = report["settings"]
    lines = [
        "# fedfew benchmark",
        "",
        f"Device: **{m['device']}**{' (' + m['cuda'] + ')' if m.get('cuda') else ''}, {m['cpu_count']} CPU cores, "
        f"torch {m['torch']} ({m['torch_threads']} threads); precision {s['precision']}, compile {s['compile']}, "
        f"sizes: {'full' if s['full'] else 'small (default; --full for the paper sizes)'}; AG News data: {s['agnews_data']}.",
        f"Load average at start {m.get('load_average_start')}, at end {m.get('load_average_end')}: on a shared "
        "machine every timing below is noisy (other jobs compete for the same cores).",
        "",
    ]
    thr = report.get("throughput")
    if thr:
        lines += ["## Throughput (sample-passes/s: one sample through one model, forward + backward)", "",
                  "| config | engine | clients | sample-passes | round s | sample-passes/s | pure fwd/bwd s | overhead | "
                  "achieved GFLOP/s | peak GFLOP/s | fraction of peak | peak host | peak device |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for name, per in thr.items():
            for engine in ("loop", "vmap"):
                r = per.get(engine, {})
                if "error" in r:
                    lines.append(f"| {name} | {engine} | error: {r['error'][-200:]!r} |")
                    continue
                lines.append(
                    f"| {name} | {engine} | {r['clients']} | {r['sample_passes']:,} | {r['round_s']:.2f} | "
                    f"{r['sample_passes_per_s']:.0f} | {_f(r.get('pure_fwd_bwd_s'))} | {_f(r.get('overhead'), '{:+.0%}')} | "
                    f"{_f(r.get('achieved_flops', 0) / 1e9, '{:.1f}')} | {_f(r.get('peak_flops', 0) / 1e9, '{:.0f}')} | "
                    f"{_f(r.get('flop_fraction'), '{:.1%}')} | {_mb(r.get('peak_host_mb'))} | {_mb(r.get('peak_device_mb'))} |")
            if "vmap_over_loop" in per:
                lines.append(f"| {name} | **vmap / loop** | | | | **{per['vmap_over_loop']:.2f}x** | | | | | | | |")
        lines += ["", "Overhead = round time / pure forward+backward time of the same batches - 1 "
                  f"(target on CPU: at most {TARGET_OVERHEAD:.0%}).", ""]
    proj = report.get("projection")
    if proj and any(e in proj for e in ("loop", "vmap")):
        lines += ["## Projection: the paper's CIFAR-10 run (2,000 rounds, M=20, K=3, E=1, eval every 10 rounds)", ""]
        for engine in ("loop", "vmap"):
            if engine in proj:
                p = proj[engine]
                lines.append(f"- {engine}: {p['round_s']:.2f} s/round, total {p['total_min']:.1f} min on {proj['device']}")
        lines += [f"- target: under {TARGET_PROJECTION_S / 60:.0f} minutes on one H200 ({proj['note']})", ""]
    ref = report.get("reference")
    if ref:
        lines += ["## Reference preset: AG News TextCNN (embedding 512, texts up to 200 tokens, M=20, K=3, E=1, batch 100)", "",
                  "| engine | clients timed | round s (timed) | projected full round s | vs reference 220 s | "
                  "vs reference re-estimated here | peak host |", "|---|---|---|---|---|---|---|"]
        # loop_bf16: engine=loop with precision=bf16-mixed (not the reference's float32 numerics)
        for engine in ("loop", "vmap", "loop_bf16"):
            r = ref.get(engine)
            if r is None:
                continue
            if "error" in r:
                lines.append(f"| {engine} | error: {r['error'][-200:]!r} |")
                continue
            lines.append(f"| {engine} | {r['clients']} of 20 | {r['round_s']:.1f} | {r['projected_round_s']:.1f} | "
                         f"{r['speedup_vs_reference']:.2f}x | {_f(r.get('speedup_vs_reference_here'), '{:.2f}x')} | "
                         f"{_mb(r.get('peak_host_mb'))} |")
        here = ref.get("reference_round_here_s")
        lines += ["", f"Reference: {REFERENCE_ROUND_S:.0f} s/round, {REFERENCE_STEP_S} s/step, {REFERENCE_PEAK_HOST_GB:.0f} GB "
                  f"peak host (targets: >= {TARGET_REFERENCE_SPEEDUP:.0f}x faster, < {TARGET_REFERENCE_HOST_GB:.0f} GB). "
                  f"Its step (batch 100 padded to 200 tokens) measured here now: "
                  f"{_f(ref.get('reference_step_here', {}).get('step_s'))} s; times its "
                  f"{ref.get('reference_steps_per_round', 'n/a')} steps (drop_last) = {_f(here, '{:.0f}')} s per round "
                  "re-estimated on this machine under the current load.", ""]
    sc = report.get("scaling")
    if sc:
        lines += [f"## Scaling (CIFAR-10 CNN, engine={sc['engine']}, one fixed pool of samples split among the M clients)", "",
                  "| M | K | pool | clients timed | round s | s per client-model | sample-passes/s | peak host | peak device |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for p in sc["points"]:
            if "error" in p:
                lines.append(f"| {p['M']} | {p['K']} | error: {p['error'][-200:]!r} |")
                continue
            lines.append(f"| {p['M']} | {p['K']} | {p['pool']:,} | {p['clients']} | {p['round_s']:.2f} | "
                         f"{p['round_s'] / (p['clients'] * p['K']):.3f} | {p['sample_passes_per_s']:.0f} | "
                         f"{_mb(p.get('peak_host_mb'))} | {_mb(p.get('peak_device_mb'))} |")
        lines += ["", "Target: peak host memory grows with K and the model size, not with M (M=500 at K=3 within 4 GiB).", ""]
    dev = report.get("devices")
    if dev and "skipped" in dev:
        lines += ["## devices=1 vs devices=2", "", f"Skipped: {dev['skipped']}.", ""]
    elif dev:
        lines += ["## devices=1 vs devices=2 (CPU DDP, trainer.threads=1 each; AG News)", ""]
        for d, r in dev["runs"].items():
            if "error" in r:
                lines.append(f"- devices={d}: error: {r['error'][-300:]!r}")
            else:
                lines.append(f"- devices={d}: round times {[round(t, 2) for t in r['round_time_s']]} s "
                             f"(last {r['last_round_s']:.2f} s), seconds_per_round {_f(r['seconds_per_round'])}")
        lines += [f"- speed-up (mean round time): **{_f(dev.get('speedup'), '{:.2f}x')}** (target >= {TARGET_DEVICES_SPEEDUP}x on 2 cores; "
                  f"{dev['clients_per_round']} clients per round, {dev['rounds']} rounds)", ""]
    lines.append(f"Benchmark wall time: {report.get('bench_wall_s', 0):.0f} s.")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
