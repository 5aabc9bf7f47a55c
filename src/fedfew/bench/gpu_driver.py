"""GPU readiness check: ``python -m fedfew.bench --gpu-check`` (``make gpu-check``, docs/speed.md).

One command measures every CUDA path in a few minutes on one GPU, starting from a bare
machine (scripts/gpu_check.sh installs the carried wheels first), and runs the very same
code at tiny sizes on a CPU (the smoke mode the tests run). Three processes:
  driver  (``--gpu-check``): starts the other two, keeps the time budget, writes bench.json
          and bench.md after every result (a timeout still leaves what was measured), kills
          a section that overruns its deadline and restarts the runner for the sections after it;
  data    (``--gpu-check-data``): unpacks the CIFAR-10 tarballs and decodes them into the
          tensor cache while the first sections (synthetic data) run;
  runner  (``--gpu-check-run``): the sections in order, one ``GPU_CHECK {json}`` line per event.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from fedfew.bench.common import _log, load_average
from fedfew.bench.gpu_report import gpu_check_targets, render_gpu_check
from fedfew.bench.gpu_sizes import _EVENT, CHECK_SIZES, GPU_CHECK_SECTIONS, resolve_device


def gpu_check(args) -> int:
    """``--gpu-check``: start the data process and the runner, keep the budget, write
    ``bench.json`` and ``bench.md`` into ``args.out`` after every event, print bench.md at the end.

    The driver itself imports no torch (with ``--device cuda`` it checks the GPU first):
    the runner names the mode (cuda | cpu) and the run's end in its first event.

    Returns:
        0 when every section ran and loop == vmap held; 1 when a section failed or the
        engines disagree (missed speed/memory targets are results, not failures).
    Raises:
        ValueError: ``--device cuda`` without a visible GPU, an unknown ``--only`` section, or
            a missing ``--cifar-dir``.
    """
    import queue
    import shutil
    import threading
    from collections import deque
    from datetime import datetime, timezone

    from fedfew.core.io import atomic_write_json, atomic_write_text

    started = float(args.started_at) if args.started_at else time.time()
    if args.device == "cuda":
        resolve_device("cuda")
    cifar_dir = Path(args.cifar_dir).expanduser().resolve() if args.cifar_dir else None
    if cifar_dir is not None and not cifar_dir.is_dir():
        raise ValueError(f"--cifar-dir {cifar_dir}: no such folder (make gpu-data copies the CIFAR-10 tarballs "
                         "into .gpu_data/cifar10)")
    sections = list(args.only or GPU_CHECK_SECTIONS)
    unknown = sorted(set(sections) - set(GPU_CHECK_SECTIONS))
    if unknown:
        raise ValueError(f"--only {' '.join(unknown)}: unknown section(s); choose from {', '.join(GPU_CHECK_SECTIONS)}")
    out_dir = Path(args.out)
    report: dict[str, Any] = {
        "kind": "gpu-check", "mode": None, "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "budget_s": args.budget, "machine": {},
        "data": {"source": str(cifar_dir), "status": "pending"} if cifar_dir else
                {"source": None, "status": "none: no CIFAR-10 tarballs given (make gpu-data, or --cifar-dir)"},
        "sections": {name: {"status": "pending"} for name in sections},
    }
    _log(f"gpu-check: writing {out_dir / 'bench.json'} and bench.md as results arrive")

    def write() -> None:
        report["wall_s"] = time.time() - started
        report["targets"] = gpu_check_targets(report)
        atomic_write_json(out_dir / "bench.json", report)
        atomic_write_text(out_dir / "bench.md", render_gpu_check(report))

    write()
    work = Path(tempfile.mkdtemp(prefix="fedfew-gpu-check-"))
    env = dict(os.environ, PYTHONUNBUFFERED="1", FEDFEW_CACHE_DIR=str(work / "cache"), FEDFEW_OFFLINE="1")
    env.setdefault("PYTHONWARNINGS", "ignore")
    lines: queue.Queue = queue.Queue()
    procs: dict[str, subprocess.Popen] = {}
    tails = {"runner": deque(maxlen=60), "data": deque(maxlen=30)}
    remaining = list(sections)
    # end: the run's end (from the runner; until then the largest budget); grace: past a deadline
    state: dict[str, Any] = {"current": None, "deadline": None, "finished": False, "device": args.device,
                             "end": started + float(args.budget or max(s.budget_s for s in CHECK_SIZES.values())),
                             "grace": max(s.grace_s for s in CHECK_SIZES.values()), "data_stopped": False}

    def spawn(name: str, flag: str, spec: dict) -> None:
        proc = subprocess.Popen([sys.executable, "-m", "fedfew.bench", flag, json.dumps(spec)], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env=env, bufsize=1)

        def pump() -> None:
            for line in proc.stdout:
                lines.put((name, line.rstrip("\n")))
            lines.put((name, None))

        threading.Thread(target=pump, name=f"gpu-check-{name}", daemon=True).start()
        procs[name] = proc

    def start_runner() -> None:
        state.update(finished=False, began_section=False)
        spawn("runner", "--gpu-check-run", {"device": state["device"], "sections": remaining, "started": started,
                                            "budget": args.budget, "work": str(work), "use_data": cifar_dir is not None})

    def fail_current(message: str) -> None:
        name = state["current"]
        report["sections"][name] = {"status": "error", "error": message, "output_tail": list(tails["runner"])[-25:]}
        remaining.remove(name)
        state["current"] = None

    def handle(event: dict) -> None:
        section, kind = event.pop("section"), event.pop("event")
        if section == "machine":
            report["machine"].update(event.get("result", {}))
            report.update(mode=event["mode"], smoke=event["mode"] != "cuda", budget_s=event["budget_s"],
                          sizes={k: v for k, v in CHECK_SIZES[event["mode"]].__dict__.items() if k not in ("caps", "keep")})
            state.update(device=event["mode"], end=float(event["end"]), grace=CHECK_SIZES[event["mode"]].grace_s)
            _log(f"mode: {'CUDA' if event['mode'] == 'cuda' else 'CPU smoke mode (no GPU): the same code paths at tiny sizes'}"
                 f"; budget {event['budget_s']:.0f} s, until {time.strftime('%H:%M:%S', time.localtime(state['end']))}")
            if cifar_dir is not None and "data" not in procs and report["data"]["status"] == "pending":
                # once the runner has its imports: the two processes do not compete for a small CPU's cores
                spawn("data", "--gpu-check-data", {"cifar_dir": str(cifar_dir), "work": str(work), "device": event["mode"]})
        elif section == "data":
            report["data"].update(event.get("result", {}), status="ready" if kind == "done" else "failed")
        elif section == "runner":
            state["finished"] = True
        elif kind == "start":
            state.update(current=section, deadline=float(event["deadline"]), began_section=True)
            report["sections"][section] = {"status": "running"}
        elif kind == "partial":
            report["sections"][section] = {"status": "partial", **event.get("result", {})}
        elif kind in ("done", "error"):
            body = event.get("result", {}) if kind == "done" else event
            report["sections"][section] = {"status": kind, **body}
            if section in remaining:
                remaining.remove(section)
            state["current"] = None
        write()

    start_runner()
    try:
        while procs:
            try:
                source, line = lines.get(timeout=0.5)
            except queue.Empty:
                source, line = None, None
            if source is not None and line is None:  # a process closed its output
                code = procs.pop(source).wait()
                if source == "data" and report["data"].get("status") == "pending":
                    error = ("stopped: every section had finished" if state["data_stopped"]
                             else f"the data process exited with code {code}")
                    report["data"].update(status="failed", error=error, output_tail=list(tails["data"])[-15:])
                    atomic_write_json(work / "data_status.json", {"ok": False, "error": error})
                    write()
                if source == "runner" and not state["finished"]:
                    if state["current"] is not None:
                        fail_current(f"the runner process exited with code {code} during this section")
                        write()
                    if not state["began_section"]:  # it fails before any work: a restart would too
                        for name in list(remaining):
                            report["sections"][name] = {
                                "status": "error", "output_tail": list(tails["runner"])[-25:],
                                "error": f"the runner process exited with code {code} before its first section"}
                            remaining.remove(name)
                        write()
                    elif remaining and time.time() < state["end"] - 10:
                        _log(f"restarting the runner for: {' '.join(remaining)}")
                        start_runner()
                if "runner" not in procs and "data" in procs:
                    state["data_stopped"] = True
                    procs["data"].kill()  # nothing needs the data any more
            elif line is not None:
                if line.startswith(_EVENT):
                    handle(json.loads(line[len(_EVENT):]))
                else:
                    tails[source].append(line)
                    print(line if line.startswith("[bench ") else f"  [{source}] {line}", flush=True)
            now = time.time()
            if state["current"] is not None and now > state["deadline"] + state["grace"] and "runner" in procs:
                fail_current(f"still running {state['grace']:.0f} s after its deadline: killed")
                procs["runner"].kill()
                write()
            if now > state["end"] + state["grace"]:
                if state["current"] is not None:
                    fail_current("the run's time budget ran out: killed")
                break
    finally:
        for proc in procs.values():
            proc.kill()
        shutil.rmtree(work, ignore_errors=True)
    for name in remaining:
        if report["sections"][name].get("status") in ("pending", "running", "partial"):
            report["sections"][name]["note"] = "not finished: the run's time budget ran out"
            if report["sections"][name]["status"] == "pending":
                report["sections"][name]["status"] = "not run"
    report["machine"]["load_average_end"] = load_average()
    write()
    _log(f"wrote {out_dir / 'bench.json'} and {out_dir / 'bench.md'} ({report['wall_s']:.0f} s)")
    print(render_gpu_check(report), flush=True)
    errors = [n for n, s in report["sections"].items() if s.get("status") != "done"]
    disagree = [t["name"] for t in report["targets"] if t["name"].startswith("correctness") and t["passed"] is False]
    return 1 if errors or disagree or report["mode"] is None else 0
