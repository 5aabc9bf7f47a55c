"""`make bench` (python -m fedfew.bench, src/fedfew/bench/): its flower section runs the same digits job
through the simulator and through Flower's simulation engine and reports both side by side."""
from __future__ import annotations

import json
import math

import pytest

from conftest import compose_config
from fedfew.bench import __main__ as cli


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


@pytest.mark.slow
def test_flower_row_beside_the_simulator(tmp_path):
    """Tiny M, 2 rounds: one row with positive finite figures for both engines, run on the same config."""
    out = tmp_path / "bench"
    code = cli.main(["--only", "flower", "--flower-clients", "4", "--flower-rounds", "2", "--flower-algorithms", "fedfew",
                     "--out", str(out)])
    assert code == 0
    report = json.loads((out / "bench.json").read_text())
    section = report["flower"]
    assert "skipped" not in section and section["rounds"] == 2 and section["dataset"] == "digits"
    assert set(report) >= {"machine", "settings", "flower"} and "throughput" not in report
    [point] = section["points"]
    assert point["M"] == 4 and point["algorithm"] == "fedfew" and point["same_config"] is True
    assert "num_clients=4" in point["overrides"] and "rounds=2" in point["overrides"]
    sim, flw = point["simulator"], point["flower"]
    for res in (sim, flw):
        assert "error" not in res, res.get("error")
        assert res["rounds"] == 2 and len(res["round_time_s"]) == 2 and res["num_clients"] == 4
        for key in ("s_per_round", "first_round_s", "startup_s", "fit_s", "wall_s"):
            assert _positive(res[key]), (res["engine"], key, res[key])
        assert math.isfinite(res["teardown_s"]) and res["teardown_s"] >= 0
        assert res["s_per_round"] == res["round_time_s"][1]  # the round after the first
        assert res["startup_s"] + res["fit_s"] <= res["wall_s"]
    assert sim["config_sha"] == flw["config_sha"] and sim["algorithm"] == flw["algorithm"] == "fedfew"
    assert flw["acc_mean"] == sim["acc_mean"]  # Flower runs the simulator's algorithm bit for bit
    assert _positive(point["flower_over_simulator"])
    md = (out / "bench.md").read_text()
    assert "## Flower's simulation engine beside the simulator (digits, 2 rounds, the same job)" in md
    assert sum(line.startswith("| 4 | fedfew | ") for line in md.splitlines()) == 1


def test_no_flower_leaves_the_section_out(tmp_path):
    out = tmp_path / "bench"
    assert cli.main(["--only", "flower", "--no-flower", "--out", str(out)]) == 0
    report = json.loads((out / "bench.json").read_text())
    assert "flower" not in report and "Flower" not in (out / "bench.md").read_text()


def test_usage_names_this_interpreter(capsys):
    from fedfew.core.run_folders import python_command

    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert capsys.readouterr().out.startswith(f"usage: {python_command('fedfew.bench')} ")


def test_peak_host_memory_is_the_kernels_high_water_mark_and_grows_with_a_touched_allocation():
    """results.json's and the benchmark's peak_host figure: Linux's VmHWM of this process."""
    import numpy as np

    from fedfew.core.resources import peak_device_mib, peak_host_mib

    def status_mib(key: str) -> float:
        line = next(line for line in open("/proc/self/status") if line.startswith(key + ":"))
        return int(line.split()[1]) / 1024   # kB

    assert peak_host_mib() == pytest.approx(status_mib("VmHWM"), abs=1.0)
    resident = status_mib("VmRSS")
    block = np.ones(300 * 2**20 // 8)          # 300 MiB, every page written
    assert status_mib("VmRSS") >= resident + 290
    assert peak_host_mib() >= status_mib("VmRSS") - 1 and peak_host_mib() == pytest.approx(status_mib("VmHWM"), abs=1.0)
    del block
    assert peak_device_mib("cpu") is None


@pytest.mark.parametrize("algorithm", ["fedavg", "ifca", "fedem", "fedfew"])
def test_every_cpu_run_fixes_glibcs_mmap_threshold(algorithm, tmp_path, cpu_fabric, monkeypatch):
    """A CPU Simulation of any method fixes glibc's mmap threshold at engines.base.MMAP_THRESHOLD, so
    that large per-round buffers (the averaging methods' (K, D) float64 sums: 28 MiB for 4 CIFAR CNNs)
    are mapped and unmapped rather than fragmenting the heap. Before, only the engine's methods (FedFew)
    did: FedEM's and IFCA's RSS grew by ~27 MiB a round at M = 1,000 (2026-12-07), to 5.96 GiB by round
    200, and a probe with MALLOC_MMAP_THRESHOLD_ at the same value stayed flat."""
    from fedfew.engines import base
    from fedfew.simulator.simulation import Simulation

    calls = []

    class FakeLibc:
        def mallopt(self, param, value):
            calls.append((param, value))

        def malloc_trim(self, pad):
            return 0

    monkeypatch.setattr(base, "_glibc", lambda: FakeLibc())
    monkeypatch.setattr(base, "_host_policy_set", False)
    cfg = compose_config("dataset=digits", "num_clients=4", "partition=iid", f"algorithm={algorithm}",
                         "logger=none", "rounds=1")
    Simulation(cfg, cpu_fabric, tmp_path)
    assert calls and set(calls) == {(base._M_MMAP_THRESHOLD, base.MMAP_THRESHOLD)}
