"""`make gpu-check` (scripts/gpu_check.sh -> python -m fedfew.bench --gpu-check): its CPU smoke
mode runs every section of the GPU check at tiny sizes, and bench.json holds real values
(checked against each other and against hand computations); the offline wheel install picks
the right wheels; CIFAR-10 subsets unpack as documented; the targets' pass/fail logic."""
from __future__ import annotations

import base64
import hashlib
import json
import math
import os
import subprocess
import sys
import tarfile
import zipfile
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fedfew.bench import __main__ as cli
from fedfew.bench import gpu_data, gpu_report, gpu_sections, gpu_sizes, synthetic

ROOT = Path(__file__).resolve().parents[1]
CIFAR_TARS = ("cifar10/cifar10_train_jpg.tar.gz", "cifar10/cifar10_test_jpg.tar.gz")


def _cifar_data_dir(tmp_path: Path) -> tuple[Path, bool]:
    """(data dir for FEDFEW_DATA_DIR, whether it holds the real CIFAR-10 tarballs). Without them
    the check runs on synthetic stand-ins, except under FEDFEW_REQUIRE_DATA=1 (CI), where a
    missing file fails the test."""
    raw = os.environ.get("FEDFEW_DATA_DIR", "").strip()
    if raw and all((Path(raw) / rel).is_file() for rel in CIFAR_TARS):
        return Path(raw).resolve(), True
    if os.environ.get("FEDFEW_REQUIRE_DATA", "").strip() == "1":
        pytest.fail(f"real data required (FEDFEW_REQUIRE_DATA=1) but {CIFAR_TARS} are not under FEDFEW_DATA_DIR={raw!r}")
    empty = tmp_path / "no-data"
    empty.mkdir()
    return empty, False


def _wheel(folder: Path, dist: str, version: str, tag: str, module: str | None = None) -> Path:
    """A minimal valid wheel ``dist-version-tag.whl`` (one module ``module`` printing nothing)."""
    name = dist.replace("-", "_")
    path = folder / f"{name}-{version}-{tag}.whl"
    info = f"{name}-{version}.dist-info"
    files = {
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n",
        f"{info}/WHEEL": f"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: {tag}\n",
    }
    if module:
        files[f"{module}.py"] = "VALUE = 42\n"
    records = []
    for arcname, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        records.append(f"{arcname},sha256={digest},{len(text.encode())}")
    records.append(f"{info}/RECORD,,")
    files[f"{info}/RECORD"] = "\n".join(records) + "\n"
    with zipfile.ZipFile(path, "w") as zf:
        for arcname, text in files.items():
            zf.writestr(arcname, text)
    return path


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """One run of `bash scripts/gpu_check.sh --device cpu` (the smoke mode, as CI runs it) with
    a wheel folder holding: a new pure wheel (installed), a wheel of an installed distribution
    at its installed version (skipped) and a wheel for another Python (skipped)."""
    tmp = tmp_path_factory.mktemp("gpu_check")
    data_dir, real = _cifar_data_dir(tmp)
    wheels = tmp / "wheels"
    wheels.mkdir()
    _wheel(wheels, "fedfew-gpu-probe", "0.1", "py3-none-any", module="fedfew_gpu_probe")
    _wheel(wheels, "omegaconf", metadata.version("omegaconf"), "py3-none-any")
    _wheel(wheels, "fedfew-gpu-old", "0.1", "cp27-cp27mu-manylinux1_x86_64")
    out = tmp / "out"
    env = dict(os.environ, OUT=str(out), GPU_CHECK_PYTHON=sys.executable, GPU_WHEELS_DIR=str(wheels),
               GPU_DATA_DIR=str(tmp / "no-gpu-data"), FEDFEW_DATA_DIR=str(data_dir), TMPDIR=str(tmp))
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--device", "cpu"], cwd=tmp, env=env,
                          capture_output=True, text=True, timeout=900)
    report = json.loads((out / "bench.json").read_text()) if (out / "bench.json").exists() else None
    md = (out / "bench.md").read_text() if (out / "bench.md").exists() else ""
    return {"proc": proc, "report": report, "md": md, "real": real, "tmp": tmp}


def _sections(smoke) -> dict:
    assert smoke["proc"].returncode == 0, smoke["proc"].stdout[-4000:] + smoke["proc"].stderr[-4000:]
    return smoke["report"]["sections"]


@pytest.mark.slow
def test_smoke_mode_runs_every_section_and_says_so(smoke):
    proc, report, md = smoke["proc"], smoke["report"], smoke["md"]
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "CPU smoke mode" in proc.stdout and "**Mode: CPU smoke mode**" in md
    assert report["mode"] == "cpu" and report["smoke"] is True
    assert report["machine"]["device"] == "cpu" and report["machine"]["torch"]
    assert {name: s["status"] for name, s in report["sections"].items()} == {name: "done" for name in gpu_sizes.GPU_CHECK_SECTIONS}
    for line in ("**Correctness**", "**Engine speed**", "**Precision**", "**The paper's run**", "**Memory**",
                 "**Utilisation**"):
        assert sum(row.startswith(f"- {line}") for row in md.splitlines()) == 1, line
    assert report["wall_s"] > 0 and report["budget_s"] == gpu_sizes.CHECK_SIZES["cpu"].budget_s
    # the driver removed its scratch folder and the script its package folder
    assert not list(smoke["tmp"].glob("fedfew-gpu-check-*")) and not list(smoke["tmp"].glob("fedfew-gpu-site.*"))


@pytest.mark.slow
def test_smoke_installs_only_the_wheels_this_python_lacks(smoke):
    out = smoke["proc"].stdout + smoke["proc"].stderr
    assert "fedfew-gpu-probe 0.1: from " in out
    assert f"omegaconf {metadata.version('omegaconf')}: installed already" in out
    assert "fedfew_gpu_old-0.1-cp27-cp27mu-manylinux1_x86_64.whl: not built for this Python, skipped" in out
    assert "installed 1 wheel(s) into" in out


@pytest.mark.slow
def test_smoke_loop_equals_vmap(smoke):
    corr = _sections(smoke)["correctness"]
    for model in ("cifar10_cnn", "agnews_textcnn"):
        r = corr[model]
        assert r["finite"] and r["passed"] and 0 <= r["max_abs_diff"] <= gpu_sizes.CORRECTNESS_ATOL
        assert r["max_abs_param"] > 10 * gpu_sizes.CORRECTNESS_ATOL  # models of real size, not all zeros
        # multi-client chunks of unequal clients (zero-weight padding) were exercised
        assert r["engine_clients"] == int(gpu_sizes.CHECK_SIZES["cpu"].engine_clients) > 1
        assert len(set(r["client_train_sizes"])) == len(r["client_train_sizes"])


@pytest.mark.slow
def test_smoke_speed_figures_are_consistent(smoke):
    speed = _sections(smoke)["speed"]
    sizes = gpu_sizes.CHECK_SIZES["cpu"]
    assert speed["peaks"]["float32"] > 0 and speed["peaks"]["bfloat16"] > 0
    train_per_client = {"cifar10_cnn": sizes.speed_pool // sizes.speed_M, "agnews_textcnn": sizes.text_per_client}
    for model, per_client in train_per_client.items():
        for engine in ("loop", "vmap"):
            r = speed[model][engine]
            # every client's train split (a quarter held out), through each of the K=3 models
            train = sizes.speed_M * (per_client - per_client // 4 if model == "agnews_textcnn"
                                     else per_client - round(per_client * synthetic.CIFAR_TEST_FRACTION))
            assert r["train_samples"] == train and r["sample_passes"] == 3 * train
            assert r["sample_passes_per_s"] == pytest.approx(r["sample_passes"] / r["round_s"])
            assert r["pure_sample_passes"] == r["sample_passes"] and r["loss_finite"]
            assert r["achieved_flops"] == pytest.approx(r["round_flops"] / r["round_s"]) and r["round_flops"] > 0
            assert r["fraction_of_float32_peak"] == pytest.approx(r["achieved_flops"] / speed["peaks"]["float32"])
        assert speed[model]["vmap_over_loop"] == pytest.approx(
            speed[model]["vmap"]["sample_passes_per_s"] / speed[model]["loop"]["sample_passes_per_s"])
        assert speed[model]["vmap"]["engine_clients"] > 1 and speed[model]["loop"]["engine_clients"] == 1
    for engine in ("loop", "vmap"):
        p = speed["profile"][engine]
        assert p["wall_s"] > 0 and p["top"] and p["top"][0]["self_cpu_ms"] > 0


@pytest.mark.slow
def test_smoke_memory_points(smoke):
    mem = _sections(smoke)["memory"]
    sizes = gpu_sizes.CHECK_SIZES["cpu"]
    assert [(p["M"], p["K"], p["engine_clients"]) for p in mem["points"]] == list(sizes.memory_points)
    for p in mem["points"]:
        assert p["peak_host_mb"] > 50 and p["round_s"] > 0 and p["loss_finite"]
        assert p["data_mb"] == pytest.approx(sizes.memory_pool * 3 * 32 * 32 * 4 / 2**20)
        assert p["chunk_clients"] == (1 if p["engine_clients"] == "auto" else int(p["engine_clients"]))
    ref = mem["points"][0]["peak_host_mb"]
    largest = max((p for p in mem["points"] if p["engine_clients"] != "auto" and p["K"] == 3), key=lambda p: p["M"])
    assert mem["ratio_largest_M"] == pytest.approx(largest["peak_host_mb"] / ref)
    memory_line = next(row for row in smoke["md"].splitlines() if row.startswith("- **Memory**"))
    assert f"M={largest['M']}: " in memory_line and "K=1: " in memory_line


@pytest.mark.slow
def test_smoke_precision_and_paper_run(smoke):
    sec = _sections(smoke)
    sizes = gpu_sizes.CHECK_SIZES["cpu"]
    prec, paper = sec["precision"], sec["paper"]
    for precision in ("32-true", "bf16-mixed"):
        r = prec[precision]
        assert r["rounds"] == sizes.precision_rounds and r["loss_finite"] and 0 <= r["acc_mean"] <= 1
        assert r["steady_round_s"] == pytest.approx(sum(r["round_s"][1:]) / (len(r["round_s"]) - 1))
        assert r["evaluations"][-1]["round"] == r["rounds"]
    assert prec["bf16_speedup"] == pytest.approx(prec["32-true"]["steady_round_s"] / prec["bf16-mixed"]["steady_round_s"])
    assert prec["acc_diff"] == pytest.approx(prec["bf16-mixed"]["acc_mean"] - prec["32-true"]["acc_mean"])
    assert paper["rounds"] >= 1 and 0 <= paper["acc_mean"] <= 1 and paper["acc_round"] == paper["rounds"]
    evaluations = gpu_sizes.PAPER_ROUNDS // sizes.paper_eval_every
    assert paper["projected_total_s"] == pytest.approx(
        paper["first_round_s"] + (gpu_sizes.PAPER_ROUNDS - 1) * paper["steady_round_s"] + evaluations * paper["evaluation_s"])
    data = smoke["report"]["data"]
    if smoke["real"]:
        per_class = sizes.cifar_per_class
        assert data["status"] == "ready" and data["images"] == 10 * sum(per_class)
        assert data["train"] == 10 * per_class[0] and data["test"] == 10 * per_class[1]
        assert prec["data"].startswith("real CIFAR-10") and paper["data"].startswith("real CIFAR-10")
    else:
        assert prec["data"].startswith("synthetic") and paper["data"].startswith("synthetic")


@pytest.mark.slow
def test_smoke_targets_are_reported_not_judged_on_the_cpu(smoke):
    _sections(smoke)
    targets = {t["name"]: t for t in smoke["report"]["targets"]}
    assert targets["correctness cifar10_cnn"]["passed"] is True and targets["correctness agnews_textcnn"]["passed"] is True
    for name in ("vmap speed-up", "paper run projection", "memory vs M"):
        assert targets[name]["passed"] is None and isinstance(targets[name]["measured_passed"], bool)
        assert targets[name]["gpu_target"]
    assert "n/a in the CPU smoke mode" in smoke["md"]


# ---- fast unit tests -----------------------------------------------------------------------

def _fake_cifar(src: Path, per_class: int) -> None:
    """Both tarballs in the shared data's layout: <split>/<class>/NNNN.jpg, grouped by class,
    pixel value = image number (so a file can be traced back)."""
    src.mkdir(parents=True)
    for split in ("train", "test"):
        tree = src / f"tree-{split}"
        for cls in ("cat", "dog"):
            for i in range(per_class):
                path = tree / split / cls / f"{i:04d}.jpg"
                path.parent.mkdir(parents=True, exist_ok=True)
                Image.fromarray(np.full((32, 32, 3), 10 * i, dtype=np.uint8)).save(path)
        with tarfile.open(src / f"cifar10_{split}_jpg.tar.gz", "w:gz") as tar:
            tar.add(tree / split, arcname=split)


def test_unpack_cifar_whole_and_smoke_subset(tmp_path):
    src = tmp_path / "src"
    _fake_cifar(src, per_class=6)
    counts = gpu_data.unpack_cifar(src, tmp_path / "all" / "cifar10", None)
    assert counts == {"train": 12, "test": 12}
    assert sorted(p.name for p in (tmp_path / "all/cifar10/train/dog").iterdir()) == [f"{i:04d}.jpg" for i in range(6)]
    # the subset: from the test tarball alone, per class the first 3 -> train/, the next 2 -> test/
    counts = gpu_data.unpack_cifar(src, tmp_path / "sub" / "cifar10", (3, 2))
    assert counts == {"train": 6, "test": 4}
    for cls in ("cat", "dog"):
        train = sorted(p.name for p in (tmp_path / "sub/cifar10/train" / cls).iterdir())
        test = sorted(p.name for p in (tmp_path / "sub/cifar10/test" / cls).iterdir())
        assert sorted(train + test) == [f"{i:04d}.jpg" for i in range(5)] and len(train) == 3
    # an unpacked tree gives the same subset
    tree = tmp_path / "tree"
    for split in ("train", "test"):
        (tree / split).parent.mkdir(parents=True, exist_ok=True)
        (src / f"tree-{split}" / split).rename(tree / split)
    assert gpu_data.unpack_cifar(tree, tmp_path / "sub2" / "cifar10", (3, 2)) == {"train": 6, "test": 4}
    with pytest.raises(FileNotFoundError, match="make gpu-data"):
        gpu_data.unpack_cifar(tmp_path / "nothing", tmp_path / "x", None)


def _report(mode: str, ratio: float, total_s: float, mem_ratio: float, diff: float) -> dict:
    corr = {m: {"max_abs_diff": diff, "passed": diff <= gpu_sizes.CORRECTNESS_ATOL} for m in ("cifar10_cnn", "agnews_textcnn")}
    return {"mode": mode, "sections": {
        "correctness": {"status": "done", **corr},
        "speed": {"status": "done", "cifar10_cnn": {"vmap_over_loop": ratio},
                  "profile": {"vmap": {"bound": "the CPU side: kernel launches"}}},
        "paper": {"status": "done", "projected_total_s": total_s},
        "memory": {"status": "done", "ratio_largest_M": mem_ratio, "largest_M": 1000, "reference": {"M": 20, "K": 3}},
    }}


def test_targets_pass_and_fail_at_their_thresholds():
    ok = {t["name"]: t for t in gpu_report.gpu_check_targets(_report("cuda", 5.0, 599.0, 1.2, 1e-4))}
    assert all(t["passed"] is True for t in ok.values())
    bad = {t["name"]: t for t in gpu_report.gpu_check_targets(_report("cuda", 4.99, 600.0, 1.21, 1.1e-4))}
    assert all(t["passed"] is False for t in bad.values())
    assert bad["vmap speed-up"]["bound"] == "the CPU side: kernel launches"
    md = gpu_report.render_gpu_check({**_report("cuda", 4.99, 600.0, 1.21, 1e-5), "targets": list(bad.values())})
    assert "**MISSED**: bound by the CPU side: kernel launches" in md
    # on the CPU, the GPU targets are shown but not judged; the engines must agree everywhere
    cpu = {t["name"]: t for t in gpu_report.gpu_check_targets(_report("cpu", 0.9, 6000.0, 0.9, 2e-4))}
    assert cpu["vmap speed-up"]["passed"] is None and cpu["vmap speed-up"]["measured_passed"] is False
    assert cpu["memory vs M"]["passed"] is None and cpu["memory vs M"]["measured_passed"] is True
    assert cpu["correctness cifar10_cnn"]["passed"] is False
    empty = gpu_report.gpu_check_targets({"mode": "cuda", "sections": {}})
    assert all(t["passed"] is None and t["value"] is None for t in empty)


def test_rounds_summary_projection_inputs():
    evals = [{"round": 10, "seconds": 2.0, "acc_mean": 0.4, "acc_weighted": 0.5}]
    out = gpu_sections._rounds_summary([3.0, 1.0, 2.0], evals, round_flops=6e9, passes=100, finite=True)
    assert out["steady_round_s"] == 1.5 and out["first_round_s"] == 3.0 and out["evaluation_s"] == 2.0
    assert out["achieved_flops"] == 4e9 and out["acc_mean"] == 0.4 and out["acc_round"] == 10
    assert math.isclose(gpu_sections._rounds_summary([2.0], [], 1.0, 1, True)["steady_round_s"], 2.0)


def test_bad_arguments_fail_before_any_work(tmp_path, capsys):
    code = cli.main(["--gpu-check", "--device", "cpu", "--out", str(tmp_path / "o"), "--cifar-dir", str(tmp_path / "nope")])
    assert code == 2 and "--cifar-dir" in capsys.readouterr().err and not (tmp_path / "o").exists()
    code = cli.main(["--gpu-check", "--device", "cpu", "--out", str(tmp_path / "o"), "--only", "speed", "warp"])
    err = capsys.readouterr().err
    assert code == 2 and "warp" in err and "correctness" in err and not (tmp_path / "o").exists()


@pytest.mark.slow
def test_a_crashed_section_is_reported_and_the_rest_still_runs(tmp_path):
    """The runner dies inside a section: bench.json says so, and a fresh runner does the rest."""
    out = tmp_path / "out"
    env = dict(os.environ, FEDFEW_GPU_CHECK_FAULT="memory:crash", TMPDIR=str(tmp_path))
    proc = subprocess.run([sys.executable, "-m", "fedfew.bench", "--gpu-check", "--device", "cpu", "--out", str(out),
                           "--only", "memory", "correctness"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    report = json.loads((out / "bench.json").read_text())
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert "restarting the runner for: correctness" in proc.stdout
    memory, correctness = report["sections"]["memory"], report["sections"]["correctness"]
    assert memory["status"] == "error" and "exited with code 7 during this section" in memory["error"]
    assert correctness["status"] == "done" and correctness["cifar10_cnn"]["passed"]
    assert report["data"]["source"] is None and "memory: error" in (out / "bench.md").read_text()
