"""The engine interface: train the K local copies of some clients from the server weights.

An engine receives :class:`ClientJob` s (client id, its train indices on the device, one seed
per model) and yields one :class:`ClientResult` per client: the running losses (K,) and the
deltas (K, D) = theta_ik(local) - theta_k of the state vectors (parameters, then BatchNorm
statistics: :func:`fedfew.core.model_set.flat_state`). The caller (FedFew's ``train_clients``) folds each
result into its streaming aggregate before asking for the next one, so an engine may (and
does) hand out views of one reused buffer: a result is valid until the generator resumes.

Engines never deep-copy models per client: the loop engine reuses ``module.working``, the
vmap engine one stacked set of parameters that grows to the largest chunk and is then reused.
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch

from fedfew.core.model_set import KModelSet, has_batch_norm  # noqa: F401 (re-exported)

log = logging.getLogger(__name__)

#: allocations from this size on are served by mmap and given back to the OS when freed
MMAP_THRESHOLD = 16 << 20
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
_libc = None
_host_policy_set = False


def _glibc():
    """glibc through ctypes when it offers mallopt/malloc_trim (Linux), else None."""
    global _libc
    if _libc is None:
        try:
            lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _libc = lib if hasattr(lib, "mallopt") and hasattr(lib, "malloc_trim") else False
        except OSError:
            _libc = False
    return _libc or None


def bound_host_memory() -> None:
    """Keep a CPU run's peak memory at its live size (once per process; glibc only).

    Local training allocates activations whose size changes from batch to batch (text
    batches are cut to their longest sequence). glibc's default raises its mmap threshold
    to 32 MiB after the first large free, after which such tensors come from the heap, whose
    fragments are not given back: on the reference AG News model the peak crept by ~0.4 GiB
    within one client of ~1,000 samples (30 steps). Fixing the threshold at :data:`MMAP_THRESHOLD` (tensors of 16 MiB and more
    are mapped and unmapped; smaller ones, e.g. every CIFAR-10 CNN activation at batch 50,
    stay on the heap) bounds the peak; :func:`release_host_memory` after each client
    returns what the heap still holds. Called by every CPU
    :class:`~fedfew.simulator.simulation.Simulation` (whatever its method) and by the engines.
    """
    global _host_policy_set
    lib = _glibc()
    if lib is None or _host_policy_set:
        return
    lib.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    _host_policy_set = True
    log.debug("glibc mmap threshold fixed at %d bytes", MMAP_THRESHOLD)


def release_host_memory() -> None:
    """Give the heap's free pages back to the OS (glibc ``malloc_trim``); no-op elsewhere."""
    lib = _glibc()
    if lib is not None:
        lib.malloc_trim(0)


@dataclass
class ClientJob:
    """One client's local work.

    Attributes:
        client: client id.
        index: (n,) int64 indices of its train samples (on the data's device).
        seeds: K seeds, ``derive_seed(seed, "local", round, client, k)``; seed k governs
            model k's shuffling (and, in the loop engine, its dropout).
    """

    client: int
    index: torch.Tensor
    seeds: list[int]


@dataclass
class ClientResult:
    """What one client sends back.

    Attributes:
        client: client id.
        losses: (K,) float64 on the host: running loss (mean minibatch loss of the last epoch).
        deltas: (K, D) float32 on the device, state-vector deltas (:func:`fedfew.core.model_set.flat_state`
            order); a view of the engine's buffer, valid until the engine's generator is resumed.
    """

    client: int
    losses: torch.Tensor
    deltas: torch.Tensor


def compile_setting(value: Any) -> str | None:
    """The ``compile`` config value as a torch.compile backend name, or None (off).

    ``false``/``null`` -> None; ``true`` -> ``"inductor"``; a string -> that backend
    (e.g. ``aot_eager`` for a quick check without a C++ compiler).
    """
    if value is None or value is False or str(value).lower() in ("false", "none", "null", "0", ""):
        return None
    if value is True or str(value).lower() in ("true", "1"):
        return "inductor"
    return str(value)


class Engine:
    """Base class; subclasses register with :data:`fedfew.engines.ENGINES`.

    Args:
        module: the K-model set (server models and the working copy) on the device.
        data: pooled tensors (``data.batch(index)`` gathers a batch on the device).
        epochs: local epochs E. batch_size: B.
        autocast: Fabric's autocast factory for mixed precision, or None.
        compile: torch.compile backend name, or None.
        max_clients: clients trained together at most (``"auto"`` or an int; engines that
            train one client at a time ignore it).
    """

    name = ""

    def __init__(
        self,
        module: KModelSet,
        data,
        epochs: int,
        batch_size: int,
        autocast: Callable[[], Any] | None = None,
        compile: str | None = None,
        max_clients: int | str = "auto",
    ) -> None:
        self.module, self.data = module, data
        self.epochs, self.batch_size = int(epochs), int(batch_size)
        self.autocast = autocast
        self.compile = compile
        self.requested_clients = max_clients
        self.on_cpu = next(module.working.parameters()).device.type == "cpu"
        if self.on_cpu:
            bound_host_memory()

    def _client_done(self) -> None:
        """Called after each client (loop) or chunk (vmap): on the CPU, return freed heap pages."""
        if self.on_cpu:
            release_host_memory()

    @classmethod
    def from_context(cls, ctx) -> "Engine":
        """Build from a :class:`fedfew.algorithms.base.Context` (run config, module, data)."""
        cfg = ctx.cfg
        return cls(
            ctx.module, ctx.data, int(cfg.local_epochs), int(cfg.dataset.batch_size), autocast=ctx.autocast,
            compile=compile_setting(cfg.get("compile", False)), max_clients=cfg.get("engine_clients", "auto") or "auto",
        )

    @property
    def K(self) -> int:
        return self.module.K

    def _autocast(self):
        return self.autocast() if self.autocast is not None else contextlib.nullcontext()

    def plan(self, sizes: dict[int, int]) -> list[list[int]]:
        """Group this rank's clients ({id: n_i}) into chunks trained together (default: one
        client per chunk, in id order)."""
        return [[c] for c in sorted(sizes)]

    def train(self, jobs: Sequence[ClientJob]) -> Iterator[ClientResult]:
        """Train each job's K models from the server models ``module.models``; yield one
        result per job (deltas against those models, which must not change meanwhile).

        Args:
            jobs: clients of one chunk (see :meth:`plan`).
        """
        raise NotImplementedError
