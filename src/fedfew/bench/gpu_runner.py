"""The GPU check's runner process (``--gpu-check-run``): the sections in order, each under its own
deadline, one ``GPU_CHECK {json}`` line per event for the driver."""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from fedfew.bench.common import _log
from fedfew.bench.gpu_context import CheckContext, machine_info
from fedfew.bench.gpu_sections import CHECKS
from fedfew.bench.gpu_sizes import CHECK_SIZES, _emit, _set_threads, resolve_device


def gpu_check_run(plan: dict) -> int:
    """The runner process: every section of ``plan["sections"]`` in order, each with its own
    deadline (its cap, but no later than the run's end -- ``plan["started"]`` plus the
    budget -- less the time kept for the sections after it, at most half of what is left); a
    section's exception is reported and the next one runs. Its first event names the mode (cuda | cpu) and the end."""
    import gc
    import traceback

    import torch

    mode = resolve_device(plan["device"])
    device = torch.device(mode)
    sizes = CHECK_SIZES[mode]
    _set_threads(sizes)
    budget = float(plan.get("budget") or sizes.budget_s)
    end = float(plan["started"]) + budget
    work = Path(plan["work"]) if plan.get("work") else None
    ctx = CheckContext(mode, sizes, work, bool(plan.get("use_data")))
    import fedfew.simulator.simulation  # noqa: F401 - the heavy imports (lightning) before the driver starts the data process
    _emit("machine", "done", result=machine_info(device), mode=mode, end=end, budget_s=budget)
    sections = list(plan["sections"])
    # tests of the driver's recovery: FEDFEW_GPU_CHECK_FAULT=<section>:crash ends this process there
    fault = os.environ.get("FEDFEW_GPU_CHECK_FAULT", "")
    for i, name in enumerate(sections):
        # time kept back for the later sections, but never more than half of what is left (a
        # budget too small for every section still runs the first ones: correctness first)
        keep = min(sum(sizes.keep[s] for s in sections[i + 1:]), 0.5 * max(0.0, end - time.time()))
        ctx.section = name
        ctx.deadline = min(time.time() + sizes.caps[name], end - keep)
        _emit(name, "start", deadline=ctx.deadline)
        _log(f"section {name} (at most {ctx.left():.0f} s)")
        if fault == f"{name}:crash":
            sys.stdout.flush()
            os._exit(7)
        begin = time.time()
        try:
            if ctx.left() <= 0:
                raise TimeoutError("no time left in the run's budget")
            result = CHECKS[name](ctx)
            result["section_s"] = time.time() - begin
            _emit(name, "done", result=result)
        except Exception as err:  # noqa: BLE001 - reported in bench.json; the next section still runs
            _emit(name, "error", error=f"{type(err).__name__}: {err}", traceback=traceback.format_exc()[-3000:],
                  section_s=time.time() - begin)
            if device.type == "cuda" and _poisons_cuda(err):
                _log("a CUDA error leaves this process's context unusable: exiting (the driver starts a fresh runner)")
                return 3
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    _emit("runner", "end")
    return 0


def _poisons_cuda(err: BaseException) -> bool:
    """Whether ``err`` is a CUDA error after which the process's CUDA context is unusable
    (illegal address, device-side assert, ...; not an out-of-memory error, which is recoverable)."""
    import torch

    if isinstance(err, torch.cuda.OutOfMemoryError):
        return False
    text = f"{type(err).__name__}: {err}"
    return "AcceleratorError" in text or "CUDA error" in text or "device-side assert" in text
