"""The GPU check's sections, each a function of a :class:`~fedfew.bench.gpu_context.CheckContext`
returning its result: correctness (loop == vmap), speed (with a profile), memory, precision and the
paper's run (:data:`CHECKS`, in the order of :data:`~fedfew.bench.gpu_sizes.GPU_CHECK_SECTIONS`)."""
from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

from fedfew.bench.cases import build_case_sim, case_round
from fedfew.bench.common import _log, _sync
from fedfew.bench.gpu_context import CheckContext, PeakRss, exact_fp32
from fedfew.bench.gpu_sizes import CORRECTNESS_ATOL, PAPER_OVERRIDES, PAPER_ROUNDS
from fedfew.bench.measure import flops_per_sample


def check_correctness(ctx: CheckContext) -> dict:
    """engine=loop and engine=vmap give equal server models after 2 rounds (fp32, TF32 off)
    for the CIFAR-10 CNN and the AG News TextCNN (dropout 0: the engines' dropout masks
    differ by design; fixed-length synthetic token batches), clients of unequal sizes in
    multi-client chunks. Passes when max |theta_loop - theta_vmap| <= :data:`CORRECTNESS_ATOL`."""
    import torch

    from fedfew.core.model_set import flat_parameters

    sz = ctx.sizes
    cases = {
        "cifar10_cnn": {"dataset": "cifar10", "data": "synthetic-cifar10", "sizes": list(sz.correctness_image_sizes),
                        "overrides": []},
        "agnews_textcnn": {"dataset": "agnews", "data": "synthetic-agnews", "sizes": list(sz.correctness_text_sizes),
                           "length": sz.text_length, "vocab": min(5000, sz.text_vocab), "overrides": ["model.dropout=0"]},
    }
    out: dict[str, Any] = {"rounds": 2, "atol": CORRECTNESS_ATOL, "precision": "32-true (TF32 off)", "M": sz.correctness_M, "K": 3}
    with exact_fp32():
        for name, case in cases.items():
            models, losses, info = {}, {}, {}
            for engine in ("loop", "vmap"):
                overrides = case["overrides"] + (ctx.vmap_overrides() if engine == "vmap" else [])
                spec = ctx.spec(**{**case, "overrides": overrides}, M=sz.correctness_M, K=3, engine=engine)
                with tempfile.TemporaryDirectory() as tmp:
                    sim = build_case_sim(spec, Path(tmp))
                    logs = [sim.run_round(r) for r in (1, 2)]
                    models[engine] = torch.stack([flat_parameters(m) for m in sim.module.models]).double().cpu()
                    losses[engine] = torch.stack([torch.as_tensor(lg["loss"]) for lg in logs]).double().cpu()
                    if engine == "vmap":
                        info = {"engine_clients": sim.algorithm.engine.max_clients(),
                                "client_train_sizes": [int(n) for n in sim.num_train.tolist()],
                                "parameters_per_model": int(models[engine].shape[1])}
            diff = float((models["loop"] - models["vmap"]).abs().max())
            finite = bool(torch.isfinite(models["loop"]).all() and torch.isfinite(models["vmap"]).all())
            out[name] = {"max_abs_diff": diff, "max_abs_loss_diff": float((losses["loop"] - losses["vmap"]).abs().max()),
                         "max_abs_param": float(models["loop"].abs().max()), "finite": finite,
                         "passed": finite and diff <= CORRECTNESS_ATOL, **info}
            _log(f"correctness {name}: max |loop - vmap| = {diff:.2e} ({'pass' if out[name]['passed'] else 'FAIL'})")
            ctx.partial(out)
    return out


def profile_round(ctx: CheckContext, engine: str, clients: int = 2) -> dict:
    """torch.profiler over one round of ``clients`` clients (CIFAR-10 CNN, K=3, after a
    warm-up round): the share of the round the GPU spends in kernels, what therefore bounds
    it, and the top operators."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    device = torch.device(ctx.device)
    spec = ctx.spec(dataset="cifar10", data="synthetic-cifar10", pool=ctx.sizes.speed_pool, M=ctx.sizes.speed_M, K=3,
                    engine=engine,
                    overrides=ctx.vmap_overrides() if engine == "vmap" else [])
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with tempfile.TemporaryDirectory() as tmp:
        sim = build_case_sim(spec, Path(tmp))
        sim.cfg.clients_per_round = clients
        sim.run_round(0)
        _sync(device)
        start = time.perf_counter()
        with profile(activities=activities) as prof:
            sim.run_round(1)
            _sync(device)
        wall = time.perf_counter() - start
    events = prof.key_averages()

    def device_us(e) -> float:
        return float(getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0) or 0.0)

    cuda = device.type == "cuda"
    kernels_s = sum(device_us(e) for e in events) / 1e6
    order = sorted(events, key=(device_us if cuda else (lambda e: e.self_cpu_time_total)), reverse=True)
    top = [{"op": e.key, "calls": int(e.count), "self_cpu_ms": e.self_cpu_time_total / 1e3,
            "self_device_ms": device_us(e) / 1e3} for e in order[:8]]
    out: dict[str, Any] = {"engine": engine, "clients": clients, "wall_s": wall, "kernels_s": kernels_s if cuda else None,
                           "cpu_ops_s": sum(e.self_cpu_time_total for e in events) / 1e6, "top": top}
    if cuda:
        busy = kernels_s / wall if wall > 0 else 0.0
        out["gpu_busy"] = busy
        out["bound"] = (f"GPU kernels (busy {busy:.0%} of the profiled round; top: {top[0]['op'] if top else '?'})"
                        if busy >= 0.6 else
                        f"the CPU side: kernel launches and Python between kernels (the GPU computes only {busy:.0%} "
                        "of the profiled round)")
    else:
        out["bound"] = "CPU (no accelerator in this run)"
    return out


def check_speed(ctx: CheckContext) -> dict:
    """Sample-passes per second, loop vs vmap (multi-client chunks on), for the CIFAR-10 CNN
    (M=20, K=3, batch 50) and the AG News TextCNN (M=20, K=3, batch 100), each timed round
    after a warm-up round; useful FLOP/s of every round against the float32 and bfloat16
    matmul peaks measured here; and a torch.profiler view of both engines."""
    sz = ctx.sizes
    out: dict[str, Any] = {"M": sz.speed_M, "K": 3, "peaks": ctx.measure_peaks(),
                           "data": "synthetic (speed does not depend on the values)"}
    cases = {
        "cifar10_cnn": {"dataset": "cifar10", "data": "synthetic-cifar10", "pool": sz.speed_pool},
        "agnews_textcnn": {"dataset": "agnews", "data": "synthetic-agnews", "per_client": sz.text_per_client,
                           "vocab": sz.text_vocab},
    }
    last = 0.0
    for name, case in cases.items():
        res: dict[str, Any] = {}
        out[name] = res
        for engine in ("loop", "vmap"):
            if ctx.left() < last:
                res[engine] = {"skipped": f"out of time ({ctx.left():.0f} s left of the section)"}
                continue
            _log(f"speed {name} engine={engine}")
            begin = time.time()
            spec = ctx.spec(**case, M=sz.speed_M, K=3, engine=engine, warmup=sz.speed_warmup, pure=True, peak=False,
                            overrides=ctx.vmap_overrides() if engine == "vmap" else [])
            r = case_round(spec)
            for key in ("base_host_mb", "peak_host_mb"):  # process-wide ru_maxrss: not this case's
                r.pop(key, None)
            for dtype, peak in ctx.peaks.items():
                r[f"fraction_of_{dtype}_peak"] = r["achieved_flops"] / peak
            res[engine] = r
            last = time.time() - begin
            _log(f"  {r['sample_passes_per_s']:,.0f} sample-passes/s ({r['round_s']:.2f} s/round, "
                 f"{r['engine_clients']} client(s) per chunk)")
        if all("sample_passes_per_s" in res.get(e, {}) for e in ("loop", "vmap")):
            res["vmap_over_loop"] = res["vmap"]["sample_passes_per_s"] / res["loop"]["sample_passes_per_s"]
        ctx.partial(out)
    profiles = {}
    for engine in ("loop", "vmap"):
        if ctx.left() < 10:
            profiles[engine] = {"skipped": f"out of time ({ctx.left():.0f} s left of the section)"}
            continue
        _log(f"profile cifar10_cnn engine={engine} (2 clients)")
        profiles[engine] = profile_round(ctx, engine)
    out["profile"] = profiles
    return out


def check_memory(ctx: CheckContext) -> dict:
    """Peak device memory (host memory on the CPU, sampled) of one round of the vmap engine
    for M = 20, 100, 1,000 (K = 3) and K = 1, 3, 10 (M = 20), one pool of CIFAR-10-shaped
    samples split among the M clients; one chunk width for these points (so M and K act
    alone), plus M = 1,000 with ``engine_clients=auto``."""
    import gc

    import torch

    device = torch.device(ctx.device)
    cuda = device.type == "cuda"
    sz = ctx.sizes
    out: dict[str, Any] = {"engine": "vmap", "pool": sz.memory_pool, "measure": "device" if cuda else "host (sampled RSS)",
                           "points": []}
    last = 0.0
    for M, K, chunk in sz.memory_points:
        point: dict[str, Any] = {"M": M, "K": K, "engine_clients": chunk}
        if ctx.left() < last:
            point["skipped"] = f"out of time ({ctx.left():.0f} s left of the section)"
            out["points"].append(point)
            continue
        _log(f"memory M={M} K={K} engine_clients={chunk}")
        begin = time.time()
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device) if cuda else 0
        spec = ctx.spec(dataset="cifar10", data="synthetic-cifar10", pool=sz.memory_pool, M=M, K=K, engine="vmap",
                        overrides=ctx.vmap_overrides(chunk))
        with tempfile.TemporaryDirectory() as tmp, PeakRss() as rss:
            sim = build_case_sim(spec, Path(tmp))
            point["data_mb"] = sim.data.inputs.numel() * sim.data.inputs.element_size() / 2**20
            _sync(device)
            start = time.perf_counter()
            logs = sim.run_round(1)
            _sync(device)
            point["round_s"] = time.perf_counter() - start
            point["chunk_clients"] = sim.algorithm.engine.max_clients()
            point["loss_finite"] = bool(torch.isfinite(logs["loss"]).all())
            del sim, logs
        point["peak_host_mb"] = rss.peak_mb
        if cuda:
            point["peak_device_mb"] = (torch.cuda.max_memory_allocated(device) - base) / 2**20
            point["peak_reserved_mb"] = torch.cuda.max_memory_reserved(device) / 2**20
        out["points"].append(point)
        last = time.time() - begin
        ctx.partial(out)
    key = "peak_device_mb" if cuda else "peak_host_mb"
    M0, K0, chunk0 = sz.memory_points[0]
    fixed = {(p["M"], p["K"]): p[key] for p in out["points"] if p.get(key) and p["engine_clients"] == chunk0}
    ref = fixed.get((M0, K0))
    if ref:
        out["reference"] = {"M": M0, "K": K0}
        out["ratio_M"] = {str(M): v / ref for (M, K), v in sorted(fixed.items()) if K == K0}
        out["ratio_K"] = {str(K): v / ref for (M, K), v in sorted(fixed.items()) if M == M0}
        largest = max(M for M, K in fixed if K == K0)
        if largest > M0:  # else nothing to compare (the other points ran out of time)
            out["largest_M"] = largest
            out["ratio_largest_M"] = fixed[(largest, K0)] / ref
    return out


def train_rounds(ctx: CheckContext, data, precision: str, max_rounds: int, eval_every: int,
                 seconds: float | None = None, on_evaluation=None) -> dict:
    """FedFew on ``data`` (the paper's CIFAR-10 setting, engine=vmap) round after round until
    ``max_rounds``, ``seconds`` of rounds, or the section's deadline; personalized accuracy
    every ``eval_every`` rounds and after the last round.

    Returns:
        rounds, per-round seconds, first and steady-state (mean after the first) seconds per
        round, evaluation seconds and accuracy curve, useful FLOP/s of a steady round.
    """
    import torch

    device = torch.device(ctx.device)
    spec = ctx.spec(dataset="cifar10", M=data.num_clients, K=3, engine="vmap", precision=precision,
                    overrides=[*PAPER_OVERRIDES, f"rounds={PAPER_ROUNDS}", f"eval_every={eval_every}", *ctx.vmap_overrides()])
    round_s: list[float] = []
    evaluations: list[dict] = []
    finite = True
    with tempfile.TemporaryDirectory() as tmp:
        sim = build_case_sim(spec, Path(tmp), data=data)
        sample = sim.data.batch(sim.ctx.train_index[0][:2])[0]
        flops_sample = flops_per_sample(sim.module.working, tuple(sample.shape[1:]), sample, device, {})
        passes = int(sim.num_train.sum()) * 3 * int(sim.cfg.local_epochs)

        def evaluate(rnd: int) -> None:
            _sync(device)
            start = time.perf_counter()
            summary = sim.evaluate(rnd)["summary"]
            _sync(device)
            evaluations.append({"round": rnd, "seconds": time.perf_counter() - start, "acc_mean": summary["acc_mean"],
                                "acc_weighted": summary["acc_weighted"], "models_served": summary.get("models_served")})

        began = time.perf_counter()
        rnd = 0
        for rnd in range(1, max_rounds + 1):
            _sync(device)
            start = time.perf_counter()
            logs = sim.run_round(rnd)
            _sync(device)
            round_s.append(time.perf_counter() - start)
            finite = finite and bool(torch.isfinite(logs["loss"]).all())
            if rnd % eval_every == 0:
                evaluate(rnd)
                if on_evaluation is not None:
                    on_evaluation(_rounds_summary(round_s, evaluations, flops_sample * passes, passes, finite))
            eval_s = evaluations[-1]["seconds"] if evaluations else 0.0
            need = 2 * (round_s[-1] + eval_s) + eval_s  # one more round (and evaluation), then the final one
            if (seconds is not None and time.perf_counter() - began >= seconds) or ctx.left() < need:
                break
        if not evaluations or evaluations[-1]["round"] != rnd:
            evaluate(rnd)
    out = _rounds_summary(round_s, evaluations, flops_sample * passes, passes, finite)
    out.update(precision=precision, engine="vmap", M=data.num_clients, K=3, eval_every=eval_every,
               wall_s=time.perf_counter() - began)
    return out


def _rounds_summary(round_s: list[float], evaluations: list[dict], round_flops: float, passes: int, finite: bool) -> dict:
    steady = sum(round_s[1:]) / (len(round_s) - 1) if len(round_s) > 1 else round_s[0]
    last = evaluations[-1] if evaluations else {}
    return {"rounds": len(round_s), "round_s": round_s, "first_round_s": round_s[0], "steady_round_s": steady,
            "evaluation_s": sum(e["seconds"] for e in evaluations) / len(evaluations) if evaluations else None,
            "evaluations": evaluations, "acc_mean": last.get("acc_mean"), "acc_weighted": last.get("acc_weighted"),
            "acc_round": last.get("round"), "sample_passes_per_round": passes, "round_flops": round_flops,
            "achieved_flops": round_flops / steady if steady > 0 else None, "loss_finite": finite}


def check_precision(ctx: CheckContext) -> dict:
    """bf16-mixed against fp32 (32-true) after ``precision_rounds`` rounds of the paper's
    CIFAR-10 setting (same seed, partition and initial models): seconds per round, useful
    FLOP/s against the matching matmul peak, and personalized accuracy."""
    sz = ctx.sizes
    data, what = ctx.cifar(sz.precision_M)
    peaks = ctx.measure_peaks()
    out: dict[str, Any] = {"data": what, "rounds_planned": sz.precision_rounds}
    for precision, dtype in (("32-true", "float32"), ("bf16-mixed", "bfloat16")):
        if ctx.left() < 5:
            out[precision] = {"skipped": f"out of time ({ctx.left():.0f} s left of the section)"}
            continue
        _log(f"precision {precision}: {sz.precision_rounds} rounds")
        res = train_rounds(ctx, data, precision, sz.precision_rounds, sz.precision_rounds)
        if res.get("achieved_flops"):
            res["fraction_of_peak"] = res["achieved_flops"] / peaks[dtype]
            res["peak_dtype"] = dtype
        out[precision] = res
        _log(f"  {res['steady_round_s']:.3f} s/round, accuracy {res['acc_mean']:.3f} after {res['rounds']} round(s)")
        ctx.partial(out)
    fp32, bf16 = out.get("32-true", {}), out.get("bf16-mixed", {})
    if "steady_round_s" in fp32 and "steady_round_s" in bf16:
        out["bf16_speedup"] = fp32["steady_round_s"] / bf16["steady_round_s"]
        out["acc_diff"] = bf16["acc_mean"] - fp32["acc_mean"]
    return out


def check_paper(ctx: CheckContext) -> dict:
    """The paper's CIFAR-10 run (Dirichlet 0.5, M=20, K=3, E=1, lr 0.005, batch 50, fp32,
    engine=vmap, evaluation every 10 rounds) for as many rounds as fit in ``paper_seconds``:
    seconds per round, the projected time of all 2,000 rounds (first round + 1,999 steady
    rounds + 200 evaluations), and the accuracy reached so far."""
    sz = ctx.sizes
    data, what = ctx.cifar(sz.paper_M)
    head = {"data": what, "rounds_target": PAPER_ROUNDS, "seconds_budget": sz.paper_seconds}
    _log(f"paper run: {sz.paper_seconds:.0f} s of rounds ({what})")

    def report(res: dict) -> dict:
        evals = PAPER_ROUNDS // sz.paper_eval_every
        total = res["first_round_s"] + (PAPER_ROUNDS - 1) * res["steady_round_s"] + evals * (res["evaluation_s"] or 0.0)
        return {**head, **res, "projected_total_s": total, "projected_total_min": total / 60}

    res = train_rounds(ctx, data, "32-true", PAPER_ROUNDS, sz.paper_eval_every, seconds=sz.paper_seconds,
                       on_evaluation=lambda r: ctx.partial(report(r)))
    out = report(res)
    _log(f"  {out['rounds']} round(s), {out['steady_round_s']:.3f} s/round -> {PAPER_ROUNDS} rounds in "
         f"{out['projected_total_min']:.1f} min; accuracy {out['acc_mean']:.3f} at round {out['acc_round']}")
    return out


CHECKS = {"correctness": check_correctness, "speed": check_speed, "memory": check_memory,
          "precision": check_precision, "paper": check_paper}
