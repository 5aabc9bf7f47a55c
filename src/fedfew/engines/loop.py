"""``engine=loop``: the K models of a client trained one after another (the default).

For each model k: copy server model k into the one working copy (in place), run
:func:`fedfew.core.local_training.train_local` with seed ``derive_seed(seed, "local", round, client, k)``
(shuffling and dropout), and write theta_ik - theta_k into a reused (K, D) buffer (slice by
slice against server model k: no flat copy of the server models is kept). theta is the state
vector (:func:`fedfew.core.model_set.state_tensors`): parameters, then BatchNorm running statistics and
counters, so the statistics the working copy gathered travel with the parameters.
"""
from __future__ import annotations

from typing import Iterator, Sequence

import torch

from fedfew.engines import ENGINES
from fedfew.engines.base import ClientJob, ClientResult, Engine
from fedfew.core.local_training import train_local
from fedfew.core.model_set import state_numel, state_tensors


def write_flat_(out: torch.Tensor, parameters) -> torch.Tensor:
    """Copy ``parameters`` (an iterable of tensors, integer counters included) into the (D,)
    vector ``out``, in order, converting to ``out``'s dtype."""
    offset = 0
    with torch.no_grad():
        for p in parameters:
            n = p.numel()
            out[offset : offset + n].copy_(p.detach().reshape(-1))
            offset += n
    return out


def subtract_flat_(out: torch.Tensor, parameters) -> torch.Tensor:
    """``out -= cat(parameters)`` slice by slice (no flat copy of ``parameters``)."""
    offset = 0
    with torch.no_grad():
        for p in parameters:
            n = p.numel()
            out[offset : offset + n].sub_(p.detach().reshape(-1))
            offset += n
    return out


@ENGINES.register("loop")
class LoopEngine(Engine):
    """One model at a time through ``module.working`` (see module docstring)."""

    name = "loop"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._forward = None
        if self.compile is not None:
            self._forward = torch.compile(self.module.working, backend=self.compile)
        self._deltas: torch.Tensor | None = None

    def train(self, jobs: Sequence[ClientJob]) -> Iterator[ClientResult]:
        module = self.module
        if self._deltas is None or len(self._deltas) < self.K:  # K=auto only shrinks K; rows past K are stale
            first = next(module.working.parameters())
            dim = state_numel(module.working)
            self._deltas = torch.empty((self.K, dim), dtype=first.dtype, device=first.device)
        for job in jobs:
            losses = torch.zeros(self.K, dtype=torch.float64)
            for k in range(self.K):
                module.load_working(k)
                losses[k] = train_local(
                    module, self.data, job.index, self.epochs, self.batch_size, seed=job.seeds[k],
                    autocast=self.autocast, forward=self._forward,
                )
                subtract_flat_(write_flat_(self._deltas[k], state_tensors(module.working)), state_tensors(module.models[k]))
            self._client_done()
            yield ClientResult(job.client, losses, self._deltas[: self.K])
