"""What both bench programs share: the progress line, the load average, the device choice,
device synchronisation, peak host memory, the issue's targets and the report's number formats."""
from __future__ import annotations

import os
import time
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


def _sync(device) -> None:
    import torch

    if getattr(device, "type", str(device)) == "cuda":
        torch.cuda.synchronize(device)


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


def _log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _f(value: Any, fmt: str = "{:.2f}") -> str:
    if value is None:
        return "n/a"
    if isinstance(value, (int, float)):
        return fmt.format(value)
    return str(value)


def _mb(value: Any) -> str:
    return "n/a" if value is None else f"{value:,.0f} MiB"
