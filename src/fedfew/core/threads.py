"""torch's intra-op thread count for a run: ``trainer.threads`` (conf/trainer/default.yaml), read here only.

A matmul may round differently on 1 and 2 threads on some CPUs (measured on an AMD EPYC, 2026-12-07:
losses 3.6e-7 apart after five FedFew rounds), so every path that trains or scores clients (the
simulator's :meth:`fedfew.simulator.simulation.Simulation.fit`, the Flower client's
:class:`fedfew.flower.client.ClientRuntime`) runs under :func:`run_threads`, and two runs of one
config agree bitwise whichever entry point started them. A process's entry point (``make train``,
the Flower server) also calls :func:`apply_threads` once, so data loading respects the count too.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

from fedfew.core.allowed import is_int


def wanted_threads(cfg: Any) -> int | None:
    """``cfg.trainer.threads``: a count, or None when null (torch's default).

    Raises:
        ValueError: anything but null or a whole number >= 1, naming the override that fixes it
            (``make train`` stops on it earlier: :mod:`fedfew.config.rules`).
    """
    value = (cfg.get("trainer") or {}).get("threads")
    if value is None:
        return None
    if not is_int(value) or value < 1:  # as the config rule (a library caller may skip validate_config)
        raise ValueError(f"trainer.threads={value!r}: give a whole number of torch threads >= 1 "
                         "(e.g. trainer.threads=1), or null for torch's default")
    return value


def apply_threads(cfg: Any) -> int:
    """Set torch's thread count to ``cfg.trainer.threads`` for the rest of the process (unset:
    unchanged); returns the count before, for a caller that restores it."""
    import torch

    before = torch.get_num_threads()
    count = wanted_threads(cfg)
    if count is not None and count != before:
        torch.set_num_threads(count)
    return before


@contextmanager
def run_threads(cfg: Any) -> Iterator[None]:
    """The body runs at ``cfg.trainer.threads`` torch threads; the caller's count is restored after
    (a library call must not change its caller's process, e.g. a test that builds a Simulation)."""
    import torch

    before = apply_threads(cfg)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)
