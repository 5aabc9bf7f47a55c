"""Whether a run's ``trainer.precision`` suits the machine it runs on.

bf16-mixed on a CPU where oneDNN has no fast bf16 path (AVX2 only: no AVX-512, no AMX) is not an
error, since the figures are right, but it is far slower than fp32: measured on an AVX2-only
AMD EPYC (2026-12-07), a 3->64->64-channel conv step took 8.6 s in bf16 against 0.50 s in fp32
(17x), and a CIFAR-10 apfl round 2,019 s against ~62 s on a machine with native bf16. The note
is said before any data is read, so a user stops the run instead of waiting hours for it.
"""
from __future__ import annotations

from typing import Any


def cpu_has_native_bf16() -> bool:
    """Whether oneDNN, torch's CPU kernels, has a fast bf16 path here (its own check: AVX-512 or AMX;
    False on an AVX2-only CPU, where bf16 is emulated)."""
    import torch

    probe = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    if probe is None:  # a torch without the probe: assume the slow case is not known
        return True
    return bool(probe())


def runs_on_cpu(cfg: Any) -> bool:
    """Whether ``cfg.trainer.accelerator`` puts the run on the CPU (``auto``: no CUDA or MPS device)."""
    import torch

    accelerator = str(cfg.trainer.get("accelerator", "auto"))
    if accelerator == "cpu":
        return True
    if accelerator != "auto":
        return False
    return not torch.cuda.is_available() and not torch.backends.mps.is_available()


def slow_precision_note(cfg: Any) -> str | None:
    """A warning for a bf16 run on a CPU without native bf16 (module docstring), or None."""
    precision = str(cfg.trainer.get("precision", "32-true"))
    if "bf16" not in precision or not runs_on_cpu(cfg) or cpu_has_native_bf16():
        return None
    return (f"trainer.precision={precision} on a CPU without native bf16 (AVX2 only here, no AVX-512 or AMX): "
            "torch emulates it, ~17x slower than fp32 on an AVX2 CPU (docs/speed.md). Use "
            "trainer.precision=32-true, or a machine with native bf16 when the runs must match earlier bf16 runs")
