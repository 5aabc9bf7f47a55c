"""Memory of this process, for results.json and the benchmark: its peak, and its current size
(to tell what a run's rounds add on top of the data it loaded)."""
from __future__ import annotations

import resource

import torch


def peak_host_mib() -> float:
    """Peak resident memory of this process so far (MiB; Linux's ``ru_maxrss``, in KiB there):
    everything the process held at its fullest moment, the data it loaded included."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def current_host_mib() -> float | None:
    """Resident memory of this process now (MiB; ``VmRSS`` of ``/proc/self/status``), or None
    where there is no ``/proc`` (not Linux). Unlike :func:`peak_host_mib` it can go down, so
    sampled before the first round and after each round it shows what training adds on top of
    the loaded data, which the peak may hide (the peak is often reached while the data is built)."""
    try:
        with open("/proc/self/status", "rb") as status:
            for line in status:
                if line.startswith(b"VmRSS:"):
                    return int(line.split()[1]) / 1024.0  # kB
    except OSError:
        pass
    return None


def peak_device_mib(device: torch.device | str) -> float | None:
    """Peak memory torch's allocator held on a CUDA ``device`` since the process started (MiB);
    None for any other device (a CPU's memory is :func:`peak_host_mib`)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.max_memory_allocated(device) / 2**20
