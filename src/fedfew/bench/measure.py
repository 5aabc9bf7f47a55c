"""What a bench round is measured against: the machine's matmul peak, useful FLOPs per sample, and
the pure forward/backward replay of the batches a round consumed (its overhead)."""
from __future__ import annotations

import math
import time
from typing import Any

from fedfew.bench.common import _sync


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
