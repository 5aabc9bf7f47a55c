"""The GPU check's verdicts and bench.md: the issue's targets judged against what was measured, one
line per measurement, and the details tables."""
from __future__ import annotations

from typing import Any

from fedfew.bench.common import TARGET_PROJECTION_S, TARGET_VMAP_GPU, _f, _mb
from fedfew.bench.gpu_sizes import CORRECTNESS_ATOL, TARGET_MEMORY_RATIO


def gpu_check_targets(report: dict) -> list[dict]:
    """The issue's targets against what was measured so far: one row each with the value,
    ``passed`` (True/False; None when unmeasured or, for a GPU target, in the CPU smoke
    mode) and, where a GPU target is missed, what the profile says bounds it."""
    on_gpu = report.get("mode") == "cuda"
    sec = report.get("sections", {})
    rows: list[dict] = []
    profile = sec.get("speed", {}).get("profile", {})

    def add(name: str, target: str, value: Any, ok: bool | None, shown: str, gpu_only: bool = True,
            bound_engine: str | None = None) -> None:
        passed = ok if (on_gpu or not gpu_only) else None
        row = {"name": name, "target": target, "value": value, "shown": shown, "passed": passed,
               "measured_passed": ok, "gpu_target": gpu_only}
        if passed is False and bound_engine and "bound" in profile.get(bound_engine, {}):
            row["bound"] = profile[bound_engine]["bound"]
        rows.append(row)

    corr = sec.get("correctness", {})
    for model in ("cifar10_cnn", "agnews_textcnn"):
        r = corr.get(model, {})
        add(f"correctness {model}", f"{model}: engine=loop == engine=vmap after 2 rounds (max |diff| <= "
            f"{CORRECTNESS_ATOL:g}, fp32)",
            r.get("max_abs_diff"), r.get("passed"), _f(r.get("max_abs_diff"), "{:.1e}"), gpu_only=False)
    ratio = sec.get("speed", {}).get("cifar10_cnn", {}).get("vmap_over_loop")
    add("vmap speed-up", f"vmap >= {TARGET_VMAP_GPU:.0f}x loop, CIFAR-10 CNN at M=20, K=3 (GPU)", ratio,
        None if ratio is None else ratio >= TARGET_VMAP_GPU, _f(ratio, "{:.2f}x"), bound_engine="vmap")
    paper = sec.get("paper", {})
    total = paper.get("projected_total_s")
    add("paper run projection", f"2,000 rounds of the paper's CIFAR-10 run in < {TARGET_PROJECTION_S / 60:.0f} min (GPU)",
        total, None if total is None else total < TARGET_PROJECTION_S, _f(None if total is None else total / 60, "{:.1f} min"),
        bound_engine="vmap")
    mem = sec.get("memory", {})
    ratio_m = mem.get("ratio_largest_M")
    largest = mem.get("largest_M")
    ref = mem.get("reference", {})
    add("memory vs M", f"peak GPU memory at M=1,000 within {TARGET_MEMORY_RATIO}x of M=20 (K=3, GPU)", ratio_m,
        None if ratio_m is None else ratio_m <= TARGET_MEMORY_RATIO,
        _f(ratio_m, "{:.2f}x") + (f" (M={largest} / M={ref.get('M')})" if largest and largest != 1000 else ""))
    return rows


def render_gpu_check(report: dict) -> str:
    """bench.md of a gpu-check: the mode, one line per measurement, the targets, details."""
    m, sec = report.get("machine", {}), report.get("sections", {})
    cuda = report.get("mode") == "cuda"
    lines = ["# fedfew gpu-check", ""]
    if report.get("mode") is None:
        lines.append("**Mode: not known yet** (the runner has not started; see the sections below).")
    elif cuda:
        lines.append(f"**Mode: CUDA** on {m.get('gpu', '?')} ({_f(m.get('gpu_memory_gib'), '{:.0f}')} GiB, "
                     f"capability {m.get('capability', '?')}), {report.get('date')}.")
    else:
        lines.append("**Mode: CPU smoke mode** (no GPU visible): the same code paths at tiny sizes, to keep the "
                     "script working. None of these figures says anything about GPU speed; the targets are for a GPU.")
    lines += [
        "",
        f"torch {m.get('torch', '?')}" + (f" (CUDA {m.get('cuda')}, cuDNN {m.get('cudnn')}, TF32 matmul "
                                           f"{m.get('tf32_matmul')}, TF32 cuDNN {m.get('tf32_cudnn')})" if cuda else "")
        + f", lightning {m.get('lightning', '?')}, Python {m.get('python', '?')}, {m.get('cpu_count', '?')} CPU cores; "
        f"date {report.get('date')}; wall time {_f(report.get('wall_s'), '{:.0f}')} s of a "
        f"{_f(report.get('budget_s'), '{:.0f}')} s budget.",
        "",
        f"CIFAR-10 data: {_data_line(report.get('data', {}))}",
        "",
        "## Results",
        "",
    ]
    lines += [f"- {line}" for line in _result_lines(report)]
    lines += ["", "## Targets", "", "| target | measured | result |", "|---|---|---|"]
    for t in report.get("targets", []):
        if t["passed"] is None:
            verdict = ("not measured" if t["measured_passed"] is None
                       else f"n/a in the CPU smoke mode (would {'pass' if t['measured_passed'] else 'fail'})")
        else:
            verdict = "**pass**" if t["passed"] else "**MISSED**" + (f": bound by {t['bound']}" if t.get("bound") else "")
        lines.append(f"| {t['target']} | {t['shown']} | {verdict} |")
    lines += [""]
    lines += _detail_lines(sec)
    errors = {n: s for n, s in sec.items() if s.get("status") in ("error", "not run")}
    if errors:
        lines += ["## Sections that did not finish", ""]
        for name, s in errors.items():
            lines.append(f"- {name}: {s.get('status')}: {s.get('error') or s.get('note', '')}")
        lines.append("")
    return "\n".join(lines) + "\n"


def _data_line(data: dict) -> str:
    if data.get("status") == "ready":
        per = data.get("per_class")
        return (f"{data.get('images', 0):,} real images from {data.get('source')}"
                f"{f' (a subset: {per[0]} train + {per[1]} test per class)' if per else ''}, unpacked in "
                f"{_f(data.get('unpack_s'), '{:.1f}')} s and decoded in {_f(data.get('decode_s'), '{:.1f}')} s; "
                "the speed, correctness and memory lines use synthetic tensors of the same shapes.")
    if data.get("status") == "failed":
        return f"not available ({data.get('error')}); synthetic CIFAR-10-shaped tensors are used everywhere."
    if data.get("status") == "pending":
        return "being prepared."
    return str(data.get("status"))


def _status_note(s: dict) -> str:
    status = s.get("status", "pending")
    if status == "done":
        return ""
    if status == "error":
        return f" (**error**: {s.get('error', '')[-300:]})"
    return f" ({status}{': ' + s['note'] if s.get('note') else ''})"


def _result_lines(report: dict) -> list[str]:
    sec = report.get("sections", {})
    cuda = report.get("mode") == "cuda"
    out: list[str] = []
    corr = sec.get("correctness", {})
    if corr.get("status") not in (None, "pending"):
        parts = [f"{label} max |diff| {_f(corr.get(model, {}).get('max_abs_diff'), '{:.1e}')}"
                 f" ({'pass' if corr.get(model, {}).get('passed') else 'FAIL' if model in corr else 'n/a'})"
                 for model, label in (("cifar10_cnn", "CIFAR-10 CNN"), ("agnews_textcnn", "AG News TextCNN"))]
        chunk = corr.get("cifar10_cnn", {}).get("engine_clients")
        out.append(f"**Correctness** (engine=loop vs engine=vmap, server models after 2 rounds, fp32 with TF32 off, "
                   f"M={corr.get('M')}, K=3, clients of unequal sizes, vmap chunks of {chunk} clients): "
                   + "; ".join(parts) + f"; tolerance {CORRECTNESS_ATOL:g}." + _status_note(corr))
    speed = sec.get("speed", {})
    if speed.get("status") not in (None, "pending"):
        parts = []
        for model, label in (("cifar10_cnn", "CIFAR-10 CNN (batch 50)"), ("agnews_textcnn", "AG News TextCNN (batch 100)")):
            r = speed.get(model, {})
            lo, vm = r.get("loop", {}), r.get("vmap", {})
            parts.append(f"{label}: loop {_f(lo.get('sample_passes_per_s'), '{:,.0f}')}, vmap "
                         f"{_f(vm.get('sample_passes_per_s'), '{:,.0f}')} sample-passes/s "
                         f"(chunks of {vm.get('engine_clients', '?')} clients) = **{_f(r.get('vmap_over_loop'), '{:.2f}x')}**")
        out.append(f"**Engine speed** (M={speed.get('M')}, K=3, one round after a warm-up round, synthetic data): "
                   + "; ".join(parts)
                   + "." + _status_note(speed))
    prec = sec.get("precision", {})
    if prec.get("status") not in (None, "pending"):
        fp32, bf16 = prec.get("32-true", {}), prec.get("bf16-mixed", {})

        def run(r: dict) -> str:
            if "steady_round_s" not in r:
                return r.get("skipped", "not run")
            return (f"{r['steady_round_s']:.3f} s/round, accuracy {_f(r.get('acc_mean'), '{:.3f}')} after "
                    f"{r['rounds']} round(s)")
        out.append(f"**Precision** (CIFAR-10, M={fp32.get('M', '?')}, K=3, vmap, {prec.get('rounds_planned')} rounds; "
                   f"{prec.get('data', '')}): fp32 {run(fp32)}; bf16-mixed {run(bf16)}; bf16 is "
                   f"**{_f(prec.get('bf16_speedup'), '{:.2f}x')}** as fast, accuracy difference "
                   f"{_f(prec.get('acc_diff'), '{:+.3f}')}." + _status_note(prec))
    paper = sec.get("paper", {})
    if paper.get("status") not in (None, "pending") and "rounds" in paper:
        out.append(f"**The paper's run** (CIFAR-10, Dirichlet 0.5, M={paper.get('M')}, K=3, E=1, lr 0.005, batch 50, "
                   f"fp32, vmap; {paper.get('data', '')}): {paper['rounds']} round(s) in {_f(paper.get('wall_s'), '{:.0f}')} s, "
                   f"{paper['steady_round_s']:.3f} s/round (first {paper['first_round_s']:.2f} s) + evaluation "
                   f"{_f(paper.get('evaluation_s'), '{:.2f}')} s every {paper.get('eval_every')} rounds -> 2,000 rounds "
                   f"projected at **{_f(paper.get('projected_total_min'), '{:.1f}')} min**; personalized accuracy "
                   f"{_f(paper.get('acc_mean'), '{:.3f}')} at round {paper.get('acc_round')}." + _status_note(paper))
    elif paper.get("status") not in (None, "pending"):
        out.append("**The paper's run**: no round finished." + _status_note(paper))
    mem = sec.get("memory", {})
    if mem.get("status") not in (None, "pending"):
        key = "peak_device_mb" if cuda else "peak_host_mb"
        pts = mem.get("points", [])
        fixed = [p for p in pts if p.get("engine_clients") != "auto"]
        auto = [p for p in pts if p.get("engine_clients") == "auto"]
        ref = mem.get("reference") or {"M": 20, "K": 3}
        by_m = ", ".join(f"M={p['M']:,}: {_mb(p.get(key))}" for p in fixed if p["K"] == ref["K"])
        by_k = ", ".join(f"K={p['K']}: {_mb(p.get(key))}" for p in fixed if p["M"] == ref["M"])
        extra = "; ".join(f"M={p['M']} with engine_clients=auto ({p.get('chunk_clients', '?')} clients per chunk): "
                          f"{_mb(p.get(key))}" for p in auto)
        chunk = fixed[0]["engine_clients"] if fixed else "?"
        data_mb = next((p.get("data_mb") for p in pts if p.get("data_mb")), None)
        out.append(f"**Memory** (peak {'GPU' if cuda else 'host (sampled RSS)'} memory of one vmap round, chunks of "
                   f"{chunk} clients, {mem.get('pool', 0):,} samples split among the clients = {_mb(data_mb)} of data): "
                   f"{by_m} (M={_f(mem.get('largest_M'), '{:,}')}/M={ref['M']}: **{_f(mem.get('ratio_largest_M'), '{:.2f}x')}**); "
                   f"{by_k}"
                   + (f"; {extra}" if extra else "") + "." + _status_note(mem))
    peaks = speed.get("peaks", {})
    vm = speed.get("cifar10_cnn", {}).get("vmap", {})
    bf16 = prec.get("bf16-mixed", {})
    if peaks:
        out.append(f"**Utilisation**: matmul peaks measured in this run: fp32 {_f(peaks.get('float32', 0) / 1e12, '{:.1f}')} "
                   f"TFLOP/s, bf16 {_f(peaks.get('bfloat16', 0) / 1e12, '{:.1f}')} TFLOP/s; CIFAR-10 CNN vmap round (fp32) "
                   f"achieves {_f(vm.get('achieved_flops', 0) / 1e12, '{:.2f}')} TFLOP/s = "
                   f"{_f(vm.get('fraction_of_float32_peak'), '{:.1%}')} of the fp32 peak, "
                   f"{_f(vm.get('fraction_of_bfloat16_peak'), '{:.1%}')} of the bf16 peak; bf16-mixed training round "
                   f"{_f((bf16.get('achieved_flops') or 0) / 1e12, '{:.2f}')} TFLOP/s = "
                   f"{_f(bf16.get('fraction_of_peak'), '{:.1%}')} of the bf16 peak (useful FLOPs counted with "
                   "FlopCounterMode).")
    return out


def _detail_lines(sec: dict) -> list[str]:
    lines: list[str] = []
    speed = sec.get("speed", {})
    if any(k in speed for k in ("cifar10_cnn", "agnews_textcnn")):
        lines += ["## Engine speed (details)", "",
                  "| model | engine | clients per chunk | sample-passes | round s | sample-passes/s | pure fwd/bwd s | "
                  "overhead | TFLOP/s | of fp32 peak | of bf16 peak | peak device |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for model in ("cifar10_cnn", "agnews_textcnn"):
            for engine in ("loop", "vmap"):
                r = speed.get(model, {}).get(engine)
                if not r:
                    continue
                if "round_s" not in r:
                    lines.append(f"| {model} | {engine} | {r.get('skipped') or r.get('error', '')} |")
                    continue
                lines.append(f"| {model} | {engine} | {r.get('engine_clients')} | {r['sample_passes']:,} | {r['round_s']:.3f} | "
                             f"{r['sample_passes_per_s']:,.0f} | {_f(r.get('pure_fwd_bwd_s'), '{:.3f}')} | "
                             f"{_f(r.get('overhead'), '{:+.0%}')} | {_f(r.get('achieved_flops', 0) / 1e12, '{:.3f}')} | "
                             f"{_f(r.get('fraction_of_float32_peak'), '{:.1%}')} | {_f(r.get('fraction_of_bfloat16_peak'), '{:.1%}')} | "
                             f"{_mb(r.get('peak_device_mb'))} |")
        lines.append("")
    prof = speed.get("profile", {})
    if prof:
        lines += ["## Where a round's time goes (torch.profiler, CIFAR-10 CNN, 2 clients, K=3)", ""]
        for engine, p in prof.items():
            if "wall_s" not in p:
                lines.append(f"- {engine}: {p.get('skipped', '')}")
                continue
            top = ", ".join(f"{t['op']} {t['self_device_ms'] if p.get('kernels_s') is not None else t['self_cpu_ms']:.1f} ms"
                            for t in p["top"][:5])
            lines.append(f"- {engine}: {p['wall_s']:.3f} s under the profiler, kernels {_f(p.get('kernels_s'), '{:.3f}')} s; "
                         f"bound by {p['bound']}; top: {top}")
        lines.append("")
    mem = sec.get("memory", {})
    if mem.get("points"):
        lines += ["## Memory (details)", "", "| M | K | engine_clients | clients per chunk | round s | data | peak device | "
                  "peak reserved | peak host (sampled) |", "|---|---|---|---|---|---|---|---|---|"]
        for p in mem["points"]:
            if "round_s" not in p:
                lines.append(f"| {p['M']} | {p['K']} | {p['engine_clients']} | {p.get('skipped', '')} |")
                continue
            lines.append(f"| {p['M']:,} | {p['K']} | {p['engine_clients']} | {p.get('chunk_clients')} | {p['round_s']:.2f} | "
                         f"{_mb(p.get('data_mb'))} | {_mb(p.get('peak_device_mb'))} | {_mb(p.get('peak_reserved_mb'))} | "
                         f"{_mb(p.get('peak_host_mb'))} |")
        lines.append("")
    paper = sec.get("paper", {})
    if paper.get("evaluations"):
        curve = ", ".join(f"{e['round']}: {e['acc_mean']:.3f}" for e in paper["evaluations"])
        lines += ["## The paper's run: personalized accuracy (client mean) by round", "", curve, ""]
    return lines
