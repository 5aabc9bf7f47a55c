"""bench.md of the CPU benchmark (``make bench``): one table per section."""
from __future__ import annotations

from fedfew.bench.common import (REFERENCE_PEAK_HOST_GB, REFERENCE_ROUND_S, REFERENCE_STEP_S, TARGET_DEVICES_SPEEDUP,
                                 TARGET_OVERHEAD, TARGET_PROJECTION_S, TARGET_REFERENCE_HOST_GB,
                                 TARGET_REFERENCE_SPEEDUP, _f, _mb)
from fedfew.bench.flower_speed import flower_lines


def render_markdown(report: dict) -> str:
    m = report["machine"]
    s = report["settings"]
    lines = [
        "# fedfew benchmark",
        "",
        f"Device: **{m['device']}**{' (' + m['cuda'] + ')' if m.get('cuda') else ''}, {m['cpu_count']} CPU cores, "
        f"torch {m['torch']} ({m['torch_threads']} threads); precision {s['precision']}, compile {s['compile']}, "
        f"sizes: {'full' if s['full'] else 'small (default; --full for the paper sizes)'}; AG News data: {s['agnews_data']}.",
        f"Load average at start {m.get('load_average_start')}, at end {m.get('load_average_end')}: on a shared "
        "machine every timing below is noisy (other jobs compete for the same cores).",
        "",
    ]
    thr = report.get("throughput")
    if thr:
        lines += ["## Throughput (sample-passes/s: one sample through one model, forward + backward)", "",
                  "| config | engine | clients | sample-passes | round s | sample-passes/s | pure fwd/bwd s | overhead | "
                  "achieved GFLOP/s | peak GFLOP/s | fraction of peak | peak host | peak device |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for name, per in thr.items():
            for engine in ("loop", "vmap"):
                r = per.get(engine, {})
                if "error" in r:
                    lines.append(f"| {name} | {engine} | error: {r['error'][-200:]!r} |")
                    continue
                lines.append(
                    f"| {name} | {engine} | {r['clients']} | {r['sample_passes']:,} | {r['round_s']:.2f} | "
                    f"{r['sample_passes_per_s']:.0f} | {_f(r.get('pure_fwd_bwd_s'))} | {_f(r.get('overhead'), '{:+.0%}')} | "
                    f"{_f(r.get('achieved_flops', 0) / 1e9, '{:.1f}')} | {_f(r.get('peak_flops', 0) / 1e9, '{:.0f}')} | "
                    f"{_f(r.get('flop_fraction'), '{:.1%}')} | {_mb(r.get('peak_host_mb'))} | {_mb(r.get('peak_device_mb'))} |")
            if "vmap_over_loop" in per:
                lines.append(f"| {name} | **vmap / loop** | | | | **{per['vmap_over_loop']:.2f}x** | | | | | | | |")
        lines += ["", "Overhead = round time / pure forward+backward time of the same batches - 1 "
                  f"(target on CPU: at most {TARGET_OVERHEAD:.0%}).", ""]
    proj = report.get("projection")
    if proj and any(e in proj for e in ("loop", "vmap")):
        lines += ["## Projection: the paper's CIFAR-10 run (2,000 rounds, M=20, K=3, E=1, eval every 10 rounds)", ""]
        for engine in ("loop", "vmap"):
            if engine in proj:
                p = proj[engine]
                lines.append(f"- {engine}: {p['round_s']:.2f} s/round, total {p['total_min']:.1f} min on {proj['device']}")
        lines += [f"- target: under {TARGET_PROJECTION_S / 60:.0f} minutes on one H200 ({proj['note']})", ""]
    ref = report.get("reference")
    if ref:
        lines += ["## Reference preset: AG News TextCNN (embedding 512, texts up to 200 tokens, M=20, K=3, E=1, batch 100)", "",
                  "| engine | clients timed | round s (timed) | projected full round s | vs reference 220 s | "
                  "vs reference re-estimated here | peak host |", "|---|---|---|---|---|---|---|"]
        # loop_bf16: engine=loop with precision=bf16-mixed (not the reference's float32 numerics)
        for engine in ("loop", "vmap", "loop_bf16"):
            r = ref.get(engine)
            if r is None:
                continue
            if "error" in r:
                lines.append(f"| {engine} | error: {r['error'][-200:]!r} |")
                continue
            lines.append(f"| {engine} | {r['clients']} of 20 | {r['round_s']:.1f} | {r['projected_round_s']:.1f} | "
                         f"{r['speedup_vs_reference']:.2f}x | {_f(r.get('speedup_vs_reference_here'), '{:.2f}x')} | "
                         f"{_mb(r.get('peak_host_mb'))} |")
        here = ref.get("reference_round_here_s")
        lines += ["", f"Reference: {REFERENCE_ROUND_S:.0f} s/round, {REFERENCE_STEP_S} s/step, {REFERENCE_PEAK_HOST_GB:.0f} GB "
                  f"peak host (targets: >= {TARGET_REFERENCE_SPEEDUP:.0f}x faster, < {TARGET_REFERENCE_HOST_GB:.0f} GB). "
                  f"Its step (batch 100 padded to 200 tokens) measured here now: "
                  f"{_f(ref.get('reference_step_here', {}).get('step_s'))} s; times its "
                  f"{ref.get('reference_steps_per_round', 'n/a')} steps (drop_last) = {_f(here, '{:.0f}')} s per round "
                  "re-estimated on this machine under the current load.", ""]
    sc = report.get("scaling")
    if sc:
        lines += [f"## Scaling (CIFAR-10 CNN, engine={sc['engine']}, one fixed pool of samples split among the M clients)", "",
                  "| M | K | pool | clients timed | round s | s per client-model | sample-passes/s | peak host | peak device |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for p in sc["points"]:
            if "error" in p:
                lines.append(f"| {p['M']} | {p['K']} | error: {p['error'][-200:]!r} |")
                continue
            lines.append(f"| {p['M']} | {p['K']} | {p['pool']:,} | {p['clients']} | {p['round_s']:.2f} | "
                         f"{p['round_s'] / (p['clients'] * p['K']):.3f} | {p['sample_passes_per_s']:.0f} | "
                         f"{_mb(p.get('peak_host_mb'))} | {_mb(p.get('peak_device_mb'))} |")
        lines += ["", "Target: peak host memory grows with K and the model size, not with M (M=500 at K=3 within 4 GiB).", ""]
    dev = report.get("devices")
    if dev and "skipped" in dev:
        lines += ["## devices=1 vs devices=2", "", f"Skipped: {dev['skipped']}.", ""]
    elif dev:
        lines += ["## devices=1 vs devices=2 (CPU DDP, trainer.threads=1 each; AG News)", ""]
        for d, r in dev["runs"].items():
            if "error" in r:
                lines.append(f"- devices={d}: error: {r['error'][-300:]!r}")
            else:
                lines.append(f"- devices={d}: round times {[round(t, 2) for t in r['round_time_s']]} s "
                             f"(last {r['last_round_s']:.2f} s), seconds_per_round {_f(r['seconds_per_round'])}")
        lines += [f"- speed-up (mean round time): **{_f(dev.get('speedup'), '{:.2f}x')}** (target >= {TARGET_DEVICES_SPEEDUP}x on 2 cores; "
                  f"{dev['clients_per_round']} clients per round, {dev['rounds']} rounds)", ""]
    if report.get("flower"):
        lines += flower_lines(report["flower"])
    lines.append(f"Benchmark wall time: {report.get('bench_wall_s', 0):.0f} s.")
    return "\n".join(lines) + "\n"
