"""Simulator benchmark: ``python -m fedfew.bench [--full] [--out DIR]`` (``make bench``).

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

Default sizes keep the whole run under ~10 minutes on 2 CPU cores (fewer samples per CIFAR
client, a subset of the AG News clients per round, projected to the full round); ``--full``
uses the paper's sizes (the default on a GPU). Timings on a shared machine are noisy: the
report states the load average before and after.

``python -m fedfew.bench --gpu-check`` (``make gpu-check`` via ``scripts/gpu_check.sh``; see
docs/speed.md) is the GPU readiness check: loop == vmap after 2 rounds, engine speed with
multi-client chunks, bf16-mixed vs fp32, the paper's CIFAR-10 run projected to 2,000 rounds,
peak GPU memory against M and K, and FLOP/s against matmul peaks, each section under a time
cap, the issue's targets judged in ``bench.md``. Without a GPU it runs the same code at tiny
sizes (the CPU smoke mode, under a minute). See the section "GPU readiness check" below.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedfew.config.compose import compose

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


def _client_bounds(pool: int, num_clients: int, sizes=None):
    """(M + 1,) boundaries of consecutive client blocks: an even split of ``pool``, or the
    given per-client ``sizes`` (cycled over the M clients; ``pool`` is then their sum)."""
    import numpy as np

    if sizes is None:
        return np.linspace(0, pool, num_clients + 1).astype(np.int64)
    per_client = [int(sizes[i % len(sizes)]) for i in range(num_clients)]
    return np.concatenate([[0], np.cumsum(per_client)]).astype(np.int64)


@functools.lru_cache(maxsize=2)
def _random_pool(pool: int, shape: tuple[int, ...], classes: int, seed: int):
    """(pool, *shape) standard-normal inputs and (pool,) labels, drawn once per process for each
    setting (the gpu-check's cases share one 60,000-image pool instead of drawing it a dozen
    times); the tensors are read, never written."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randn((pool, *shape), generator=g), torch.randint(0, classes, (pool,), generator=g)


def synthetic_images(pool: int, num_clients: int, seed: int = 0, shape=(3, 32, 32), classes: int = 10,
                     sizes=None):
    """CIFAR-10-shaped :class:`FederatedData`: ``pool`` random images split evenly among the
    clients (a quarter of each client held out for testing).

    Args:
        sizes: optional per-client sample counts (cycled over the clients; each >= 2) instead
            of the even split; ``pool`` is then ignored.
    """
    import numpy as np

    from fedfew.data.base import ClientSplit, FederatedData

    bounds = _client_bounds(pool, num_clients, sizes)
    pool = int(bounds[-1])
    inputs, targets = _random_pool(pool, tuple(shape), classes, seed)
    clients = []
    for i in range(num_clients):
        ids = np.arange(bounds[i], bounds[i + 1], dtype=np.int64)
        n_test = max(1, int(round(len(ids) * CIFAR_TEST_FRACTION)))
        clients.append(ClientSplit(i, train=ids[n_test:], test=ids[:n_test]))
    return FederatedData(inputs=inputs, targets=targets, num_classes=classes, clients=clients,
                         partition_hash=f"synthetic-{pool}-{num_clients}-{seed}", name="synthetic-cifar10")


def synthetic_texts(num_clients: int, per_client: int = 480, vocab: int = 23_868, seed: int = 0,
                    length: int | None = None, sizes=None):
    """AG-News-shaped texts (token ids, lengths ~ 44 +- 15 up to 200) when the real files are absent.

    Args:
        length: every text exactly this many tokens (no padding; ``inputs`` is (N, length))
            instead of the AG-News-like lengths.
        sizes: optional per-client sample counts (cycled over the clients) instead of
            ``per_client`` each.
    """
    import numpy as np
    import torch

    from fedfew.data.base import ClientSplit, FederatedData

    bounds = _client_bounds(num_clients * per_client, num_clients, sizes if sizes is not None else [per_client])
    n = int(bounds[-1])
    g = torch.Generator().manual_seed(seed)
    if length is None:
        lengths = (torch.randn(n, generator=g) * 15 + 44).round().clamp(8, 200).long()
        inputs = torch.randint(2, vocab, (n, 200), generator=g)
        inputs[torch.arange(200)[None, :] >= lengths[:, None]] = 0
    else:
        lengths = torch.full((n,), int(length), dtype=torch.long)
        inputs = torch.randint(2, vocab, (n, int(length)), generator=g)
    targets = torch.randint(0, 4, (n,), generator=g)
    clients = []
    for i in range(num_clients):
        ids = np.arange(bounds[i], bounds[i + 1], dtype=np.int64)
        n_test = len(ids) // 4
        clients.append(ClientSplit(i, train=ids[n_test:], test=ids[:n_test]))
    return FederatedData(inputs=inputs, targets=targets, num_classes=4, clients=clients, lengths=lengths,
                         vocab_size=vocab, partition_hash=f"synthetic-text-{n}-{length}", name="synthetic-agnews")


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

    device = torch.device(spec["device"])
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    base_rss = peak_host_mb()
    with tempfile.TemporaryDirectory() as tmp:
        sim = build_case_sim(spec, Path(tmp))
        cfg = sim.cfg
        participants = spec.get("participants")  # a fixed subset of clients (None: all)
        out: dict[str, Any] = {"base_host_mb": base_rss}
        if spec.get("warmup"):
            # True: a round of 2 clients; an int: a round of that many clients
            warm = 2 if spec["warmup"] is True else int(spec["warmup"])
            cfg.clients_per_round = min(warm, sim.num_clients)
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
            out.update(pure_fwd_bwd_s=pure_s, overhead=round_s / pure_s - 1.0, round_flops=flops,
                       achieved_flops=flops / round_s, pure_sample_passes=pure_passes)
            if spec.get("peak", True):  # the gpu-check measures its peaks once per run instead
                peak = peak_matmul_flops(device, "bfloat16" if "bf16" in spec.get("precision", "") else "float32")
                out.update(peak_flops=peak, flop_fraction=flops / round_s / peak)
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


def build_case_sim(spec: dict, run_dir: Path, data=None):
    """The :class:`~fedfew.simulator.simulation.Simulation` of one bench case.

    Args:
        spec: ``device`` (cpu | cuda), ``dataset``, ``M``, ``K``, ``engine``, optional
            ``precision`` (Fabric's, default 32-true), ``compile``, ``overrides`` (Hydra
            overrides appended last), ``data_dir``, and ``data``: ``synthetic-cifar10``
            (``pool`` random CIFAR-shaped images, split evenly or by ``sizes``),
            ``synthetic-agnews`` (``per_client`` texts, optional fixed ``length`` and
            ``sizes``, ``vocab``) or ``real`` (the dataset's loader and partition).
        run_dir: the simulation's run folder.
        data: prebuilt :class:`~fedfew.data.base.FederatedData` (``spec["data"]`` ignored).
    """
    from fedfew.simulator.simulation import Simulation

    overrides = [
        f"dataset={spec['dataset']}", f"num_clients={spec['M']}", f"algorithm.K={spec['K']}", "local_epochs=1",
        "logger=none", f"engine={spec['engine']}", f"compile={str(spec.get('compile', False)).lower()}",
        f"trainer.precision={spec.get('precision', '32-true')}", *spec.get("overrides", []),
    ]
    if spec.get("data_dir"):
        overrides.append(f"data_dir={spec['data_dir']}")
    cfg = compose(overrides)
    if data is not None:
        pass  # prebuilt (the gpu-check's real CIFAR-10, shared by its sections)
    elif spec["data"] == "synthetic-cifar10":
        data = synthetic_images(spec.get("pool", 0), spec["M"], sizes=spec.get("sizes"))
    elif spec["data"] == "synthetic-agnews":
        data = synthetic_texts(spec["M"], per_client=spec.get("per_client", 480), vocab=spec.get("vocab", 23_868),
                               length=spec.get("length"), sizes=spec.get("sizes"))
    else:
        from fedfew.data.federated import build_federated_data

        data = build_federated_data(cfg)
    fabric = _fabric(spec["device"], spec.get("precision", "32-true"))
    return Simulation(cfg, fabric, run_dir, data=data)


def _participants(sim, rnd: int) -> list[int]:
    from fedfew.simulator.simulation import select_participants

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
    from fedfew.core.run_folders import python_command

    parser = argparse.ArgumentParser(prog=python_command("fedfew.bench"), description=__doc__.split("\n\n")[0])
    parser.add_argument("--full", action="store_true", help="the paper's sizes (default on a GPU)")
    parser.add_argument("--small", action="store_true", help="the small default sizes even on a GPU")
    parser.add_argument("--out", default="outputs/bench", help="folder for bench.json and bench.md")
    parser.add_argument("--data-dir", default=os.environ.get("FEDFEW_DATA_DIR"),
                        help="data directory holding ag_news_csv/ (default $FEDFEW_DATA_DIR)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--precision", default="32-true", help="Fabric precision of the runs (32-true | bf16-mixed)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the local step (compile=true)")
    parser.add_argument("--only", nargs="*", default=None,
                        help="sections to run: throughput reference scaling devices (default: all); with "
                             "--gpu-check: correctness speed memory precision paper")
    gpu = parser.add_argument_group("GPU readiness check (make gpu-check, scripts/gpu_check.sh, docs/speed.md)")
    gpu.add_argument("--gpu-check", action="store_true",
                     help="measure every CUDA path in a few minutes (on a machine without a GPU: the CPU smoke mode)")
    gpu.add_argument("--cifar-dir", default=None,
                     help="folder with cifar10_{train,test}_jpg.tar.gz (or train/ + test/) for the accuracy lines; "
                          "synthetic tensors without it")
    gpu.add_argument("--budget", type=float, default=None,
                     help=f"seconds for the whole check (default {CHECK_SIZES['cuda'].budget_s:.0f} on a GPU, "
                          f"{CHECK_SIZES['cpu'].budget_s:.0f} on the CPU)")
    gpu.add_argument("--started-at", type=float, default=None,
                     help="the check's start (Unix seconds; the script passes its own, so installing counts)")
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--gpu-check-run", help=argparse.SUPPRESS)
    parser.add_argument("--gpu-check-data", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.case:
        spec = json.loads(args.case)
        result = CASES[spec.get("kind", "round")](spec)
        print("BENCH_RESULT " + json.dumps(result), flush=True)
        return 0
    if args.gpu_check_run:
        code = gpu_check_run(json.loads(args.gpu_check_run))
        sys.stdout.flush()
        os._exit(code)  # every result is out: skip the interpreter's teardown (seconds with torch loaded)
    if args.gpu_check_data:
        return gpu_check_data(json.loads(args.gpu_check_data))
    if args.gpu_check:
        try:
            return gpu_check(args)
        except ValueError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
    return drive(args)


def drive(args) -> int:
    from fedfew.core.io import atomic_write_json, atomic_write_text

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


# ---------------------------------------------------------------------------------------------
# GPU readiness check: ``python -m fedfew.bench --gpu-check`` (``make gpu-check``, docs/speed.md)
# ---------------------------------------------------------------------------------------------
#
# One command measures every CUDA path in a few minutes on one GPU, starting from a bare
# machine (scripts/gpu_check.sh installs the carried wheels first), and runs the very same
# code at tiny sizes on a CPU (the smoke mode the tests run). Three processes:
#   driver  (``--gpu-check``): starts the other two, keeps the time budget, writes bench.json
#           and bench.md after every result (a timeout still leaves what was measured), kills
#           a section that overruns its deadline and restarts the runner for the sections after it;
#   data    (``--gpu-check-data``): unpacks the CIFAR-10 tarballs and decodes them into the
#           tensor cache while the first sections (synthetic data) run;
#   runner  (``--gpu-check-run``): the sections in order, one ``GPU_CHECK {json}`` line per event.

GPU_CHECK_SECTIONS = ("correctness", "speed", "memory", "precision", "paper")
#: targets of the issue (the vmap and projection ones are TARGET_VMAP_GPU, TARGET_PROJECTION_S)
TARGET_MEMORY_RATIO = 1.2
CORRECTNESS_ATOL = 1e-4
PAPER_ROUNDS = 2000
#: the paper's CIFAR-10 setting (besides M=20, K=3, E=1 and the dataset's lr 0.005, batch 50)
PAPER_OVERRIDES = ("partition=dirichlet", "partition.alpha=0.5")
_EVENT = "GPU_CHECK "


@dataclass(frozen=True)
class CheckSizes:
    """Sizes and time caps of one gpu-check mode: ``cuda`` (the issue's sizes) or ``cpu``
    (the smoke mode: the same code paths at tiny sizes, under a minute).

    Attributes:
        budget_s: the whole check's wall time at most (from the script's start), seconds.
        engine_clients: the vmap engine's ``engine_clients`` in every section but the
            memory one: ``auto`` on a GPU; a small number on the CPU, where ``auto`` trains one
            client at a time and would leave the multi-client chunks untested.
        correctness_M, correctness_image_sizes, correctness_text_sizes: clients and samples
            per client (cycled; unequal, so chunks pad with zero-weight rows) of the loop-vs-vmap check.
        text_length: tokens per text in the correctness check (fixed-length synthetic batches).
        text_vocab: vocabulary of the synthetic texts (AG News's 23,868 on a GPU; small on the
            CPU, where the dense word-vector update would dominate).
        speed_M: clients of the speed section (the issue's M=20 on a GPU).
        speed_pool: CIFAR-10-shaped samples split evenly among the speed clients (60,000 = the
            whole CIFAR-10: 2,250 train samples per client at M=20).
        speed_warmup: clients in the warm-up round before each timed round.
        text_per_client: synthetic AG-News-like texts per client (TextCNN speed).
        memory_pool: CIFAR-10-shaped samples split among the M clients of the memory section.
        memory_points: (M, K, engine_clients) of the memory section: the first five share
            one chunk width (so M and K act alone; the first point is the reference), the last
            uses ``auto``.
        cifar_pool: samples of the synthetic stand-in when the real CIFAR-10 is absent.
        cifar_per_class: (train, test) images per class to unpack (None: both tarballs whole;
            a subset is taken from the small test tarball alone, see :func:`unpack_cifar`).
        peak_size, peak_seconds: the square matmul of the FLOP/s peaks (None: 8192 on a GPU).
        threads: torch threads of the check's processes (None: torch's default; 1 in the
            smoke mode, which shares its cores with the data process).
        precision_M, precision_rounds: the bf16-mixed vs fp32 runs.
        paper_M, paper_seconds, paper_eval_every: the paper's run (rounds until the seconds
            are spent, evaluation every so many rounds).
        caps: seconds per section at most. keep: seconds kept back for each later section.
        grace_s: how long past its deadline a section may run before the driver kills it.
    """

    mode: str
    budget_s: float
    engine_clients: str
    correctness_M: int
    correctness_image_sizes: tuple[int, ...]
    correctness_text_sizes: tuple[int, ...]
    text_length: int
    text_vocab: int
    speed_M: int
    speed_pool: int
    speed_warmup: int
    text_per_client: int
    memory_pool: int
    memory_points: tuple[tuple[int, int, str], ...]
    cifar_pool: int
    cifar_per_class: tuple[int, int] | None
    precision_M: int
    precision_rounds: int
    paper_M: int
    paper_seconds: float
    paper_eval_every: int
    peak_size: int | None
    peak_seconds: float
    threads: int | None
    caps: dict
    keep: dict
    grace_s: float


CHECK_SIZES = {
    "cuda": CheckSizes(
        mode="cuda", budget_s=420.0, engine_clients="auto",
        correctness_M=8, correctness_image_sizes=(150, 97, 120, 64), correctness_text_sizes=(260, 130, 201, 90),
        text_length=64, text_vocab=23_868, speed_M=20, speed_pool=CIFAR_POOL, speed_warmup=20, text_per_client=2000,
        memory_pool=CIFAR_POOL,
        memory_points=((20, 3, "20"), (100, 3, "20"), (1000, 3, "20"), (20, 1, "20"), (20, 10, "20"), (1000, 3, "auto")),
        cifar_pool=CIFAR_POOL, cifar_per_class=None, precision_M=20, precision_rounds=20,
        paper_M=20, paper_seconds=180.0, paper_eval_every=10, peak_size=None, peak_seconds=1.0, threads=None,
        caps={"correctness": 60, "speed": 150, "memory": 90, "precision": 90, "paper": 230},
        keep={"correctness": 15, "speed": 40, "memory": 20, "precision": 30, "paper": 60},
        grace_s=45.0,
    ),
    "cpu": CheckSizes(
        mode="cpu", budget_s=300.0, engine_clients="3",
        correctness_M=4, correctness_image_sizes=(75, 40, 30, 20), correctness_text_sizes=(140, 60, 40, 30),
        text_length=32, text_vocab=2000, speed_M=4, speed_pool=4 * 20, speed_warmup=2, text_per_client=20,
        memory_pool=160,
        memory_points=((4, 3, "2"), (8, 3, "2"), (16, 3, "2"), (4, 1, "2"), (4, 5, "2"), (16, 3, "auto")),
        cifar_pool=160, cifar_per_class=(12, 4), precision_M=4, precision_rounds=2,
        paper_M=4, paper_seconds=1.0, paper_eval_every=2, peak_size=512, peak_seconds=0.2, threads=1,
        # generous: a safety net against hangs on a slow shared machine (a normal run takes < 60 s)
        caps={"correctness": 120, "speed": 120, "memory": 120, "precision": 120, "paper": 60},
        keep={"correctness": 10, "speed": 10, "memory": 10, "precision": 10, "paper": 10},
        grace_s=60.0,
    ),
}


def resolve_device(choice: str) -> str:
    """``auto`` | ``cpu`` | ``cuda`` -> the device the check runs on.

    Raises:
        ValueError: ``cuda`` asked for but torch sees no CUDA device.
    """
    import torch

    device = detect_device(choice)
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: torch sees no CUDA device (torch.cuda.is_available() is False); "
                         "use --device auto or cpu for the CPU smoke mode")
    return device


def _set_threads(sizes: "CheckSizes") -> None:
    if sizes.threads:
        import torch

        torch.set_num_threads(sizes.threads)


def _emit(section: str, event: str, **fields: Any) -> None:
    """One protocol line for the driver: ``GPU_CHECK {"section", "event", ...}``."""
    from fedfew.core.io import to_jsonable

    print(_EVENT + json.dumps(to_jsonable({"section": section, "event": event, **fields})), flush=True)


@contextlib.contextmanager
def exact_fp32():
    """Plain float32 matmuls and convolutions on CUDA inside the block (TF32 off; torch
    enables TF32 for cuDNN convolutions by default), restored afterwards."""
    import warnings

    import torch

    with warnings.catch_warnings():  # the flags are deprecated (not removed) in favour of fp32_precision
        warnings.simplefilter("ignore")
        saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


class PeakRss:
    """Peak resident memory (MiB) of this process while the block runs, sampled every
    ``interval`` seconds from ``/proc/self/statm`` (``ru_maxrss`` only grows over a process's
    life, so it cannot tell one case from the next). ``peak_mb`` is None where /proc is absent."""

    def __init__(self, interval: float = 0.005) -> None:
        import threading

        self.interval = interval
        self.peak_mb: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fedfew-peak-rss", daemon=True)
        self._page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

    def _sample(self) -> None:
        try:
            with open("/proc/self/statm") as fh:
                mb = int(fh.read().split()[1]) * self._page / 2**20
        except (OSError, ValueError, IndexError):
            return
        self.peak_mb = mb if self.peak_mb is None else max(self.peak_mb, mb)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.interval)

    def __enter__(self) -> "PeakRss":
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()


def machine_info(device) -> dict:
    """Device, versions and numeric settings of this process (the runner's first event)."""
    import platform

    import torch

    info: dict[str, Any] = {
        "device": device.type, "torch": torch.__version__, "python": platform.python_version(),
        "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "load_average_start": load_average(),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }
    try:
        import lightning

        info["lightning"] = lightning.__version__
    except ImportError:
        pass
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, gpu_memory_gib=props.total_memory / 2**30, capability=f"{props.major}.{props.minor}",
                    multiprocessors=props.multi_processor_count, cuda=torch.version.cuda,
                    cudnn=torch.backends.cudnn.version(), tf32_matmul=bool(torch.backends.cuda.matmul.allow_tf32),
                    tf32_cudnn=bool(torch.backends.cudnn.allow_tf32))
    return info


def unpack_cifar(src: Path, dest: Path, per_class: tuple[int, int] | None) -> dict:
    """CIFAR-10 as the ImageFolder tree ``dest/{train,test}/<class>/*.jpg`` that the loader reads.

    Args:
        src: a folder holding ``cifar10_train_jpg.tar.gz`` and ``cifar10_test_jpg.tar.gz``
            (the shared data's layout), or an unpacked ``train/`` + ``test/`` tree.
        dest: the ``cifar10`` folder of a fresh data directory.
        per_class: None: everything. (a, b): a small subset for the smoke mode, read from the
            official test images alone (the small tarball; the train tarball, grouped by class,
            would have to be read whole): per class, the first ``a`` become ``train/``, the
            next ``b`` ``test/``.
    Returns:
        {"train": n, "test": n} images written.
    Raises:
        FileNotFoundError: neither layout in ``src``.
    """
    import shutil
    import tarfile

    counts = {"train": 0, "test": 0}
    seen: dict[str, int] = {}

    def target(split: str, cls: str) -> str | None:
        """Where a ``split``/``cls`` image goes (train/test), or None to skip it."""
        if per_class is None:
            return split if split in ("train", "test") else None
        if split != "test":
            return None
        n = seen.get(cls, 0)
        seen[cls] = n + 1
        return "train" if n < per_class[0] else "test" if n < per_class[0] + per_class[1] else None

    tars = {split: src / f"cifar10_{split}_jpg.tar.gz" for split in ("train", "test")}
    if all(t.is_file() for t in tars.values()):
        dest.mkdir(parents=True, exist_ok=True)
        kwargs = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        for split in (("test",) if per_class else ("train", "test")):
            with tarfile.open(tars[split], mode="r|gz") as tar:  # one sequential pass
                for member in tar:
                    parts = member.name.split("/")
                    where = target(parts[-3], parts[-2]) if member.isfile() and len(parts) >= 3 else None
                    if where is None:
                        continue
                    member.name = f"{where}/{parts[-2]}/{parts[-1]}"
                    tar.extract(member, dest, **kwargs)
                    counts[where] += 1
        return counts
    if (src / "train").is_dir() and (src / "test").is_dir():
        for split in (("test",) if per_class else ("train", "test")):
            for folder in sorted(p for p in (src / split).iterdir() if p.is_dir()):
                for f in sorted(folder.iterdir()):
                    where = target(split, folder.name) if f.is_file() else None
                    if where is not None:
                        out = dest / where / folder.name / f.name
                        out.parent.mkdir(parents=True, exist_ok=True)
                        shutil.copyfile(f, out)
                        counts[where] += 1
        return counts
    raise FileNotFoundError(f"{src}: neither cifar10_train_jpg.tar.gz + cifar10_test_jpg.tar.gz nor train/ + test/ "
                            "folders; run `make gpu-data` or pass --cifar-dir <folder with the tarballs>")


def _cifar_overrides(data_dir: Path, M: int) -> list[str]:
    return ["dataset=cifar10", f"data_dir={data_dir}", "dataset.download=false", f"num_clients={M}", *PAPER_OVERRIDES]


def gpu_check_data(spec: dict) -> int:
    """The data process: unpack ``spec["cifar_dir"]`` into ``<work>/data/cifar10`` (all of it
    on a GPU, the smoke mode's subset on the CPU), decode it once into the tensor cache
    ($FEDFEW_CACHE_DIR, set by the driver), then write ``<work>/data_status.json`` (``ok``,
    counts, seconds, or ``error``) for the runner."""
    from fedfew.core.io import atomic_write_json

    work = Path(spec["work"])
    start = time.perf_counter()
    sizes = CHECK_SIZES[resolve_device(spec["device"])]
    _set_threads(sizes)
    status: dict[str, Any] = {"source": spec["cifar_dir"], "per_class": sizes.cifar_per_class}
    try:
        counts = unpack_cifar(Path(spec["cifar_dir"]), work / "data" / "cifar10", sizes.cifar_per_class)
        status["unpack_s"] = time.perf_counter() - start
        _log(f"data: unpacked {counts['train']:,} train + {counts['test']:,} test images in {status['unpack_s']:.1f} s")
        from fedfew.data.federated import build_federated_data

        decode = time.perf_counter()
        data = build_federated_data(compose(_cifar_overrides(work / "data", sizes.paper_M)))
        status.update(ok=True, images=int(len(data.targets)), decode_s=time.perf_counter() - decode, **counts)
        _log(f"data: decoded {status['images']:,} images in {status['decode_s']:.1f} s")
    except Exception as err:  # noqa: BLE001 - reported; the sections fall back to synthetic data
        status.update(ok=False, error=f"{type(err).__name__}: {err}")
    status["seconds"] = time.perf_counter() - start
    atomic_write_json(work / "data_status.json", status)
    _emit("data", "done" if status["ok"] else "error", result=status)
    return 0 if status["ok"] else 1


class CheckContext:
    """What a gpu-check section works with: the device, the mode's sizes, its deadline,
    the matmul peaks and CIFAR-10 data shared between sections, and :meth:`partial`.

    Args:
        device: ``cuda`` or ``cpu``.
        sizes: the mode's :class:`CheckSizes`.
        work: the driver's scratch folder (``data_status.json``, the unpacked data), or None.
        use_data: whether a data process was started (else synthetic data at once).
    """

    def __init__(self, device: str, sizes: CheckSizes, work: Path | None, use_data: bool) -> None:
        self.device, self.sizes, self.work, self.use_data = device, sizes, work, use_data
        self.section = ""
        self.deadline = math.inf
        self.peaks: dict[str, float] = {}
        self._cifar: dict[int, tuple[Any, str]] = {}

    def left(self) -> float:
        """Seconds left before this section's deadline."""
        return self.deadline - time.time()

    def partial(self, result: dict) -> None:
        """Report what the section has so far (written to bench.json at once)."""
        _emit(self.section, "partial", result=result)

    def spec(self, **fields: Any) -> dict:
        """A :func:`build_case_sim` / :func:`case_round` spec on this device."""
        return {"device": self.device, "compile": False, **fields}

    def vmap_overrides(self, clients: str | None = None) -> list[str]:
        """The override setting the vmap engine's clients per chunk (default: the mode's)."""
        # ++: add the key or override it (older configs lack ``engine_clients``)
        return [f"++engine_clients={clients or self.sizes.engine_clients}"]

    def measure_peaks(self) -> dict:
        """float32 and bfloat16 matmul FLOP/s of this device (once per run)."""
        if not self.peaks:
            for dtype in ("float32", "bfloat16"):
                self.peaks[dtype] = peak_matmul_flops(self.device, dtype, self.sizes.peak_size, self.sizes.peak_seconds)
        return self.peaks

    def _data_status(self) -> dict | None:
        """The data process's status, waiting for it at most until a third of this section's
        time is left (None: not ready in time)."""
        if not self.use_data or self.work is None:
            return None
        path = self.work / "data_status.json"
        waited = time.time()
        while not path.exists():
            if self.left() < self.sizes.caps[self.section] / 3:
                return {"ok": False, "error": f"not ready after waiting {time.time() - waited:.0f} s"}
            time.sleep(0.25)
        if time.time() - waited > 1:
            _log(f"waited {time.time() - waited:.0f} s for the CIFAR-10 data")
        return json.loads(path.read_text())

    def cifar(self, M: int) -> tuple[Any, str]:
        """CIFAR-10 partitioned as in the paper (Dirichlet 0.5 over M clients) and a line
        saying what it is: the real images when the data process delivered them, else
        CIFAR-10-shaped random tensors (accuracy then stays at chance; not kept when the data
        was merely late, so a later section looks again)."""
        if M not in self._cifar:
            status = self._data_status()
            if status and status.get("ok"):
                from fedfew.data.federated import build_federated_data

                data = build_federated_data(compose(_cifar_overrides(self.work / "data", M)))
                what = (f"real CIFAR-10 ({len(data.targets):,} images"
                        f"{', a subset' if self.sizes.cifar_per_class else ''}), Dirichlet 0.5 over {M} clients")
            else:
                reason = (status or {}).get("error") or "no CIFAR-10 tarballs given (make gpu-data, or --cifar-dir)"
                data = synthetic_images(self.sizes.cifar_pool, M)
                what = (f"synthetic CIFAR-10-shaped tensors ({self.sizes.cifar_pool:,} samples, random labels: "
                        f"accuracy stays at chance) because the real data is missing: {reason}")
                if status is not None and "not ready" in reason:
                    return data, what
            self._cifar[M] = (data, what)
        return self._cifar[M]


def check_correctness(ctx: CheckContext) -> dict:
    """engine=loop and engine=vmap give equal server models after 2 rounds (fp32, TF32 off)
    for the CIFAR-10 CNN and the AG News TextCNN (dropout 0: the engines' dropout masks
    differ by design; fixed-length synthetic token batches), clients of unequal sizes in
    multi-client chunks. Passes when max |theta_loop - theta_vmap| <= :data:`CORRECTNESS_ATOL`."""
    import torch

    from fedfew.core.model_set import flat_parameters

    sz = ctx.sizes
    cases = {
        "cifar10_cnn": {"dataset": "cifar10", "data": "synthetic-cifar10", "sizes": list(sz.correctness_image_sizes),
                        "overrides": []},
        "agnews_textcnn": {"dataset": "agnews", "data": "synthetic-agnews", "sizes": list(sz.correctness_text_sizes),
                           "length": sz.text_length, "vocab": min(5000, sz.text_vocab), "overrides": ["model.dropout=0"]},
    }
    out: dict[str, Any] = {"rounds": 2, "atol": CORRECTNESS_ATOL, "precision": "32-true (TF32 off)", "M": sz.correctness_M, "K": 3}
    with exact_fp32():
        for name, case in cases.items():
            models, losses, info = {}, {}, {}
            for engine in ("loop", "vmap"):
                overrides = case["overrides"] + (ctx.vmap_overrides() if engine == "vmap" else [])
                spec = ctx.spec(**{**case, "overrides": overrides}, M=sz.correctness_M, K=3, engine=engine)
                with tempfile.TemporaryDirectory() as tmp:
                    sim = build_case_sim(spec, Path(tmp))
                    logs = [sim.run_round(r) for r in (1, 2)]
                    models[engine] = torch.stack([flat_parameters(m) for m in sim.module.models]).double().cpu()
                    losses[engine] = torch.stack([torch.as_tensor(lg["loss"]) for lg in logs]).double().cpu()
                    if engine == "vmap":
                        info = {"engine_clients": sim.algorithm.engine.max_clients(),
                                "client_train_sizes": [int(n) for n in sim.num_train.tolist()],
                                "parameters_per_model": int(models[engine].shape[1])}
            diff = float((models["loop"] - models["vmap"]).abs().max())
            finite = bool(torch.isfinite(models["loop"]).all() and torch.isfinite(models["vmap"]).all())
            out[name] = {"max_abs_diff": diff, "max_abs_loss_diff": float((losses["loop"] - losses["vmap"]).abs().max()),
                         "max_abs_param": float(models["loop"].abs().max()), "finite": finite,
                         "passed": finite and diff <= CORRECTNESS_ATOL, **info}
            _log(f"correctness {name}: max |loop - vmap| = {diff:.2e} ({'pass' if out[name]['passed'] else 'FAIL'})")
            ctx.partial(out)
    return out


def profile_round(ctx: CheckContext, engine: str, clients: int = 2) -> dict:
    """torch.profiler over one round of ``clients`` clients (CIFAR-10 CNN, K=3, after a
    warm-up round): the share of the round the GPU spends in kernels, what therefore bounds
    it, and the top operators."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    device = torch.device(ctx.device)
    spec = ctx.spec(dataset="cifar10", data="synthetic-cifar10", pool=ctx.sizes.speed_pool, M=ctx.sizes.speed_M, K=3,
                    engine=engine,
                    overrides=ctx.vmap_overrides() if engine == "vmap" else [])
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with tempfile.TemporaryDirectory() as tmp:
        sim = build_case_sim(spec, Path(tmp))
        sim.cfg.clients_per_round = clients
        sim.run_round(0)
        _sync(device)
        start = time.perf_counter()
        with profile(activities=activities) as prof:
            sim.run_round(1)
            _sync(device)
        wall = time.perf_counter() - start
    events = prof.key_averages()

    def device_us(e) -> float:
        return float(getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0) or 0.0)

    cuda = device.type == "cuda"
    kernels_s = sum(device_us(e) for e in events) / 1e6
    order = sorted(events, key=(device_us if cuda else (lambda e: e.self_cpu_time_total)), reverse=True)
    top = [{"op": e.key, "calls": int(e.count), "self_cpu_ms": e.self_cpu_time_total / 1e3,
            "self_device_ms": device_us(e) / 1e3} for e in order[:8]]
    out: dict[str, Any] = {"engine": engine, "clients": clients, "wall_s": wall, "kernels_s": kernels_s if cuda else None,
                           "cpu_ops_s": sum(e.self_cpu_time_total for e in events) / 1e6, "top": top}
    if cuda:
        busy = kernels_s / wall if wall > 0 else 0.0
        out["gpu_busy"] = busy
        out["bound"] = (f"GPU kernels (busy {busy:.0%} of the profiled round; top: {top[0]['op'] if top else '?'})"
                        if busy >= 0.6 else
                        f"the CPU side: kernel launches and Python between kernels (the GPU computes only {busy:.0%} "
                        "of the profiled round)")
    else:
        out["bound"] = "CPU (no accelerator in this run)"
    return out


def check_speed(ctx: CheckContext) -> dict:
    """Sample-passes per second, loop vs vmap (multi-client chunks on), for the CIFAR-10 CNN
    (M=20, K=3, batch 50) and the AG News TextCNN (M=20, K=3, batch 100), each timed round
    after a warm-up round; useful FLOP/s of every round against the float32 and bfloat16
    matmul peaks measured here; and a torch.profiler view of both engines."""
    sz = ctx.sizes
    out: dict[str, Any] = {"M": sz.speed_M, "K": 3, "peaks": ctx.measure_peaks(),
                           "data": "synthetic (speed does not depend on the values)"}
    cases = {
        "cifar10_cnn": {"dataset": "cifar10", "data": "synthetic-cifar10", "pool": sz.speed_pool},
        "agnews_textcnn": {"dataset": "agnews", "data": "synthetic-agnews", "per_client": sz.text_per_client,
                           "vocab": sz.text_vocab},
    }
    last = 0.0
    for name, case in cases.items():
        res: dict[str, Any] = {}
        out[name] = res
        for engine in ("loop", "vmap"):
            if ctx.left() < last:
                res[engine] = {"skipped": f"out of time ({ctx.left():.0f} s left of the section)"}
                continue
            _log(f"speed {name} engine={engine}")
            begin = time.time()
            spec = ctx.spec(**case, M=sz.speed_M, K=3, engine=engine, warmup=sz.speed_warmup, pure=True, peak=False,
                            overrides=ctx.vmap_overrides() if engine == "vmap" else [])
            r = case_round(spec)
            for key in ("base_host_mb", "peak_host_mb"):  # process-wide ru_maxrss: not this case's
                r.pop(key, None)
            for dtype, peak in ctx.peaks.items():
                r[f"fraction_of_{dtype}_peak"] = r["achieved_flops"] / peak
            res[engine] = r
            last = time.time() - begin
            _log(f"  {r['sample_passes_per_s']:,.0f} sample-passes/s ({r['round_s']:.2f} s/round, "
                 f"{r['engine_clients']} client(s) per chunk)")
        if all("sample_passes_per_s" in res.get(e, {}) for e in ("loop", "vmap")):
            res["vmap_over_loop"] = res["vmap"]["sample_passes_per_s"] / res["loop"]["sample_passes_per_s"]
        ctx.partial(out)
    profiles = {}
    for engine in ("loop", "vmap"):
        if ctx.left() < 10:
            profiles[engine] = {"skipped": f"out of time ({ctx.left():.0f} s left of the section)"}
            continue
        _log(f"profile cifar10_cnn engine={engine} (2 clients)")
        profiles[engine] = profile_round(ctx, engine)
    out["profile"] = profiles
    return out


def check_memory(ctx: CheckContext) -> dict:
    """Peak device memory (host memory on the CPU, sampled) of one round of the vmap engine
    for M = 20, 100, 1,000 (K = 3) and K = 1, 3, 10 (M = 20), one pool of CIFAR-10-shaped
    samples split among the M clients; one chunk width for these points (so M and K act
    alone), plus M = 1,000 with ``engine_clients=auto``."""
    import gc

    import torch

    device = torch.device(ctx.device)
    cuda = device.type == "cuda"
    sz = ctx.sizes
    out: dict[str, Any] = {"engine": "vmap", "pool": sz.memory_pool, "measure": "device" if cuda else "host (sampled RSS)",
                           "points": []}
    last = 0.0
    for M, K, chunk in sz.memory_points:
        point: dict[str, Any] = {"M": M, "K": K, "engine_clients": chunk}
        if ctx.left() < last:
            point["skipped"] = f"out of time ({ctx.left():.0f} s left of the section)"
            out["points"].append(point)
            continue
        _log(f"memory M={M} K={K} engine_clients={chunk}")
        begin = time.time()
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device) if cuda else 0
        spec = ctx.spec(dataset="cifar10", data="synthetic-cifar10", pool=sz.memory_pool, M=M, K=K, engine="vmap",
                        overrides=ctx.vmap_overrides(chunk))
        with tempfile.TemporaryDirectory() as tmp, PeakRss() as rss:
            sim = build_case_sim(spec, Path(tmp))
            point["data_mb"] = sim.data.inputs.numel() * sim.data.inputs.element_size() / 2**20
            _sync(device)
            start = time.perf_counter()
            logs = sim.run_round(1)
            _sync(device)
            point["round_s"] = time.perf_counter() - start
            point["chunk_clients"] = sim.algorithm.engine.max_clients()
            point["loss_finite"] = bool(torch.isfinite(logs["loss"]).all())
            del sim, logs
        point["peak_host_mb"] = rss.peak_mb
        if cuda:
            point["peak_device_mb"] = (torch.cuda.max_memory_allocated(device) - base) / 2**20
            point["peak_reserved_mb"] = torch.cuda.max_memory_reserved(device) / 2**20
        out["points"].append(point)
        last = time.time() - begin
        ctx.partial(out)
    key = "peak_device_mb" if cuda else "peak_host_mb"
    M0, K0, chunk0 = sz.memory_points[0]
    fixed = {(p["M"], p["K"]): p[key] for p in out["points"] if p.get(key) and p["engine_clients"] == chunk0}
    ref = fixed.get((M0, K0))
    if ref:
        out["reference"] = {"M": M0, "K": K0}
        out["ratio_M"] = {str(M): v / ref for (M, K), v in sorted(fixed.items()) if K == K0}
        out["ratio_K"] = {str(K): v / ref for (M, K), v in sorted(fixed.items()) if M == M0}
        largest = max(M for M, K in fixed if K == K0)
        if largest > M0:  # else nothing to compare (the other points ran out of time)
            out["largest_M"] = largest
            out["ratio_largest_M"] = fixed[(largest, K0)] / ref
    return out


def train_rounds(ctx: CheckContext, data, precision: str, max_rounds: int, eval_every: int,
                 seconds: float | None = None, on_evaluation=None) -> dict:
    """FedFew on ``data`` (the paper's CIFAR-10 setting, engine=vmap) round after round until
    ``max_rounds``, ``seconds`` of rounds, or the section's deadline; personalized accuracy
    every ``eval_every`` rounds and after the last round.

    Returns:
        rounds, per-round seconds, first and steady-state (mean after the first) seconds per
        round, evaluation seconds and accuracy curve, useful FLOP/s of a steady round.
    """
    import torch

    device = torch.device(ctx.device)
    spec = ctx.spec(dataset="cifar10", M=data.num_clients, K=3, engine="vmap", precision=precision,
                    overrides=[*PAPER_OVERRIDES, f"rounds={PAPER_ROUNDS}", f"eval_every={eval_every}", *ctx.vmap_overrides()])
    round_s: list[float] = []
    evaluations: list[dict] = []
    finite = True
    with tempfile.TemporaryDirectory() as tmp:
        sim = build_case_sim(spec, Path(tmp), data=data)
        sample = sim.data.batch(sim.ctx.train_index[0][:2])[0]
        flops_sample = flops_per_sample(sim.module.working, tuple(sample.shape[1:]), sample, device, {})
        passes = int(sim.num_train.sum()) * 3 * int(sim.cfg.local_epochs)

        def evaluate(rnd: int) -> None:
            _sync(device)
            start = time.perf_counter()
            summary = sim.evaluate(rnd)["summary"]
            _sync(device)
            evaluations.append({"round": rnd, "seconds": time.perf_counter() - start, "acc_mean": summary["acc_mean"],
                                "acc_weighted": summary["acc_weighted"], "models_served": summary.get("models_served")})

        began = time.perf_counter()
        rnd = 0
        for rnd in range(1, max_rounds + 1):
            _sync(device)
            start = time.perf_counter()
            logs = sim.run_round(rnd)
            _sync(device)
            round_s.append(time.perf_counter() - start)
            finite = finite and bool(torch.isfinite(logs["loss"]).all())
            if rnd % eval_every == 0:
                evaluate(rnd)
                if on_evaluation is not None:
                    on_evaluation(_rounds_summary(round_s, evaluations, flops_sample * passes, passes, finite))
            eval_s = evaluations[-1]["seconds"] if evaluations else 0.0
            need = 2 * (round_s[-1] + eval_s) + eval_s  # one more round (and evaluation), then the final one
            if (seconds is not None and time.perf_counter() - began >= seconds) or ctx.left() < need:
                break
        if not evaluations or evaluations[-1]["round"] != rnd:
            evaluate(rnd)
    out = _rounds_summary(round_s, evaluations, flops_sample * passes, passes, finite)
    out.update(precision=precision, engine="vmap", M=data.num_clients, K=3, eval_every=eval_every,
               wall_s=time.perf_counter() - began)
    return out


def _rounds_summary(round_s: list[float], evaluations: list[dict], round_flops: float, passes: int, finite: bool) -> dict:
    steady = sum(round_s[1:]) / (len(round_s) - 1) if len(round_s) > 1 else round_s[0]
    last = evaluations[-1] if evaluations else {}
    return {"rounds": len(round_s), "round_s": round_s, "first_round_s": round_s[0], "steady_round_s": steady,
            "evaluation_s": sum(e["seconds"] for e in evaluations) / len(evaluations) if evaluations else None,
            "evaluations": evaluations, "acc_mean": last.get("acc_mean"), "acc_weighted": last.get("acc_weighted"),
            "acc_round": last.get("round"), "sample_passes_per_round": passes, "round_flops": round_flops,
            "achieved_flops": round_flops / steady if steady > 0 else None, "loss_finite": finite}


def check_precision(ctx: CheckContext) -> dict:
    """bf16-mixed against fp32 (32-true) after ``precision_rounds`` rounds of the paper's
    CIFAR-10 setting (same seed, partition and initial models): seconds per round, useful
    FLOP/s against the matching matmul peak, and personalized accuracy."""
    sz = ctx.sizes
    data, what = ctx.cifar(sz.precision_M)
    peaks = ctx.measure_peaks()
    out: dict[str, Any] = {"data": what, "rounds_planned": sz.precision_rounds}
    for precision, dtype in (("32-true", "float32"), ("bf16-mixed", "bfloat16")):
        if ctx.left() < 5:
            out[precision] = {"skipped": f"out of time ({ctx.left():.0f} s left of the section)"}
            continue
        _log(f"precision {precision}: {sz.precision_rounds} rounds")
        res = train_rounds(ctx, data, precision, sz.precision_rounds, sz.precision_rounds)
        if res.get("achieved_flops"):
            res["fraction_of_peak"] = res["achieved_flops"] / peaks[dtype]
            res["peak_dtype"] = dtype
        out[precision] = res
        _log(f"  {res['steady_round_s']:.3f} s/round, accuracy {res['acc_mean']:.3f} after {res['rounds']} round(s)")
        ctx.partial(out)
    fp32, bf16 = out.get("32-true", {}), out.get("bf16-mixed", {})
    if "steady_round_s" in fp32 and "steady_round_s" in bf16:
        out["bf16_speedup"] = fp32["steady_round_s"] / bf16["steady_round_s"]
        out["acc_diff"] = bf16["acc_mean"] - fp32["acc_mean"]
    return out


def check_paper(ctx: CheckContext) -> dict:
    """The paper's CIFAR-10 run (Dirichlet 0.5, M=20, K=3, E=1, lr 0.005, batch 50, fp32,
    engine=vmap, evaluation every 10 rounds) for as many rounds as fit in ``paper_seconds``:
    seconds per round, the projected time of all 2,000 rounds (first round + 1,999 steady
    rounds + 200 evaluations), and the accuracy reached so far."""
    sz = ctx.sizes
    data, what = ctx.cifar(sz.paper_M)
    head = {"data": what, "rounds_target": PAPER_ROUNDS, "seconds_budget": sz.paper_seconds}
    _log(f"paper run: {sz.paper_seconds:.0f} s of rounds ({what})")

    def report(res: dict) -> dict:
        evals = PAPER_ROUNDS // sz.paper_eval_every
        total = res["first_round_s"] + (PAPER_ROUNDS - 1) * res["steady_round_s"] + evals * (res["evaluation_s"] or 0.0)
        return {**head, **res, "projected_total_s": total, "projected_total_min": total / 60}

    res = train_rounds(ctx, data, "32-true", PAPER_ROUNDS, sz.paper_eval_every, seconds=sz.paper_seconds,
                       on_evaluation=lambda r: ctx.partial(report(r)))
    out = report(res)
    _log(f"  {out['rounds']} round(s), {out['steady_round_s']:.3f} s/round -> {PAPER_ROUNDS} rounds in "
         f"{out['projected_total_min']:.1f} min; accuracy {out['acc_mean']:.3f} at round {out['acc_round']}")
    return out


CHECKS = {"correctness": check_correctness, "speed": check_speed, "memory": check_memory,
          "precision": check_precision, "paper": check_paper}


def gpu_check_run(plan: dict) -> int:
    """The runner process: every section of ``plan["sections"]`` in order, each with its own
    deadline (its cap, but no later than the run's end -- ``plan["started"]`` plus the
    budget -- less the time kept for the sections after it, at most half of what is left); a
    section's exception is reported and the next one runs. Its first event names the mode (cuda | cpu) and the end."""
    import gc
    import traceback

    import torch

    mode = resolve_device(plan["device"])
    device = torch.device(mode)
    sizes = CHECK_SIZES[mode]
    _set_threads(sizes)
    budget = float(plan.get("budget") or sizes.budget_s)
    end = float(plan["started"]) + budget
    work = Path(plan["work"]) if plan.get("work") else None
    ctx = CheckContext(mode, sizes, work, bool(plan.get("use_data")))
    import fedfew.simulator.simulation  # noqa: F401 - the heavy imports (lightning) before the driver starts the data process
    _emit("machine", "done", result=machine_info(device), mode=mode, end=end, budget_s=budget)
    sections = list(plan["sections"])
    # tests of the driver's recovery: FEDFEW_GPU_CHECK_FAULT=<section>:crash ends this process there
    fault = os.environ.get("FEDFEW_GPU_CHECK_FAULT", "")
    for i, name in enumerate(sections):
        # time kept back for the later sections, but never more than half of what is left (a
        # budget too small for every section still runs the first ones: correctness first)
        keep = min(sum(sizes.keep[s] for s in sections[i + 1:]), 0.5 * max(0.0, end - time.time()))
        ctx.section = name
        ctx.deadline = min(time.time() + sizes.caps[name], end - keep)
        _emit(name, "start", deadline=ctx.deadline)
        _log(f"section {name} (at most {ctx.left():.0f} s)")
        if fault == f"{name}:crash":
            sys.stdout.flush()
            os._exit(7)
        begin = time.time()
        try:
            if ctx.left() <= 0:
                raise TimeoutError("no time left in the run's budget")
            result = CHECKS[name](ctx)
            result["section_s"] = time.time() - begin
            _emit(name, "done", result=result)
        except Exception as err:  # noqa: BLE001 - reported in bench.json; the next section still runs
            _emit(name, "error", error=f"{type(err).__name__}: {err}", traceback=traceback.format_exc()[-3000:],
                  section_s=time.time() - begin)
            if device.type == "cuda" and _poisons_cuda(err):
                _log("a CUDA error leaves this process's context unusable: exiting (the driver starts a fresh runner)")
                return 3
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    _emit("runner", "end")
    return 0


def _poisons_cuda(err: BaseException) -> bool:
    """Whether ``err`` is a CUDA error after which the process's CUDA context is unusable
    (illegal address, device-side assert, ...; not an out-of-memory error, which is recoverable)."""
    import torch

    if isinstance(err, torch.cuda.OutOfMemoryError):
        return False
    text = f"{type(err).__name__}: {err}"
    return "AcceleratorError" in text or "CUDA error" in text or "device-side assert" in text


# ---- the driver --------------------------------------------------------------------------------

def gpu_check(args) -> int:
    """``--gpu-check``: start the data process and the runner, keep the budget, write
    ``bench.json`` and ``bench.md`` into ``args.out`` after every event, print bench.md at the end.

    The driver itself imports no torch (with ``--device cuda`` it checks the GPU first):
    the runner names the mode (cuda | cpu) and the run's end in its first event.

    Returns:
        0 when every section ran and loop == vmap held; 1 when a section failed or the
        engines disagree (missed speed/memory targets are results, not failures).
    Raises:
        ValueError: ``--device cuda`` without a visible GPU, an unknown ``--only`` section, or
            a missing ``--cifar-dir``.
    """
    import queue
    import shutil
    import threading
    from collections import deque
    from datetime import datetime, timezone

    from fedfew.core.io import atomic_write_json, atomic_write_text

    started = float(args.started_at) if args.started_at else time.time()
    if args.device == "cuda":
        resolve_device("cuda")
    cifar_dir = Path(args.cifar_dir).expanduser().resolve() if args.cifar_dir else None
    if cifar_dir is not None and not cifar_dir.is_dir():
        raise ValueError(f"--cifar-dir {cifar_dir}: no such folder (make gpu-data copies the CIFAR-10 tarballs "
                         "into .gpu_data/cifar10)")
    sections = list(args.only or GPU_CHECK_SECTIONS)
    unknown = sorted(set(sections) - set(GPU_CHECK_SECTIONS))
    if unknown:
        raise ValueError(f"--only {' '.join(unknown)}: unknown section(s); choose from {', '.join(GPU_CHECK_SECTIONS)}")
    out_dir = Path(args.out)
    report: dict[str, Any] = {
        "kind": "gpu-check", "mode": None, "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "budget_s": args.budget, "machine": {},
        "data": {"source": str(cifar_dir), "status": "pending"} if cifar_dir else
                {"source": None, "status": "none: no CIFAR-10 tarballs given (make gpu-data, or --cifar-dir)"},
        "sections": {name: {"status": "pending"} for name in sections},
    }
    _log(f"gpu-check: writing {out_dir / 'bench.json'} and bench.md as results arrive")

    def write() -> None:
        report["wall_s"] = time.time() - started
        report["targets"] = gpu_check_targets(report)
        atomic_write_json(out_dir / "bench.json", report)
        atomic_write_text(out_dir / "bench.md", render_gpu_check(report))

    write()
    work = Path(tempfile.mkdtemp(prefix="fedfew-gpu-check-"))
    env = dict(os.environ, PYTHONUNBUFFERED="1", FEDFEW_CACHE_DIR=str(work / "cache"), FEDFEW_OFFLINE="1")
    env.setdefault("PYTHONWARNINGS", "ignore")
    lines: queue.Queue = queue.Queue()
    procs: dict[str, subprocess.Popen] = {}
    tails = {"runner": deque(maxlen=60), "data": deque(maxlen=30)}
    remaining = list(sections)
    # end: the run's end (from the runner; until then the largest budget); grace: past a deadline
    state: dict[str, Any] = {"current": None, "deadline": None, "finished": False, "device": args.device,
                             "end": started + float(args.budget or max(s.budget_s for s in CHECK_SIZES.values())),
                             "grace": max(s.grace_s for s in CHECK_SIZES.values()), "data_stopped": False}

    def spawn(name: str, flag: str, spec: dict) -> None:
        proc = subprocess.Popen([sys.executable, "-m", "fedfew.bench", flag, json.dumps(spec)], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env=env, bufsize=1)

        def pump() -> None:
            for line in proc.stdout:
                lines.put((name, line.rstrip("\n")))
            lines.put((name, None))

        threading.Thread(target=pump, name=f"gpu-check-{name}", daemon=True).start()
        procs[name] = proc

    def start_runner() -> None:
        state.update(finished=False, began_section=False)
        spawn("runner", "--gpu-check-run", {"device": state["device"], "sections": remaining, "started": started,
                                            "budget": args.budget, "work": str(work), "use_data": cifar_dir is not None})

    def fail_current(message: str) -> None:
        name = state["current"]
        report["sections"][name] = {"status": "error", "error": message, "output_tail": list(tails["runner"])[-25:]}
        remaining.remove(name)
        state["current"] = None

    def handle(event: dict) -> None:
        section, kind = event.pop("section"), event.pop("event")
        if section == "machine":
            report["machine"].update(event.get("result", {}))
            report.update(mode=event["mode"], smoke=event["mode"] != "cuda", budget_s=event["budget_s"],
                          sizes={k: v for k, v in CHECK_SIZES[event["mode"]].__dict__.items() if k not in ("caps", "keep")})
            state.update(device=event["mode"], end=float(event["end"]), grace=CHECK_SIZES[event["mode"]].grace_s)
            _log(f"mode: {'CUDA' if event['mode'] == 'cuda' else 'CPU smoke mode (no GPU): the same code paths at tiny sizes'}"
                 f"; budget {event['budget_s']:.0f} s, until {time.strftime('%H:%M:%S', time.localtime(state['end']))}")
            if cifar_dir is not None and "data" not in procs and report["data"]["status"] == "pending":
                # once the runner has its imports: the two processes do not compete for a small CPU's cores
                spawn("data", "--gpu-check-data", {"cifar_dir": str(cifar_dir), "work": str(work), "device": event["mode"]})
        elif section == "data":
            report["data"].update(event.get("result", {}), status="ready" if kind == "done" else "failed")
        elif section == "runner":
            state["finished"] = True
        elif kind == "start":
            state.update(current=section, deadline=float(event["deadline"]), began_section=True)
            report["sections"][section] = {"status": "running"}
        elif kind == "partial":
            report["sections"][section] = {"status": "partial", **event.get("result", {})}
        elif kind in ("done", "error"):
            body = event.get("result", {}) if kind == "done" else event
            report["sections"][section] = {"status": kind, **body}
            if section in remaining:
                remaining.remove(section)
            state["current"] = None
        write()

    start_runner()
    try:
        while procs:
            try:
                source, line = lines.get(timeout=0.5)
            except queue.Empty:
                source, line = None, None
            if source is not None and line is None:  # a process closed its output
                code = procs.pop(source).wait()
                if source == "data" and report["data"].get("status") == "pending":
                    error = ("stopped: every section had finished" if state["data_stopped"]
                             else f"the data process exited with code {code}")
                    report["data"].update(status="failed", error=error, output_tail=list(tails["data"])[-15:])
                    atomic_write_json(work / "data_status.json", {"ok": False, "error": error})
                    write()
                if source == "runner" and not state["finished"]:
                    if state["current"] is not None:
                        fail_current(f"the runner process exited with code {code} during this section")
                        write()
                    if not state["began_section"]:  # it fails before any work: a restart would too
                        for name in list(remaining):
                            report["sections"][name] = {
                                "status": "error", "output_tail": list(tails["runner"])[-25:],
                                "error": f"the runner process exited with code {code} before its first section"}
                            remaining.remove(name)
                        write()
                    elif remaining and time.time() < state["end"] - 10:
                        _log(f"restarting the runner for: {' '.join(remaining)}")
                        start_runner()
                if "runner" not in procs and "data" in procs:
                    state["data_stopped"] = True
                    procs["data"].kill()  # nothing needs the data any more
            elif line is not None:
                if line.startswith(_EVENT):
                    handle(json.loads(line[len(_EVENT):]))
                else:
                    tails[source].append(line)
                    print(line if line.startswith("[bench ") else f"  [{source}] {line}", flush=True)
            now = time.time()
            if state["current"] is not None and now > state["deadline"] + state["grace"] and "runner" in procs:
                fail_current(f"still running {state['grace']:.0f} s after its deadline: killed")
                procs["runner"].kill()
                write()
            if now > state["end"] + state["grace"]:
                if state["current"] is not None:
                    fail_current("the run's time budget ran out: killed")
                break
    finally:
        for proc in procs.values():
            proc.kill()
        shutil.rmtree(work, ignore_errors=True)
    for name in remaining:
        if report["sections"][name].get("status") in ("pending", "running", "partial"):
            report["sections"][name]["note"] = "not finished: the run's time budget ran out"
            if report["sections"][name]["status"] == "pending":
                report["sections"][name]["status"] = "not run"
    report["machine"]["load_average_end"] = load_average()
    write()
    _log(f"wrote {out_dir / 'bench.json'} and {out_dir / 'bench.md'} ({report['wall_s']:.0f} s)")
    print(render_gpu_check(report), flush=True)
    errors = [n for n, s in report["sections"].items() if s.get("status") != "done"]
    disagree = [t["name"] for t in report["targets"] if t["name"].startswith("correctness") and t["passed"] is False]
    return 1 if errors or disagree or report["mode"] is None else 0


def gpu_check_targets(report: dict) -> list[dict]:
    """The issue's targets against what was measured so far: one row each with the value,
    ``passed`` (True/False; None when unmeasured or, for a GPU target, in the CPU smoke
    mode) and, where a GPU target is missed, what the profile says bounds it."""
    on_gpu = report.get("mode") == "cuda"
    sec = report.get("sections", {})
    rows: list[dict] = []
    profile = sec.get("speed", {}).get("profile", {})

    def add(name: str, target: str, value: Any, ok: bool | None, shown: str, gpu_only: bool = True,
            bound_engine: str | None = None) -> None:
        passed = ok if (on_gpu or not gpu_only) else None
        row = {"name": name, "target": target, "value": value, "shown": shown, "passed": passed,
               "measured_passed": ok, "gpu_target": gpu_only}
        if passed is False and bound_engine and "bound" in profile.get(bound_engine, {}):
            row["bound"] = profile[bound_engine]["bound"]
        rows.append(row)

    corr = sec.get("correctness", {})
    for model in ("cifar10_cnn", "agnews_textcnn"):
        r = corr.get(model, {})
        add(f"correctness {model}", f"{model}: engine=loop == engine=vmap after 2 rounds (max |diff| <= "
            f"{CORRECTNESS_ATOL:g}, fp32)",
            r.get("max_abs_diff"), r.get("passed"), _f(r.get("max_abs_diff"), "{:.1e}"), gpu_only=False)
    ratio = sec.get("speed", {}).get("cifar10_cnn", {}).get("vmap_over_loop")
    add("vmap speed-up", f"vmap >= {TARGET_VMAP_GPU:.0f}x loop, CIFAR-10 CNN at M=20, K=3 (GPU)", ratio,
        None if ratio is None else ratio >= TARGET_VMAP_GPU, _f(ratio, "{:.2f}x"), bound_engine="vmap")
    paper = sec.get("paper", {})
    total = paper.get("projected_total_s")
    add("paper run projection", f"2,000 rounds of the paper's CIFAR-10 run in < {TARGET_PROJECTION_S / 60:.0f} min (GPU)",
        total, None if total is None else total < TARGET_PROJECTION_S, _f(None if total is None else total / 60, "{:.1f} min"),
        bound_engine="vmap")
    mem = sec.get("memory", {})
    ratio_m = mem.get("ratio_largest_M")
    largest = mem.get("largest_M")
    ref = mem.get("reference", {})
    add("memory vs M", f"peak GPU memory at M=1,000 within {TARGET_MEMORY_RATIO}x of M=20 (K=3, GPU)", ratio_m,
        None if ratio_m is None else ratio_m <= TARGET_MEMORY_RATIO,
        _f(ratio_m, "{:.2f}x") + (f" (M={largest} / M={ref.get('M')})" if largest and largest != 1000 else ""))
    return rows


def render_gpu_check(report: dict) -> str:
    """bench.md of a gpu-check: the mode, one line per measurement, the targets, details."""
    m, sec = report.get("machine", {}), report.get("sections", {})
    cuda = report.get("mode") == "cuda"
    lines = ["# fedfew gpu-check", ""]
    if report.get("mode") is None:
        lines.append("**Mode: not known yet** (the runner has not started; see the sections below).")
    elif cuda:
        lines.append(f"**Mode: CUDA** on {m.get('gpu', '?')} ({_f(m.get('gpu_memory_gib'), '{:.0f}')} GiB, "
                     f"capability {m.get('capability', '?')}), {report.get('date')}.")
    else:
        lines.append("**Mode: CPU smoke mode** (no GPU visible): the same code paths at tiny sizes, to keep the "
                     "script working. None of these figures says anything about GPU speed; the targets are for a GPU.")
    lines += [
        "",
        f"torch {m.get('torch', '?')}" + (f" (CUDA {m.get('cuda')}, cuDNN {m.get('cudnn')}, TF32 matmul "
                                           f"{m.get('tf32_matmul')}, TF32 cuDNN {m.get('tf32_cudnn')})" if cuda else "")
        + f", lightning {m.get('lightning', '?')}, Python {m.get('python', '?')}, {m.get('cpu_count', '?')} CPU cores; "
        f"date {report.get('date')}; wall time {_f(report.get('wall_s'), '{:.0f}')} s of a "
        f"{_f(report.get('budget_s'), '{:.0f}')} s budget.",
        "",
        f"CIFAR-10 data: {_data_line(report.get('data', {}))}",
        "",
        "## Results",
        "",
    ]
    lines += [f"- {line}" for line in _result_lines(report)]
    lines += ["", "## Targets", "", "| target | measured | result |", "|---|---|---|"]
    for t in report.get("targets", []):
        if t["passed"] is None:
            verdict = ("not measured" if t["measured_passed"] is None
                       else f"n/a in the CPU smoke mode (would {'pass' if t['measured_passed'] else 'fail'})")
        else:
            verdict = "**pass**" if t["passed"] else "**MISSED**" + (f": bound by {t['bound']}" if t.get("bound") else "")
        lines.append(f"| {t['target']} | {t['shown']} | {verdict} |")
    lines += [""]
    lines += _detail_lines(sec)
    errors = {n: s for n, s in sec.items() if s.get("status") in ("error", "not run")}
    if errors:
        lines += ["## Sections that did not finish", ""]
        for name, s in errors.items():
            lines.append(f"- {name}: {s.get('status')}: {s.get('error') or s.get('note', '')}")
        lines.append("")
    return "\n".join(lines) + "\n"


def _data_line(data: dict) -> str:
    if data.get("status") == "ready":
        per = data.get("per_class")
        return (f"{data.get('images', 0):,} real images from {data.get('source')}"
                f"{f' (a subset: {per[0]} train + {per[1]} test per class)' if per else ''}, unpacked in "
                f"{_f(data.get('unpack_s'), '{:.1f}')} s and decoded in {_f(data.get('decode_s'), '{:.1f}')} s; "
                "the speed, correctness and memory lines use synthetic tensors of the same shapes.")
    if data.get("status") == "failed":
        return f"not available ({data.get('error')}); synthetic CIFAR-10-shaped tensors are used everywhere."
    if data.get("status") == "pending":
        return "being prepared."
    return str(data.get("status"))


def _status_note(s: dict) -> str:
    status = s.get("status", "pending")
    if status == "done":
        return ""
    if status == "error":
        return f" (**error**: {s.get('error', '')[-300:]})"
    return f" ({status}{': ' + s['note'] if s.get('note') else ''})"


def _result_lines(report: dict) -> list[str]:
    sec = report.get("sections", {})
    cuda = report.get("mode") == "cuda"
    out: list[str] = []
    corr = sec.get("correctness", {})
    if corr.get("status") not in (None, "pending"):
        parts = [f"{label} max |diff| {_f(corr.get(model, {}).get('max_abs_diff'), '{:.1e}')}"
                 f" ({'pass' if corr.get(model, {}).get('passed') else 'FAIL' if model in corr else 'n/a'})"
                 for model, label in (("cifar10_cnn", "CIFAR-10 CNN"), ("agnews_textcnn", "AG News TextCNN"))]
        chunk = corr.get("cifar10_cnn", {}).get("engine_clients")
        out.append(f"**Correctness** (engine=loop vs engine=vmap, server models after 2 rounds, fp32 with TF32 off, "
                   f"M={corr.get('M')}, K=3, clients of unequal sizes, vmap chunks of {chunk} clients): "
                   + "; ".join(parts) + f"; tolerance {CORRECTNESS_ATOL:g}." + _status_note(corr))
    speed = sec.get("speed", {})
    if speed.get("status") not in (None, "pending"):
        parts = []
        for model, label in (("cifar10_cnn", "CIFAR-10 CNN (batch 50)"), ("agnews_textcnn", "AG News TextCNN (batch 100)")):
            r = speed.get(model, {})
            lo, vm = r.get("loop", {}), r.get("vmap", {})
            parts.append(f"{label}: loop {_f(lo.get('sample_passes_per_s'), '{:,.0f}')}, vmap "
                         f"{_f(vm.get('sample_passes_per_s'), '{:,.0f}')} sample-passes/s "
                         f"(chunks of {vm.get('engine_clients', '?')} clients) = **{_f(r.get('vmap_over_loop'), '{:.2f}x')}**")
        out.append(f"**Engine speed** (M={speed.get('M')}, K=3, one round after a warm-up round, synthetic data): "
                   + "; ".join(parts)
                   + "." + _status_note(speed))
    prec = sec.get("precision", {})
    if prec.get("status") not in (None, "pending"):
        fp32, bf16 = prec.get("32-true", {}), prec.get("bf16-mixed", {})

        def run(r: dict) -> str:
            if "steady_round_s" not in r:
                return r.get("skipped", "not run")
            return (f"{r['steady_round_s']:.3f} s/round, accuracy {_f(r.get('acc_mean'), '{:.3f}')} after "
                    f"{r['rounds']} round(s)")
        out.append(f"**Precision** (CIFAR-10, M={fp32.get('M', '?')}, K=3, vmap, {prec.get('rounds_planned')} rounds; "
                   f"{prec.get('data', '')}): fp32 {run(fp32)}; bf16-mixed {run(bf16)}; bf16 is "
                   f"**{_f(prec.get('bf16_speedup'), '{:.2f}x')}** as fast, accuracy difference "
                   f"{_f(prec.get('acc_diff'), '{:+.3f}')}." + _status_note(prec))
    paper = sec.get("paper", {})
    if paper.get("status") not in (None, "pending") and "rounds" in paper:
        out.append(f"**The paper's run** (CIFAR-10, Dirichlet 0.5, M={paper.get('M')}, K=3, E=1, lr 0.005, batch 50, "
                   f"fp32, vmap; {paper.get('data', '')}): {paper['rounds']} round(s) in {_f(paper.get('wall_s'), '{:.0f}')} s, "
                   f"{paper['steady_round_s']:.3f} s/round (first {paper['first_round_s']:.2f} s) + evaluation "
                   f"{_f(paper.get('evaluation_s'), '{:.2f}')} s every {paper.get('eval_every')} rounds -> 2,000 rounds "
                   f"projected at **{_f(paper.get('projected_total_min'), '{:.1f}')} min**; personalized accuracy "
                   f"{_f(paper.get('acc_mean'), '{:.3f}')} at round {paper.get('acc_round')}." + _status_note(paper))
    elif paper.get("status") not in (None, "pending"):
        out.append("**The paper's run**: no round finished." + _status_note(paper))
    mem = sec.get("memory", {})
    if mem.get("status") not in (None, "pending"):
        key = "peak_device_mb" if cuda else "peak_host_mb"
        pts = mem.get("points", [])
        fixed = [p for p in pts if p.get("engine_clients") != "auto"]
        auto = [p for p in pts if p.get("engine_clients") == "auto"]
        ref = mem.get("reference") or {"M": 20, "K": 3}
        by_m = ", ".join(f"M={p['M']:,}: {_mb(p.get(key))}" for p in fixed if p["K"] == ref["K"])
        by_k = ", ".join(f"K={p['K']}: {_mb(p.get(key))}" for p in fixed if p["M"] == ref["M"])
        extra = "; ".join(f"M={p['M']} with engine_clients=auto ({p.get('chunk_clients', '?')} clients per chunk): "
                          f"{_mb(p.get(key))}" for p in auto)
        chunk = fixed[0]["engine_clients"] if fixed else "?"
        data_mb = next((p.get("data_mb") for p in pts if p.get("data_mb")), None)
        out.append(f"**Memory** (peak {'GPU' if cuda else 'host (sampled RSS)'} memory of one vmap round, chunks of "
                   f"{chunk} clients, {mem.get('pool', 0):,} samples split among the clients = {_mb(data_mb)} of data): "
                   f"{by_m} (M={_f(mem.get('largest_M'), '{:,}')}/M={ref['M']}: **{_f(mem.get('ratio_largest_M'), '{:.2f}x')}**); "
                   f"{by_k}"
                   + (f"; {extra}" if extra else "") + "." + _status_note(mem))
    peaks = speed.get("peaks", {})
    vm = speed.get("cifar10_cnn", {}).get("vmap", {})
    bf16 = prec.get("bf16-mixed", {})
    if peaks:
        out.append(f"**Utilisation**: matmul peaks measured in this run: fp32 {_f(peaks.get('float32', 0) / 1e12, '{:.1f}')} "
                   f"TFLOP/s, bf16 {_f(peaks.get('bfloat16', 0) / 1e12, '{:.1f}')} TFLOP/s; CIFAR-10 CNN vmap round (fp32) "
                   f"achieves {_f(vm.get('achieved_flops', 0) / 1e12, '{:.2f}')} TFLOP/s = "
                   f"{_f(vm.get('fraction_of_float32_peak'), '{:.1%}')} of the fp32 peak, "
                   f"{_f(vm.get('fraction_of_bfloat16_peak'), '{:.1%}')} of the bf16 peak; bf16-mixed training round "
                   f"{_f((bf16.get('achieved_flops') or 0) / 1e12, '{:.2f}')} TFLOP/s = "
                   f"{_f(bf16.get('fraction_of_peak'), '{:.1%}')} of the bf16 peak (useful FLOPs counted with "
                   "FlopCounterMode).")
    return out


def _detail_lines(sec: dict) -> list[str]:
    lines: list[str] = []
    speed = sec.get("speed", {})
    if any(k in speed for k in ("cifar10_cnn", "agnews_textcnn")):
        lines += ["## Engine speed (details)", "",
                  "| model | engine | clients per chunk | sample-passes | round s | sample-passes/s | pure fwd/bwd s | "
                  "overhead | TFLOP/s | of fp32 peak | of bf16 peak | peak device |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for model in ("cifar10_cnn", "agnews_textcnn"):
            for engine in ("loop", "vmap"):
                r = speed.get(model, {}).get(engine)
                if not r:
                    continue
                if "round_s" not in r:
                    lines.append(f"| {model} | {engine} | {r.get('skipped') or r.get('error', '')} |")
                    continue
                lines.append(f"| {model} | {engine} | {r.get('engine_clients')} | {r['sample_passes']:,} | {r['round_s']:.3f} | "
                             f"{r['sample_passes_per_s']:,.0f} | {_f(r.get('pure_fwd_bwd_s'), '{:.3f}')} | "
                             f"{_f(r.get('overhead'), '{:+.0%}')} | {_f(r.get('achieved_flops', 0) / 1e12, '{:.3f}')} | "
                             f"{_f(r.get('fraction_of_float32_peak'), '{:.1%}')} | {_f(r.get('fraction_of_bfloat16_peak'), '{:.1%}')} | "
                             f"{_mb(r.get('peak_device_mb'))} |")
        lines.append("")
    prof = speed.get("profile", {})
    if prof:
        lines += ["## Where a round's time goes (torch.profiler, CIFAR-10 CNN, 2 clients, K=3)", ""]
        for engine, p in prof.items():
            if "wall_s" not in p:
                lines.append(f"- {engine}: {p.get('skipped', '')}")
                continue
            top = ", ".join(f"{t['op']} {t['self_device_ms'] if p.get('kernels_s') is not None else t['self_cpu_ms']:.1f} ms"
                            for t in p["top"][:5])
            lines.append(f"- {engine}: {p['wall_s']:.3f} s under the profiler, kernels {_f(p.get('kernels_s'), '{:.3f}')} s; "
                         f"bound by {p['bound']}; top: {top}")
        lines.append("")
    mem = sec.get("memory", {})
    if mem.get("points"):
        lines += ["## Memory (details)", "", "| M | K | engine_clients | clients per chunk | round s | data | peak device | "
                  "peak reserved | peak host (sampled) |", "|---|---|---|---|---|---|---|---|---|"]
        for p in mem["points"]:
            if "round_s" not in p:
                lines.append(f"| {p['M']} | {p['K']} | {p['engine_clients']} | {p.get('skipped', '')} |")
                continue
            lines.append(f"| {p['M']:,} | {p['K']} | {p['engine_clients']} | {p.get('chunk_clients')} | {p['round_s']:.2f} | "
                         f"{_mb(p.get('data_mb'))} | {_mb(p.get('peak_device_mb'))} | {_mb(p.get('peak_reserved_mb'))} | "
                         f"{_mb(p.get('peak_host_mb'))} |")
        lines.append("")
    paper = sec.get("paper", {})
    if paper.get("evaluations"):
        curve = ", ".join(f"{e['round']}: {e['acc_mean']:.3f}" for e in paper["evaluations"])
        lines += ["## The paper's run: personalized accuracy (client mean) by round", "", curve, ""]
    return lines


if __name__ == "__main__":
    sys.exit(main())
