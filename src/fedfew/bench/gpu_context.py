"""What a GPU check section works with: :class:`CheckContext` (device, sizes, deadline, matmul peaks,
the CIFAR-10 data shared between sections), exact fp32 numerics, sampled peak host memory, and the
machine's description."""
from __future__ import annotations

import contextlib
import json
import math
import os
import time
from pathlib import Path
from typing import Any

from fedfew.bench.common import _log, load_average
from fedfew.bench.gpu_data import _cifar_overrides
from fedfew.bench.gpu_sizes import CheckSizes, _emit
from fedfew.bench.measure import peak_matmul_flops
from fedfew.bench.synthetic import synthetic_images
from fedfew.config.compose import compose


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
