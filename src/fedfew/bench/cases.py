"""One bench case: the :class:`~fedfew.simulator.simulation.Simulation` of a spec and its timed round
(or the reference's training step), run in a fresh interpreter (:func:`run_case`,
``python -m fedfew.bench --case {json}``), so each reports its own peak host and device memory."""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from fedfew.bench.common import _sync
from fedfew.core.resources import peak_host_mib
from fedfew.bench.measure import Recorder, peak_matmul_flops, replay_pure
from fedfew.bench.synthetic import synthetic_images, synthetic_texts
from fedfew.config.compose import compose


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
    base_rss = peak_host_mib()
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
    out["peak_host_mb"] = peak_host_mib()
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
