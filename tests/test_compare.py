"""The comparison runner: the table from hand-made results, and a small real comparison that
is interrupted and resumed."""
from __future__ import annotations

import csv
import io
import json
import math

import pytest

from fedfew import compare
from fedfew.compare import MAJORITY, CompareError, Run, summarize, to_csv, to_markdown


def fake_results(acc_mean: float, majority: list[float], partition: str = "p0", rounds: int = 5) -> dict:
    config = {
        "rounds": rounds, "local_epochs": 1, "dataset": {"batch_size": 50}, "optim": {"lr": 0.3},
        "num_clients": len(majority), "participation": 1.0, "clients_per_round": None,
        "partition": {"name": "dirichlet", "alpha": 0.5}, "model": {"name": "mlp"},
    }
    return {
        "config": config,
        "summary": {"acc_mean": acc_mean, "acc_std": 0.1, "acc_min": acc_mean - 0.2, "acc_max": acc_mean + 0.1,
                    "acc_weighted": acc_mean + 0.01, "majority_acc_mean": sum(majority) / len(majority),
                    "majority_acc_weighted": 0.5},
        "clients": [{"majority_acc": m} for m in majority],
        "seconds_per_round": 2.0,
        "partition_hash": partition,
    }


def test_summary_rows_by_hand():
    results = {
        ("a", 0): fake_results(0.8, [0.5, 0.3], "h0"),
        ("a", 1): fake_results(0.6, [0.2, 0.2], "h1"),
        ("b", 0): fake_results(0.9, [0.5, 0.3], "h0"),
    }
    params = {("a", 0): (30, 30, 10), ("b", 0): (0, 0, 10)}
    rows, warnings = summarize(results, ["b", "a", "missing"], params)
    assert warnings == []
    assert [r["algorithm"] for r in rows] == ["b", "a", MAJORITY]
    b, a, maj = rows
    assert a["runs"] == 2 and b["runs"] == 1
    assert a["acc_mean"] == pytest.approx(0.7)
    assert a["acc_mean_std_over_seeds"] == pytest.approx(math.sqrt(0.02))  # sample std of 0.8, 0.6
    assert math.isnan(b["acc_mean_std_over_seeds"])                       # one seed: no spread
    assert a["acc_min"] == pytest.approx(0.5) and a["acc_max"] == pytest.approx(0.8)
    assert a["acc_weighted"] == pytest.approx(0.71)
    assert (a["params_up_per_client_round"], b["params_down_per_client_round"]) == (30, 0)
    # majority label per seed: seed 0 clients (0.5, 0.3), seed 1 (0.2, 0.2)
    assert maj["runs"] == 2
    assert maj["acc_mean"] == pytest.approx(0.3)                   # mean of 0.4 and 0.2
    assert maj["acc_mean_std_over_seeds"] == pytest.approx(math.sqrt(0.02))
    assert maj["acc_std_across_clients"] == pytest.approx(0.05)     # mean of 0.1 and 0
    assert maj["acc_min"] == pytest.approx(0.25) and maj["acc_max"] == pytest.approx(0.35)
    table = list(csv.DictReader(io.StringIO(to_csv(rows))))
    assert [r["algorithm"] for r in table] == ["b", "a", MAJORITY] and table[1]["acc_mean"] == "0.700000"
    assert table[0]["acc_mean_std_over_seeds"] == ""
    md = to_markdown(rows, "t")
    assert "| a | 0.7000 ± 0.1414 |" in md and "| b | 0.9000 |" in md and "30 / 30" in md


def test_mismatched_partitions_are_refused_and_budget_differences_flagged():
    with pytest.raises(CompareError, match="different partitions"):
        summarize({("a", 0): fake_results(0.8, [0.5], "h0"), ("b", 0): fake_results(0.9, [0.5], "OTHER")},
                  ["a", "b"], {("a", 0): (1, 1, 1), ("b", 0): (1, 1, 1)})
    _, warnings = summarize({("a", 0): fake_results(0.8, [0.5]), ("b", 0): fake_results(0.9, [0.5], rounds=9)},
                            ["a", "b"], {("a", 0): (1, 1, 1), ("b", 0): (1, 1, 1)})
    assert len(warnings) == 1 and "budget" in warnings[0]


def test_the_comparison_sets_dataset_algorithm_and_seed_itself(tmp_path):
    with pytest.raises(CompareError, match="set by the comparison"):
        compare.main(["--algorithms", "fedavg", "--out", str(tmp_path), "--", "seed=3"])
    with pytest.raises(ValueError, match="unknown algorithm 'nosuch'"):
        compare.main(["--algorithms", "nosuch", "--out", str(tmp_path)])


@pytest.mark.slow
def test_small_comparison_writes_the_table_and_resumes(tmp_path, capsys):
    out = tmp_path / "cmp"
    extra = ["--", "rounds=2", "num_clients=4", "logger=none", "trainer.threads=1"]

    def argv(*algorithms, extra=extra):
        return ["--dataset", "digits", "--algorithms", *algorithms, "--seeds", "0", "--out", str(out), *extra]

    # a comparison stopped after its first run ...
    assert compare.main(argv("fedavg")) == 0
    kept = out / "fedavg" / "seed0" / "results.json"
    stamp = kept.stat().st_mtime_ns
    capsys.readouterr()
    # ... resumes: the finished run is reused, only the missing one trains
    assert compare.main(argv("fedavg", "local")) == 0
    printed = capsys.readouterr().out
    assert "reusing 1 finished run(s): fedavg/seed0" in printed and "[1/1] local seed 0" in printed
    assert kept.stat().st_mtime_ns == stamp
    rows = {r["algorithm"]: r for r in csv.DictReader((out / "compare.csv").open())}
    assert list(rows) == ["fedavg", "local", MAJORITY]
    # d of the digits MLP (64 -> 128 -> 10): 64*128 + 128 + 128*10 + 10 = 9,610
    assert rows["fedavg"]["params_up_per_client_round"] == "9610" and rows["local"]["params_up_per_client_round"] == "0"
    results = {a: json.loads((out / a / "seed0" / "results.json").read_text()) for a in ("fedavg", "local")}
    for alg, res in results.items():
        assert float(rows[alg]["acc_mean"]) == pytest.approx(res["summary"]["acc_mean"], abs=1e-6)
        assert res["config"]["rounds"] == 2 and res["config"]["num_clients"] == 4
    assert results["fedavg"]["partition_hash"] == results["local"]["partition_hash"]  # the same partition
    majority = [c["majority_acc"] for c in results["local"]["clients"]]
    assert float(rows[MAJORITY]["acc_mean"]) == pytest.approx(sum(majority) / len(majority), abs=1e-6)
    assert "| fedavg |" in (out / "compare.md").read_text()

    # results made with other overrides are not silently reused
    with pytest.raises(CompareError, match="produced with overrides"):
        compare.main(argv("fedavg", extra=["--", "rounds=3", "num_clients=4", "logger=none", "trainer.threads=1"]))
    assert kept.stat().st_mtime_ns == stamp


def test_run_paths_and_overrides(tmp_path):
    run = Run("ifca", 2, tmp_path, ("rounds=3", "hydra.job.chdir=false"), "agnews")
    assert run.dir == tmp_path / "ifca" / "seed2"
    assert run.overrides()[:4] == ["dataset=agnews", "algorithm=ifca", "seed=2", "rounds=3"]
    assert run.overrides()[-1] == f"hydra.run.dir={run.dir}"
    assert run.task_overrides() == ["dataset=agnews", "algorithm=ifca", "seed=2", "rounds=3"]
