"""Peak memory of this process, for results.json and the benchmark."""
from __future__ import annotations

import resource

import torch


def peak_host_mib() -> float:
    """Peak resident memory of this process so far (MiB; Linux's ``ru_maxrss``, in KiB there):
    everything the process held at its fullest moment, the data it loaded included."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def peak_device_mib(device: torch.device | str) -> float | None:
    """Peak memory torch's allocator held on a CUDA ``device`` since the process started (MiB);
    None for any other device (a CPU's memory is :func:`peak_host_mib`)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.max_memory_allocated(device) / 2**20
