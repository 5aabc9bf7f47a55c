"""The comparison runner: the table from hand-made results, and a small real comparison that
is interrupted and resumed."""
from __future__ import annotations

import csv
import io
import json
import re
import math
import os

import pytest

from fedfew import compare
from fedfew.experiments import comparison
from fedfew.experiments import comparison_table
from pathlib import Path
from fedfew.config import presets
from fedfew.experiments import tuning
from fedfew.experiments.comparison_table import MAJORITY, CompareError, summarize, to_csv, to_markdown
from fedfew.experiments.comparison import Run
from fedfew.core.run_folders import CHECKOUT


def fake_results(acc_mean: float, majority: list[float], partition: str = "p0", rounds: int = 5,
                 evals: tuple[float, ...] = (), lr: float = 0.3, algorithm: str = "fedavg") -> dict:
    """A results.json: acc_weighted = acc_mean + 0.01, acc_min = acc_mean - 0.2; ``evals``: the
    client-mean accuracy of the evaluations before the final one (same offsets)."""
    config = {
        "rounds": rounds, "local_epochs": 1, "dataset": {"batch_size": 50}, "optim": {"lr": lr},
        "num_clients": len(majority), "participation": 1.0, "clients_per_round": None,
        "partition": {"name": "dirichlet", "alpha": 0.5}, "model": {"name": "mlp"},
        "algorithm": {"name": algorithm},
    }
    summary = {"acc_mean": acc_mean, "acc_std": 0.1, "acc_min": acc_mean - 0.2, "acc_max": acc_mean + 0.1,
               "acc_weighted": acc_mean + 0.01, "majority_acc_mean": sum(majority) / len(majority),
               "majority_acc_weighted": 0.5}
    evaluations = [{"round": r + 1, "acc_mean": a, "acc_weighted": a + 0.01, "acc_min": a - 0.2}
                   for r, a in enumerate((*evals, acc_mean))]
    return {
        "config": config, "summary": summary, "evaluations": evaluations,
        "clients": [{"majority_acc": m} for m in majority],
        "seconds_per_round": 2.0, "wall_time_s": 10.0,
        "partition_hash": partition,
        "budget": {"rounds": rounds, "server_models": 1, "num_parameters": 10, "participants_per_round": len(majority),
                   "params_up_per_client_round": 10, "params_down_per_client_round": 10, "bytes_per_parameter": 4.0,
                   "bytes_up_per_client_round": 40, "bytes_down_per_client_round": 40,
                   "bytes_up_per_round": 40 * len(majority), "bytes_down_per_round": 40 * len(majority),
                   "local_steps": 100},
    }


def sample_std(xs):
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def test_spread_and_paired_differences_equal_hand_computations():
    fedfew = {0: (0.80, (0.5, 0.6, 0.7, 0.75)), 1: (0.70, (0.5, 0.6, 0.6, 0.8)), 2: (0.90, (0.4, 0.6, 0.8, 0.85))}
    other = {0: (0.85, (0.5, 0.6, 0.9, 0.8)), 1: (0.72, (0.5, 0.6, 0.7, 0.7)), 2: (0.87, (0.4, 0.6, 0.8, 0.9))}
    results = {("fedfew", s): fake_results(a, [0.5, 0.3], f"h{s}", evals=e) for s, (a, e) in fedfew.items()}
    results.update({("b", s): fake_results(a, [0.5, 0.3], f"h{s}", evals=e) for s, (a, e) in other.items()})
    rows, warnings = summarize(results, ["fedfew", "b"], reference="fedfew")
    assert warnings == []
    f, b, maj = rows
    assert [r["algorithm"] for r in rows] == ["fedfew", "b", MAJORITY] and b["seeds"] == 3
    # mean and sample std over seeds: fedfew 0.8, 0.7, 0.9 -> 0.8 ± 0.1
    assert f["acc_mean"] == pytest.approx(0.8) and f["acc_mean_std"] == pytest.approx(0.1)
    assert f["acc_weighted"] == pytest.approx(0.81) and f["acc_weighted_std"] == pytest.approx(0.1)
    assert f["acc_min"] == pytest.approx(0.6) and f["acc_min_std"] == pytest.approx(0.1)
    # last three evaluations: (0.7+0.75+0.8)/3, (0.6+0.8+0.7)/3, (0.8+0.85+0.9)/3
    last3 = [(0.7 + 0.75 + 0.8) / 3, (0.6 + 0.8 + 0.7) / 3, (0.8 + 0.85 + 0.9) / 3]
    assert f["acc_mean_last3"] == pytest.approx(sum(last3) / 3)
    assert f["acc_mean_last3_std"] == pytest.approx(sample_std(last3))
    assert f["acc_min_last3"] == pytest.approx(sum(last3) / 3 - 0.2)
    # paired differences b - fedfew per seed: +0.05, +0.02, -0.03
    diffs = [0.85 - 0.80, 0.72 - 0.70, 0.87 - 0.90]
    assert b["diff_acc_mean"] == pytest.approx(0.04 / 3)
    assert b["diff_acc_mean_std"] == pytest.approx(math.sqrt(((0.05 - 0.04 / 3) ** 2 + (0.02 - 0.04 / 3) ** 2
                                                             + (-0.03 - 0.04 / 3) ** 2) / 2))
    assert b["diff_acc_mean_std"] == pytest.approx(sample_std(diffs))
    assert b["diff_acc_mean_per_seed"] == "0:+0.0500 1:+0.0200 2:-0.0300" and b["diff_seeds"] == 3
    b_last3 = [(0.9 + 0.8 + 0.85) / 3, (0.7 + 0.7 + 0.72) / 3, (0.8 + 0.9 + 0.87) / 3]
    assert b["diff_acc_mean_last3"] == pytest.approx(sum(x - y for x, y in zip(b_last3, last3)) / 3)
    assert f["diff_acc_mean"] == 0.0  # the reference against itself
    # the spread of the paired difference is not the difference of the spreads
    assert b["diff_acc_mean_std"] != pytest.approx(abs(b["acc_mean_std"] - f["acc_mean_std"]))
    # majority label: clients 0.5 and 0.3 on every seed
    assert maj["acc_mean"] == pytest.approx(0.4) and maj["acc_mean_std"] == pytest.approx(0.0)
    assert maj["acc_min"] == pytest.approx(0.3) and maj["diff_acc_mean"] == pytest.approx(0.4 - 0.8)
    # budget columns from results.json's budget
    assert (b["bytes_up_per_round"], b["local_steps"], b["server_models"]) == (80, 100, 1)
    table = {r["algorithm"]: r for r in csv.DictReader(io.StringIO(to_csv(rows)))}
    for col in ("acc_mean", "acc_mean_std", "acc_min", "seeds", "bytes_up_per_round", "bytes_down_per_round"):
        assert col in table["b"]
    assert table["b"]["seeds"] == "3" and table["b"]["acc_mean"] == f"{(0.85 + 0.72 + 0.87) / 3:.6f}"
    md = to_markdown(rows, "t")
    assert "| b | 0.8133 ± 0.0814 |" in md and "+0.0133 ± 0.0404 [0:+0.0500 1:+0.0200 2:-0.0300]" in md
    assert "**fedfew is not first**" in comparison_table.ranking_note(rows, "fedfew")


def test_a_method_below_the_majority_label_on_some_seed_is_flagged():
    # majority label: clients 0.5 and 0.3 -> 0.4 on every seed; "bad" is below it on seed 1 only
    results = {("fedfew", s): fake_results(0.8, [0.5, 0.3], f"h{s}") for s in (0, 1)}
    results.update({("bad", 0): fake_results(0.45, [0.5, 0.3], "h0"), ("bad", 1): fake_results(0.35, [0.5, 0.3], "h1")})
    rows, warnings = summarize(results, ["fedfew", "bad"], reference="fedfew")
    assert len(warnings) == 1
    assert warnings[0].startswith("**bad is below the majority label** (seed 1: 0.3500 < 0.4000): it learned less")
    assert "seed 0" not in warnings[0]
    assert "**bad is below the majority label**" in to_markdown(rows, "t", warnings)


def test_clients_whose_scored_model_diverged_are_counted_per_seed_even_above_the_majority_label():
    # "part" scores 0.7 on both seeds, above the majority label (0.4), but on seed 1 the scored
    # model of one of its two clients gives a NaN loss: that must be said, not averaged in silently
    results = {("fedfew", s): fake_results(0.8, [0.5, 0.3], f"h{s}") for s in (0, 1)}
    results.update({("part", s): fake_results(0.7, [0.5, 0.3], f"h{s}") for s in (0, 1)})
    for s in (0, 1):
        for alg in ("fedfew", "part"):
            results[(alg, s)]["clients"] = [{"id": i, "majority_acc": m, "selection_loss": 0.4}
                                            for i, m in enumerate([0.5, 0.3])]
    results[("part", 1)]["clients"][1]["selection_loss"] = float("nan")
    results[("fedfew", 0)]["clients"][0]["selection_loss"] = float("inf")
    rows, warnings = summarize(results, ["fedfew", "part"], reference="fedfew")
    assert warnings == [
        "**fedfew diverged** (seed 0: 1 of 2 clients): those clients' scored models have a non-finite loss and "
        "predict one class; its row counts them (train_loss in its metrics.csv shows when)",
        "**part diverged** (seed 1: 1 of 2 clients): those clients' scored models have a non-finite loss and "
        "predict one class; its row counts them (train_loss in its metrics.csv shows when)",
    ]
    f, part, _ = rows
    assert (f["diverged_clients_per_seed"], part["diverged_clients_per_seed"]) == ("0:1", "1:1")
    table = {r["algorithm"]: r for r in csv.DictReader(io.StringIO(to_csv(rows)))}
    assert table["part"]["diverged_clients_per_seed"] == "1:1" and table[MAJORITY]["diverged_clients_per_seed"] == ""
    assert "**part diverged** (seed 1: 1 of 2 clients)" in to_markdown(rows, "t", warnings)


def test_a_runs_summary_names_the_clients_whose_scored_model_diverged():
    from fedfew.reporting.callbacks import summary_lines
    from fedfew.core.run_folders import diverged_clients

    run = fake_results(0.6, [0.5, 0.3, 0.2])
    run["summary"].update(models_served=[3])
    run["clients"] = [{"id": i, "majority_acc": 0.5, "selection_loss": x}
                      for i, x in enumerate([0.3, float("nan"), float("-inf")])]
    assert diverged_clients(run) == [1, 2]
    lines = [line for line in summary_lines(run) if line.startswith("DIVERGED")]
    assert lines == ["DIVERGED: the scored model of 2 of 3 clients has a non-finite loss (clients [1, 2]), so it "
                     "predicts one class; the figures above count them. Look at train_loss in metrics.csv: a lower "
                     "optim.lr is the usual cure"]
    run["clients"][1]["selection_loss"] = run["clients"][2]["selection_loss"] = 1.0
    assert diverged_clients(run) == [] and not any(line.startswith("DIVERGED") for line in summary_lines(run))


def test_presets_tuned_for_another_setup_are_named(tmp_path):
    from omegaconf import OmegaConf

    def run(partition: dict) -> dict:
        r = fake_results(0.8, [0.5, 0.3])
        r["config"]["dataset"]["name"] = "digits"
        r["config"]["partition"] = partition
        return r
    clustered = {"name": "clustered", "groups": 4, "group_transform": "rotate", "group_data": "split", "within": "iid"}
    setup = presets.describe_setup(OmegaConf.create(run(clustered)["config"]))
    assert setup.startswith("digits, clustered (4 groups, rotate, split; within iid), M=2 clients, 5 rounds")
    preset = tmp_path / "digits_fedavg.yaml"
    preset.write_text(f"# @package _global_\n# tuned for: {setup}\noptim:\n  lr: 0.5\n")
    for partition, named in ((clustered, False), ({"name": "dirichlet", "alpha": 0.5}, True)):
        results = {("fedavg", 0): run(partition), ("local", 0): run(partition)}
        rows, _ = summarize(results, ["fedavg", "local"], reference=None, presets={"fedavg": str(preset), "local": ""})
        _, notes = comparison_table.describe(rows, results, "digits", [0], None)
        mismatch = [n for n in notes if n.startswith("presets tuned for another setup")]
        assert mismatch == ([f"presets tuned for another setup than these runs' (digits, dirichlet (alpha=0.5), M=2 "
                             f"clients, 5 rounds, 1 local epoch(s), batch 50, participation 1.0, model mlp): fedavg "
                             f"for {setup}; their values were chosen on that setup's validation split, the same way "
                             f"for every method"] if named else [])


def test_a_preset_tuned_for_the_runs_setup_wins_is_matched_on_every_setup_key_and_train_says_so(tmp_path, monkeypatch):
    """conf/tuned/<dataset><setup>/ holds presets tuned for another setup: compare picks the one whose
    ``# setup:`` line equals the runs' setup, on keys the words of ``# tuned for:`` do not name."""
    from conftest import compose_config

    clustered = compose_config("dataset=digits", "algorithm=fedavg")
    dirichlet = compose_config("dataset=digits", "algorithm=fedavg", "partition=dirichlet")
    pathological = compose_config("dataset=digits", "algorithm=fedavg", "partition=pathological")
    min_size_20 = compose_config("dataset=digits", "algorithm=fedavg", "partition=dirichlet", "partition.min_size=20")
    assert presets.describe_setup(min_size_20) == presets.describe_setup(dirichlet)   # the words do not tell them apart

    def preset(path, cfg, lr):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"# @package _global_\n# tuned for: {presets.describe_setup(cfg)}\n"
                        f"# setup: {json.dumps(presets.setup_keys(cfg))}\noptim:\n  lr: {lr}\n")
        return path

    monkeypatch.setattr(presets, "TUNED_DIR", tmp_path)
    top = preset(tmp_path / "digits_fedavg.yaml", clustered, 0.5)
    sub = preset(tmp_path / "digits_partition-dirichlet" / "digits_fedavg.yaml", dirichlet, 0.9)
    assert presets.preset_matches(top, clustered) and not presets.preset_matches(top, dirichlet)
    assert presets.preset_matches(sub, dirichlet) and not presets.preset_matches(sub, min_size_20)
    assert comparison.preset_for("digits", "fedavg", None, [], clustered) == (("~tuned", "optim.lr=0.5"), str(top))
    assert comparison.preset_for("digits", "fedavg", None, [], dirichlet) == (("~tuned", "optim.lr=0.9"), str(sub))
    # no preset for that setup: the dataset's own (and the note names it), also for a key the words miss
    assert comparison.preset_for("digits", "fedavg", None, [], pathological)[1] == str(top)
    assert comparison.preset_for("digits", "fedavg", None, [], min_size_20)[1] == str(top)
    assert comparison.preset_for("digits", "fedavg", str(tmp_path), [], dirichlet)[1] == str(top)  # --presets DIR: that one
    rows = [{"algorithm": "fedavg", "preset": str(sub)}]
    assert comparison_table.setup_mismatch(rows, OmegaConf_dict(dirichlet)) is None
    assert "fedavg for digits, dirichlet (alpha=0.5)" in comparison_table.setup_mismatch(rows, OmegaConf_dict(min_size_20))
    # a preset written before the ``# setup:`` line: matched on its words
    old = tmp_path / "old" / "digits_fedavg.yaml"
    old.parent.mkdir()
    old.write_text(f"# @package _global_\n# tuned for: {presets.describe_setup(pathological)}\noptim:\n  lr: 0.1\n")
    assert presets.preset_matches(old, pathological) and not presets.preset_matches(old, dirichlet)
    assert comparison.preset_for("digits", "fedavg", None, [], pathological)[1] == str(old)
    # make train applies conf/tuned/<dataset>_<alg>.yaml to every setup: it is told when that one is not tuned for it,
    # with the keys that differ
    assert presets.preset_note("digits_fedavg", clustered) is None and presets.preset_note(None, dirichlet) is None
    assert presets.setup_differences(sub, min_size_20) == ["partition.min_size: 10 in the preset, 20 here"]
    assert presets.preset_note("digits_fedavg", dirichlet).startswith(
        "preset conf/tuned/digits_fedavg.yaml was tuned for another setup (partition: clustered in the preset, "
        "dirichlet here)")
    assert presets.preset_note("digits_fedavg", dirichlet).endswith(
        "): add tuned=digits_partition-dirichlet/digits_fedavg, tuned for this setup")
    assert presets.preset_note("digits_fedavg", min_size_20).endswith(
        "no preset in conf/tuned was tuned for this setup (make tune with the same overrides makes one: docs/tuning.md)")
    assert presets.preset_note("digits_partition-dirichlet/digits_fedavg", dirichlet) is None
    fedprox = compose_config("dataset=digits", "algorithm=fedprox", "partition=dirichlet")
    assert "is not digits_fedprox's" in presets.preset_note("digits_partition-dirichlet/digits_fedavg", fedprox)
    # keys beyond the words: the model, the optimizer, clients per round
    for key in ("model.hidden=[64]", "optim.name=adam", "clients_per_round=5"):
        other = compose_config("dataset=digits", "algorithm=fedavg", key)
        assert presets.describe_setup(other) == presets.describe_setup(clustered) and not presets.preset_matches(top, other), key
    # a preset that records no setup (hand-written) is neither matched nor named; an unreadable # setup: line
    # falls back to the words
    bare = tmp_path / "bare.yaml"
    bare.write_text("# @package _global_\noptim:\n  lr: 0.1\n")
    assert presets.preset_matches(bare, dirichlet) is None and presets.setup_differences(bare, dirichlet) is None
    assert comparison_table.setup_mismatch([{"algorithm": "fedavg", "preset": str(bare)}], OmegaConf_dict(dirichlet)) is None
    broken = tmp_path / "broken.yaml"
    broken.write_text(f"# tuned for: {presets.describe_setup(dirichlet)}\n# setup: {{not json\noptim:\n  lr: 0.1\n")
    assert presets.preset_matches(broken, dirichlet) and not presets.preset_matches(broken, clustered)


def OmegaConf_dict(cfg) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(cfg, resolve=True)


def test_one_seed_has_no_spread_and_the_first_method_is_said_to_be_first(tmp_path):
    results = {("a", 0): fake_results(0.8, [0.5, 0.3], "h0"), ("b", 0): fake_results(0.9, [0.5, 0.3], "h0")}
    rows, _ = summarize(results, ["b", "a", "missing"], reference="b")
    b, a, maj = rows
    assert math.isnan(b["acc_mean_std"]) and math.isnan(a["diff_acc_mean_std"])
    assert a["diff_acc_mean"] == pytest.approx(-0.1)
    assert comparison_table.ranking_note(rows, "b").startswith("b is first")
    assert list(csv.DictReader(io.StringIO(to_csv(rows))))[0]["acc_mean_std"] == ""
    # the table's title and the setup every method shared, from results.json's config
    title, notes = comparison_table.describe(rows, results, "digits", [0], "b")
    assert title == "digits: personalized test accuracy, protocol final, seeds 0"
    assert notes[0] == "b is first on client-mean accuracy (0.9000; next: a 0.8000)"
    assert notes[1].startswith("shared by every method: M=2 clients, dirichlet (alpha=0.5), 5 rounds, 1 local "
                               "epoch(s), batch 50, local optimizer sgd, participation 1.0, model mlp with d=10 ")
    # no preset for either method: the table says none was tuned, not that all were tuned alike
    assert notes[2].startswith("what differs per method (none tuned: each runs its config defaults under the same "
                               "overrides): b: lr ")
    for name in "ab":
        (tmp_path / f"digits_{name}.yaml").write_text("# @package _global_\noptim:\n  lr: 0.1\n")
    rows[0]["preset"] = str(tmp_path / "digits_b.yaml")   # one method with a preset, the other without
    assert "(NOT tuned alike: some methods run a tuned preset" in comparison_table.describe(rows, results, "digits",
                                                                                             [0], "b")[1][2]
    rows[1]["preset"] = str(tmp_path / "digits_a.yaml")
    assert "(each tuned the same way on validation data" in comparison_table.describe(rows, results, "digits",
                                                                                       [0], "b")[1][2]


def test_mismatched_partitions_are_refused_and_budget_differences_flagged():
    with pytest.raises(CompareError, match="different partitions"):
        summarize({("a", 0): fake_results(0.8, [0.5], "h0"), ("b", 0): fake_results(0.9, [0.5], "OTHER")}, ["a", "b"])
    _, warnings = summarize({("a", 0): fake_results(0.8, [0.5]), ("b", 0): fake_results(0.9, [0.5], rounds=9)},
                            ["a", "b"])
    assert len(warnings) == 1 and "differ" in warnings[0]
    # a tuned lr per method is not a budget difference: it is listed per method instead
    _, warnings = summarize({("a", 0): fake_results(0.8, [0.5]), ("b", 0): fake_results(0.9, [0.5], lr=0.05)},
                            ["a", "b"])
    assert warnings == []


def test_presets_become_explicit_overrides_that_the_extra_overrides_beat(tmp_path):
    (tmp_path / "digits_fedfew.yaml").write_text(
        "# @package _global_\n# best validation score: 0.9000 (trial 3)\noptim:\n  lr: 0.25\nalgorithm:\n  mu: 0.07\n")
    preset, source = comparison.preset_for("digits", "fedfew", str(tmp_path), [])
    assert preset == ("~tuned", "optim.lr=0.25", "algorithm.mu=0.07") and source.endswith("digits_fedfew.yaml")
    assert comparison.preset_for("digits", "fedfew", str(tmp_path), ["optim.lr=0.1"])[0] == ("~tuned", "algorithm.mu=0.07")
    assert comparison.preset_for("digits", "fedavg", str(tmp_path), []) == (("~tuned",), "")   # none in that folder
    assert comparison.preset_for("digits", "fedfew", "none", []) == (("~tuned",), "")
    assert comparison_table.preset_score(source) == "0.9000 (trial 3)"
    with pytest.raises(CompareError, match="no such folder"):
        compare.main(["--algorithms", "fedavg", "--out", str(tmp_path), "--presets", str(tmp_path / "nope")])


def test_the_comparison_sets_dataset_algorithm_and_seed_itself(tmp_path):
    with pytest.raises(CompareError, match="set by the comparison"):
        compare.main(["--algorithms", "fedavg", "--out", str(tmp_path), "--", "seed=3"])
    with pytest.raises(CompareError, match="set by the comparison"):
        compare.main(["--algorithms", "fedavg", "--out", str(tmp_path), "--", "~tuned"])
    with pytest.raises(ValueError, match="unknown algorithm 'nosuch'"):
        compare.main(["--algorithms", "nosuch", "--out", str(tmp_path)])


def test_algorithms_that_cannot_run_are_named_or_left_out_before_any_run(tmp_path, capsys, monkeypatch):
    class Started(Exception):
        pass

    started: list[Run] = []

    def run_all(runs, jobs):  # stands in for the runs: records what would start
        started.extend(runs)
        raise Started

    monkeypatch.setattr(comparison, "run_all", run_all)
    # named: oracle needs client groups, so on Dirichlet it is an error, and nothing starts
    with pytest.raises(CompareError, match="(?s)oracle cannot run on this setup: .*use partition=clustered"):
        compare.main(["--algorithms", "fedavg oracle", "--out", str(tmp_path), "--", "partition=dirichlet"])
    # an option that does not exist, or an override that does not compose, is refused before any run too
    with pytest.raises(CompareError, match=r"^unknown partition 'nosuch'; available: clustered, dirichlet, iid, "):
        compare.main(["--algorithms", "fedavg", "--out", str(tmp_path), "--", "partition=nosuch"])
    with pytest.raises(CompareError, match="fedavg cannot run on this setup: cannot compose"):
        compare.main(["--algorithms", "fedavg", "--out", str(tmp_path), "--", "optim.lr=[0.1"])
    assert started == []
    # the default list leaves oracle (no groups) and fedbn (the MLP has no BatchNorm) out, and says why
    monkeypatch.setenv("FEDFEW_OUTPUT_DIR", str(tmp_path))
    with pytest.raises(Started):
        compare.main(["--seeds", "0", "1", "--", "partition=dirichlet", "trainer.threads=1"])
    # without --out the folder names the setup as run folders do (threads and paths left out), so
    # comparisons of different setups never meet each other's runs
    assert {r.out for r in started} == {tmp_path / "compare" / "digits_partition-dirichlet"}
    assert comparison.default_out("digits", ["algorithm.K=5"], str(tmp_path / "tune" / "digits_x" / "presets")) == (
        tmp_path / "compare" / "digits_K-5_presets-digits_x")
    assert comparison.default_out("digits", [], "none") == tmp_path / "compare" / "digits_presets-none"
    # a key no config defines is named with the closest valid one, before any run
    with pytest.raises(CompareError, match="closest valid key: algorithm.mu"):
        compare.main(["--out", str(tmp_path), "--", "mu=0.1"])
    # the default list leaves out a method without a key the overrides set, and the table says so
    kept, left_out = tuning.runnable_algorithms(
        ["fedfew", "fedavg"], named=False, overrides_of=lambda alg: [f"algorithm={alg}", "algorithm.K=5"])
    assert list(kept) == ["fedfew"] and kept["fedfew"].algorithm.K == 5
    assert len(left_out) == 1 and left_out[0].startswith("fedavg (") and "algorithm.K" in left_out[0]
    expected = [a for a in comparison.default_algorithms() if a not in ("oracle", "fedbn")]
    assert sorted(r.algorithm for r in started if r.seed == 0) == sorted(expected) and len(started) == 2 * len(expected)
    out = capsys.readouterr().out
    assert "left out" in out and "oracle (" in out and "fedbn (" in out
    # a key only the named methods define is theirs (fedfew, the config default, lacks it) ...
    started.clear()
    with pytest.raises(Started):
        compare.main(["--algorithms", "fedprox", "--out", str(tmp_path), "--", "algorithm.mu_prox=0.05"])
    assert [r.algorithm for r in started] == ["fedprox"]
    # ... but a key none of them defines is refused, named with the closest valid one
    with pytest.raises(CompareError, match="closest valid key: algorithm.mu_prox"):
        compare.main(["--algorithms", "fedprox", "fedavg", "--out", str(tmp_path), "--", "algorithm.mu_prx=0.05"])
    # oracle with a K other than the number of groups is left out of the default list, not failed at run time
    kept, left_out = tuning.runnable_algorithms(
        ["oracle", "fedfew"], named=False, overrides_of=lambda alg: [f"algorithm={alg}", "algorithm.K=5"])
    assert list(kept) == ["fedfew"] and "algorithm.K=5 and partition.groups=4" in left_out[0]
    # a partition key the setup ignores changes nothing for any method: refused, before any run
    with pytest.raises(CompareError, match=r"partition.alpha=0.1: the chosen partition=clustered \(within=iid\) "):
        compare.main(["--out", str(tmp_path), "--", "partition.alpha=0.1"])
    # engine=vmap is FedFew's: the default list leaves out the methods that would ignore it
    kept, left_out = tuning.runnable_algorithms(
        ["fedfew", "fedavg", "fedfew_reference"], named=False, overrides_of=lambda alg: [f"algorithm={alg}", "engine=vmap"])
    assert list(kept) == ["fedfew", "fedfew_reference"]
    assert left_out == ["fedavg (invalid configuration: engine=vmap with algorithm=fedavg: only fedfew and "
                        "fedfew_reference train through an engine; fedavg trains with its own loop and would ignore "
                        "engine=vmap; use engine=loop (the default) or algorithm=fedfew)"]


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
    # d of the digits MLP (64 -> 128 -> 10): 64*128 + 128 + 128*10 + 10 = 9,610 float32 parameters
    assert rows["fedavg"]["params_up_per_client_round"] == "9610" and rows["local"]["params_up_per_client_round"] == "0"
    assert rows["fedavg"]["bytes_up_per_round"] == str(4 * 9610 * 4) and rows["local"]["bytes_down_per_round"] == "0"
    assert rows["fedavg"]["seeds"] == "1" and rows["fedavg"]["rounds"] == "2"
    assert (out / "accuracy_rounds.png").stat().st_size > 0 and (out / "accuracy_bytes.png").stat().st_size > 0
    results = {a: json.loads((out / a / "seed0" / "results.json").read_text()) for a in ("fedavg", "local")}
    for alg, res in results.items():
        assert float(rows[alg]["acc_mean"]) == pytest.approx(res["summary"]["acc_mean"], abs=1e-6)
        assert res["config"]["rounds"] == 2 and res["config"]["num_clients"] == 4
        assert 100 < res["peak_host_memory_mib"] < 24 * 1024 and res["peak_device_memory_mib"] is None  # torch alone > 100 MiB
        assert float(rows[alg]["peak_host_memory_mib"]) == pytest.approx(res["peak_host_memory_mib"])  # one seed: its own
        # resident memory before round 1 and after the rounds: positive, not above the process's peak (the
        # kernel updates its high-water mark lazily: within 1%)
        before, after = res["host_memory_before_rounds_mib"], res["host_memory_max_after_round_mib"]
        assert 100 < before <= 1.01 * res["peak_host_memory_mib"] and 100 < after <= 1.01 * res["peak_host_memory_mib"]
    assert results["fedavg"]["partition_hash"] == results["local"]["partition_hash"]  # the same partition
    majority = [c["majority_acc"] for c in results["local"]["clients"]]
    assert float(rows[MAJORITY]["acc_mean"]) == pytest.approx(sum(majority) / len(majority), abs=1e-6)
    assert "| fedavg |" in (out / "compare.md").read_text()
    assert f"| {results['local']['peak_host_memory_mib'] / 1024:.2f} |" in (out / "compare.md").read_text()

    # another thread count (JOBS=1 after JOBS=2) is the same experiment: reused, not refused
    assert compare.main(argv("fedavg", extra=["--", "rounds=2", "num_clients=4", "logger=none"])) == 0
    assert kept.stat().st_mtime_ns == stamp
    # results made with other overrides are not silently reused
    with pytest.raises(CompareError, match="produced with overrides"):
        compare.main(argv("fedavg", extra=["--", "rounds=3", "num_clients=4", "logger=none", "trainer.threads=1"]))
    assert kept.stat().st_mtime_ns == stamp


def write_agnews(folder, relabel: bool = False):
    """A tiny AG News in the release's format in ``<folder>/ag_news_csv`` (4 classes, 20 train and
    5 test rows each, the same every time); ``relabel``: the first train row's class is 2, not 1."""
    import random

    words = [["war", "peace", "nation", "leader"], ["game", "team", "score", "coach"],
             ["market", "stock", "profit", "bank"], ["chip", "software", "science", "space"]]
    rng = random.Random(0)
    (folder / "ag_news_csv").mkdir(parents=True)
    for name, n in (("train.csv", 20), ("test.csv", 5)):
        with (folder / "ag_news_csv" / name).open("w", newline="") as fh:
            writer = csv.writer(fh, quoting=csv.QUOTE_ALL)
            for i in range(n):
                for c in range(4):
                    label = 2 if relabel and name == "train.csv" and i == 0 and c == 0 else c + 1
                    writer.writerow([label, f"{rng.choice(words[c])} {i}", " ".join(rng.choice(words[c]) for _ in range(8))])


@pytest.mark.slow
def test_a_run_is_reused_from_another_data_folder_with_the_same_data_and_refused_on_other_data(tmp_path, capsys):
    """Where the data lies is no part of a run's identity, what it holds is: a run made with
    data_dir=A is reused by a comparison with data_dir=B holding a copy of A (B's path recorded
    nowhere in compare.md), and refused, naming both fingerprints, with data_dir=C where one label
    differs; also from its checkpoint alone, and, for a run recorded before the fingerprint was
    (its partition hash only), in the same way."""
    import shutil

    from fedfew.data import fingerprint

    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    write_agnews(a)
    shutil.copytree(a, b)
    write_agnews(c, relabel=True)
    out = tmp_path / "cmp"

    def argv(data):
        return ["--dataset", "agnews", "--algorithms", "fedavg", "--seeds", "0", "--out", str(out), "--",
                f"data_dir={data}", "num_clients=2", "rounds=1", "logger=none", "trainer.threads=1",
                "checkpoint_every=1"]   # set by the user: the checkpoint is kept

    assert compare.main(argv(a)) == 0
    run = out / "fedavg" / "seed0"
    made = json.loads((run / "results.json").read_text())
    stamp = (run / "results.json").stat().st_mtime_ns
    ours, theirs = fingerprint.DataCheck(b).fingerprint(made["config"]), fingerprint.DataCheck(c).fingerprint(made["config"])
    assert made["data_fingerprint"] == ours and len(ours) == 64 and theirs != ours
    assert made["config"]["data_dir"] == "<data_dir>"        # no machine's folder in committed results
    written = [p for p in run.rglob("*") if p.is_file() and p.suffix in (".yaml", ".json", ".log")]
    assert written and not [p for p in written if str(a) in p.read_text() or str(CHECKOUT) in p.read_text()]
    assert "<checkout>/src/fedfew/conf" in (run / ".hydra" / "hydra.yaml").read_text()
    capsys.readouterr()

    assert compare.main(argv(b)) == 0                          # a copy elsewhere: reused, nothing trained
    assert "reusing 1 finished run(s): fedavg/seed0" in capsys.readouterr().out
    assert (run / "results.json").stat().st_mtime_ns == stamp
    md = (out / "compare.md").read_text()
    assert "-- 'data_dir=<data_dir>' num_clients=2" in md and f"data_dir={b}" not in md
    assert "tuned preset conf/tuned/agnews_fedavg.yaml" in md and str(Path(presets.TUNED_DIR)) not in md
    assert next(csv.DictReader((out / "compare.csv").open()))["preset"] == "conf/tuned/agnews_fedavg.yaml"

    with pytest.raises(CompareError, match=rf"results.json was made from other data than this comparison reads "
                                           rf"\(data fingerprint {ours[:12]} recorded, {theirs[:12]} in {c}\)"):
        compare.main(argv(c))
    (run / "results.json").unlink()                            # its checkpoint (round 1) records the data too
    with pytest.raises(CompareError, match=rf"the checkpoint in .* was made from other data .*{ours[:12]} recorded"):
        compare.main(argv(c))

    # a run recorded before data_fingerprint was: its partition hash, recomputed on the new data, decides
    shutil.rmtree(run / "checkpoints")
    older = {k: v for k, v in made.items() if k != "data_fingerprint"}
    older["config"] = {**made["config"], "data_dir": str(a)}   # as runs recorded it before they were made portable
    (run / "results.json").write_text(json.dumps(older))
    assert compare.main(argv(b)) == 0                          # reused, and its record made portable
    assert json.loads((run / "results.json").read_text()) == {**older, "config": made["config"]}
    with pytest.raises(CompareError, match=rf"partition hash {made['partition_hash'][:12]} recorded \(no data "
                                           rf"fingerprint.*\), [0-9a-f]{{12}} on the data in {c}"):
        compare.main(argv(c))
    with pytest.raises(CompareError, match="cannot tell whether .* DataNotFoundError: AG News not found"):
        compare.main(argv(tmp_path / "nowhere"))


def test_run_paths_and_overrides(tmp_path):
    run = Run("ifca", 2, tmp_path, ("rounds=3", "hydra.job.chdir=false"), "agnews")
    assert run.dir == tmp_path / "ifca" / "seed2"
    assert run.overrides()[:4] == ["dataset=agnews", "algorithm=ifca", "seed=2", "rounds=3"]
    assert run.overrides()[-1] == f"hydra.run.dir={run.dir}"
    assert run.task_overrides() == ["dataset=agnews", "algorithm=ifca", "seed=2", "rounds=3"]
    tuned = Run("ifca", 2, tmp_path, ("optim.lr=0.1",), "agnews", ("~tuned", "optim.lr=0.2"), "p.yaml")
    assert tuned.task_overrides() == ["dataset=agnews", "algorithm=ifca", "seed=2", "~tuned", "optim.lr=0.2",
                                      "optim.lr=0.1"]  # the preset first, so the extra overrides win


def test_a_failed_run_stays_out_of_the_table_even_with_results(tmp_path, monkeypatch):
    """A run that exited non-zero after writing results.json is reported failed and not tabulated."""
    class Collected(Exception):
        pass

    def run_all(runs, jobs):
        return {r: ("failed" if r.algorithm == "fedavg" else "done") for r in runs}

    def collect(runs):
        raise Collected(sorted(r.algorithm for r in runs))

    monkeypatch.setattr(comparison, "run_all", run_all)
    monkeypatch.setattr(comparison, "collect", collect)
    with pytest.raises(Collected) as info:
        compare.main(["--algorithms", "fedavg", "local", "--out", str(tmp_path), "--", "rounds=2"])
    assert info.value.args[0] == ["local"]


def test_an_interrupted_run_continues_from_its_checkpoint_with_the_same_figures(tmp_path, capsys):
    """A run cut short after its checkpoint (here: results.json removed after a run that kept its
    round-2 checkpoint) is continued from round 3, not redone, and gives the same figures; a
    checkpoint made with other overrides is refused like stale results."""
    out = tmp_path / "cmp"

    def argv(*extra):
        return ["--dataset", "digits", "--algorithms", "fedavg", "--seeds", "0", "--out", str(out), "--",
                "rounds=3", "num_clients=4", "logger=none", "trainer.threads=1", *extra]

    assert compare.main(argv("checkpoint_every=2")) == 0   # set by the user: the checkpoint is kept
    run = out / "fedavg" / "seed0"
    whole = json.loads((run / "results.json").read_text())
    assert (run / "checkpoints" / "last.ckpt").is_file()
    (run / "results.json").unlink()
    capsys.readouterr()
    assert compare.main(argv("checkpoint_every=2")) == 0
    assert "(continuing from its checkpoint)" in capsys.readouterr().out
    log = (out / "logs" / "fedavg_seed0.log").read_text()
    assert f"resume={run / 'checkpoints' / 'last.ckpt'}" in log and "at round 3" in log
    resumed = json.loads((run / "results.json").read_text())
    assert resumed["summary"]["acc_mean"] == whole["summary"]["acc_mean"]
    assert [c["acc"] for c in resumed["clients"]] == [c["acc"] for c in whole["clients"]]
    assert resumed["evaluations"] == whole["evaluations"]
    (run / "results.json").unlink()
    with pytest.raises(CompareError, match="the checkpoint in .* was produced with overrides"):
        compare.main(argv("checkpoint_every=2", "optim.lr=0.05"))


def test_launched_runs_checkpoint_and_drop_the_checkpoint_when_done(tmp_path):
    """fedfew.experiments.launch adds checkpoint_every (unless set) and resume (when a checkpoint exists), and
    deletes the checkpoint after a successful run it added checkpointing to."""
    import sys

    from fedfew.experiments import launch as launch

    script = tmp_path / "fake.py"
    script.write_text("import json, os, sys\n"
                      "args = dict(a.split('=', 1) for a in sys.argv[1:])\n"
                      "print(sorted(args))\n"
                      "open(os.path.join(args['hydra.run.dir'], 'results.json'), 'w').write('{}')\n")
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "last.ckpt").write_bytes(b"x")
    code, _, _, resumed = launch.launch([f"hydra.run.dir={run}"], run, tmp_path / "a.log", (sys.executable, str(script)))
    assert code == 0 and resumed and not (run / "checkpoints").exists()
    assert "['checkpoint_every', 'hydra.run.dir', 'resume']" in (tmp_path / "a.log").read_text()
    (run / "checkpoints").mkdir()
    (run / "checkpoints" / "last.ckpt").write_bytes(b"x")
    overrides = [f"hydra.run.dir={run}", "checkpoint_every=0"]
    code, _, _, resumed = launch.launch(overrides, run, tmp_path / "b.log", (sys.executable, str(script)))
    assert code == 0 and resumed and (run / "checkpoints" / "last.ckpt").is_file()   # the user's: kept
    assert "checkpoint_every=5" not in (tmp_path / "b.log").read_text()
    assert launch.progress(run, ["rounds=2"]) == "done"


def test_a_run_stopped_by_a_signal_is_reported_and_continued_on_the_next_invocation(tmp_path):
    """A run that exits with 128 + signum after saving its checkpoint is 'interrupted', not failed
    (left out of the table; the command exits 1), and the next invocation continues it."""
    import sys

    script = tmp_path / "fake.py"
    script.write_text(
        "import os, sys\n"
        "args = dict(a.split('=', 1) for a in sys.argv[1:] if '=' in a and not a.startswith('~'))\n"
        "d = args['hydra.run.dir']; os.makedirs(os.path.join(d, 'checkpoints'), exist_ok=True)\n"
        "if 'resume' not in args:\n"
        "    open(os.path.join(d, 'checkpoints', 'last.ckpt'), 'w').write('x'); sys.exit(143)\n"
        "open(os.path.join(d, 'results.json'), 'w').write('{\"summary\": {\"acc_mean\": 0.5}}')\n")
    python = tmp_path / "python"   # stands in for the interpreter: ignores "-m fedfew.train"
    python.write_text(f"#!/bin/sh\nexec {sys.executable} {script} \"$@\"\n")
    python.chmod(0o755)
    run = Run("fedavg", 0, tmp_path / "cmp", ("rounds=2",))
    said: list[str] = []
    assert comparison.run_all([run], python=str(python), echo=said.append) == {run: "interrupted"}
    assert "stopped by a signal" in said[-1] and (run.dir / "checkpoints" / "last.ckpt").is_file()
    said.clear()
    assert comparison.run_all([run], python=str(python), echo=said.append) == {run: "done"}
    assert "(continuing from its checkpoint)" in said[0] and "for its last part" in said[-1]
    assert not (run.dir / "checkpoints").exists()                    # dropped once the run finished
    assert comparison.run_all([run], python=str(python), echo=said.append) == {run: "reused"}


def _signal_the_comparison_alone(tmp_path, signum: int, seeds: tuple[str, ...]) -> tuple[int, str, Path]:
    """Start a digits compare of fedavg on ``seeds`` (one run at a time, long runs), send
    ``signum`` to the compare's process only once seed 0 has a checkpoint, and wait for it to end.
    Checks that nothing trains on without its parent. Returns (exit code, output, --out folder)."""
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "cmp"
    proc = subprocess.Popen(
        [sys.executable, "-m", "fedfew.compare", "--dataset", "digits", "--algorithms", "fedavg", "--seeds", *seeds,
         "--jobs", "1", "--out", str(out), "--", "rounds=5000", "num_clients=4", "logger=none", "trainer.threads=1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    checkpoint = out / "fedavg" / "seed0" / "checkpoints" / "last.ckpt"
    deadline = time.monotonic() + 300
    while not checkpoint.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert checkpoint.exists(), proc.communicate()[0].decode()[-2000:]
    proc.send_signal(signum)                              # the comparison's process only
    try:
        printed = proc.communicate(timeout=120)[0].decode()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert checkpoint.exists()
    leftover = subprocess.run(["pgrep", "-f", f"hydra.run.dir={out}"], capture_output=True, text=True).stdout
    assert leftover.strip() == ""                         # nothing trains on without its parent
    return proc.returncode, printed, out


def test_sigterm_to_the_comparison_alone_stops_its_runs_at_a_checkpoint(tmp_path):
    """`kill <compare pid>` (or Slurm pre-empting it) passes SIGTERM on to the running training
    run, which saves a checkpoint and stops: no run is left training without its parent."""
    import signal

    code, printed, out = _signal_the_comparison_alone(tmp_path, signal.SIGTERM, ("0",))
    assert code == 128 + signal.SIGTERM, printed[-2000:]
    assert "run the same command again to continue" in printed and "Traceback" not in printed
    assert "stopped by SIGTERM after round" in (out / "logs" / "fedavg_seed0.log").read_text()


def test_sigint_to_the_comparison_alone_starts_no_queued_run(tmp_path):
    """`kill -INT <compare pid>` (SIGINT to the tool alone, not to its process group as Ctrl-C in
    a terminal does) stops the running run at a checkpoint and starts none of the queued ones: the
    tool once said "stopped" while its worker thread went on to the next run."""
    import signal

    code, printed, out = _signal_the_comparison_alone(tmp_path, signal.SIGINT, ("0", "1"))
    assert code == 128 + signal.SIGINT, printed[-2000:]
    assert "run the same command again to continue" in printed and "Traceback" not in printed
    assert "stopped by SIGTERM after round" in (out / "logs" / "fedavg_seed0.log").read_text()
    assert not (out / "logs" / "fedavg_seed1.log").exists() and not (out / "fedavg" / "seed1").exists()


def test_own_keys_show_k_only_for_methods_that_have_it():
    """``++algorithm.K=5`` reaches every method's node; the table lists K only where the method
    defines it (conf/algorithm/<name>.yaml), beside the keys its search space tunes."""
    node = {"K": 5, "mu": 0.1, "server_lr": 1.0, "normalize": True}
    assert comparison_table.own_keys({"algorithm": {"name": "fedfew", **node}}) == "K=5, mu=0.1, server_lr=1.0"
    assert comparison_table.own_keys({"algorithm": {"name": "ifca", "K": 5}}) == "K=5"
    assert comparison_table.own_keys({"algorithm": {"name": "fedavg", "K": 5}}) == ""
    assert comparison_table.own_keys({"algorithm": {"name": "fedrep", "K": 5, "head_epochs": 3}}) == "head_epochs=3"


def test_eval_also_gives_a_second_table_from_the_same_runs(tmp_path, capsys):
    """With ``eval.also=[finetune]`` one comparison writes compare.md (final) and
    compare_finetune.md from the same runs, each equal to what those runs report."""
    out = tmp_path / "cmp"
    assert compare.main(["--dataset", "digits", "--algorithms", "fedavg", "local", "--seeds", "0", "--out", str(out),
                         "--", "rounds=2", "num_clients=4", "eval_every=1", "logger=none", "eval.also=[finetune]"]) == 0
    printed = capsys.readouterr().out
    assert "protocol final" in printed and "protocol finetune" in printed
    results = {a: json.loads((out / a / "seed0" / "results.json").read_text()) for a in ("fedavg", "local")}
    for name, scored in (("compare.csv", lambda r: r), ("compare_finetune.csv", lambda r: r["also"]["finetune"])):
        rows = {r["algorithm"]: r for r in csv.DictReader((out / name).open())}
        for alg, res in results.items():
            summary = scored(res)["summary"]
            assert float(rows[alg]["acc_mean"]) == pytest.approx(summary["acc_mean"], abs=1e-6)
            last = [e["acc_mean"] for e in scored(res)["evaluations"]]
            assert float(rows[alg]["acc_mean_last3"]) == pytest.approx(sum(last) / len(last), abs=1e-6)
            assert rows[alg]["protocol"] == ("final" if name == "compare.csv" else "finetune")
    assert results["fedavg"]["also"]["finetune"]["summary"]["acc_mean"] != results["fedavg"]["summary"]["acc_mean"]
    assert "protocol finetune" in (out / "compare_finetune.md").read_text().splitlines()[0]
    assert (out / "accuracy_rounds_finetune.png").stat().st_size > 0
    # a protocol only some runs were scored under makes no table
    assert comparison_table.also_protocols({("a", 0): {"also": {"finetune": {}}}, ("b", 0): {}}) == []


@pytest.mark.slow
def test_a_diverged_run_is_reported_with_a_non_zero_exit_and_reused_as_such(tmp_path, capsys):
    """optim.lr=1e8: fedfew's run stops early with exit code 3 (fedfew.core.nonfinite); the comparison
    keeps it in the table, names it in a warning and exits 1; run again, it reuses it and says the same."""
    out = tmp_path / "cmp"
    argv = ["--dataset", "digits", "--algorithms", "fedfew", "--seeds", "0", "--out", str(out), "--",
            "rounds=6", "num_clients=4", "partition.groups=2", "logger=none", "trainer.threads=1", "optim.lr=1e8"]
    assert compare.main(argv) == 1
    printed = capsys.readouterr().out
    assert re.search(r"fedfew seed 0: DIVERGED, every client non-finite, stopped after round \d \(exit code 3\)", printed)
    table = (out / "compare.md").read_text()
    assert "**runs that diverged** (every client non-finite, stopped early with exit code 3" in table
    assert "fedfew/seed0" in table
    assert compare.main(argv) == 1                                       # reused, still reported
    assert "reusing 1 finished run(s): fedfew/seed0" in capsys.readouterr().out
