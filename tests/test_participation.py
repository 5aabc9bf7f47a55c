"""fedfew.reporting.participation: alpha's spread over a round's participants and the rarely
sampled clients' assignment, checked by hand on a 6-client run folder."""
from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedfew.reporting import participation
from fedfew.reporting.history_file import load_history, write_history


def write_run(folder):
    rounds = [{"round": 1, "participants": [0, 1, 3], "alpha": [0.5, 0.25, 0.25]},
              {"round": 2, "participants": [0, 3, 4], "alpha": [1 / 3, 1 / 3, 1 / 3]},
              {"round": 3, "participants": [0, 1, 4], "alpha": [0.6, 0.2, 0.2]}]
    models, groups, accs = [0, 0, 1, 1, 1, 1], [0, 0, 0, 1, 1, 1], [0.9, 0.8, 0.3, 0.7, 0.6, 0.5]
    clients = [{"id": i, "model": m, "group": g, "acc": a} for i, (m, g, a) in enumerate(zip(models, groups, accs))]
    folder.mkdir()
    write_history(folder, {"algorithm": "fedfew", "rounds": rounds})
    (folder / "results.json").write_text(json.dumps({"clients": clients}))
    return folder


def test_a_hand_computed_run(tmp_path, capsys):
    rep = participation.report(write_run(tmp_path / "run"))
    # times sampled: client 0 thrice, 1, 3, 4 twice, 2 and 5 never
    assert rep["never_sampled"] == 2 and rep["rounds"] == 3
    a = rep["alpha"]
    # P * max alpha: 1.5, 1, 1.8; 1 / (P * sum alpha^2): 1/1.125, 1, 1/1.32
    assert a["max_times_p_mean"] == pytest.approx((1.5 + 1 + 1.8) / 3) and a["max_times_p_last"] == pytest.approx(1.8)
    assert a["effective_share_mean"] == pytest.approx((1 / 1.125 + 1 + 1 / 1.32) / 3)
    assert a["effective_share_last"] == pytest.approx(1 / 1.32)
    bins = rep["by_times_sampled"]
    assert [(b["sampled_min"], b["sampled_max"], b["clients"]) for b in bins] == [(0, 0, 2), (2, 2, 3), (3, 3, 1)]
    # group 0 mostly model 0, group 1 model 1: never sampled client 2 (group 0, model 1) is off, client 5 on
    assert bins[0]["with_group_model"] == 0.5 and bins[0]["acc_mean"] == pytest.approx(0.4)
    assert bins[0]["assignment_ari"] == 0.0           # models [1, 1] against groups [0, 1]
    assert bins[1]["with_group_model"] == 1.0 and bins[1]["assignment_ari"] == 1.0   # [0, 1, 1] against [0, 1, 1]
    assert "assignment_ari" not in bins[2]            # one client, one group
    assert participation.main([str(tmp_path / "run")]) == 0
    assert "| 0-0 (mean 0.0) | 2 | 0.4000 | 0.50 | 0.00 |" in capsys.readouterr().out


def test_methods_without_alpha_and_unfinished_runs(tmp_path, capsys):
    run = write_run(tmp_path / "run")
    history = load_history(run)
    for r in history["rounds"]:
        del r["alpha"]
    write_history(run, history)
    assert participation.report(run)["alpha"] is None
    other = write_run(tmp_path / "other")
    (run / "results.json").unlink()
    # a folder that is not a finished run is named, the others are still reported, the exit code says it
    assert participation.main([str(run), str(other)]) == 2
    out, err = capsys.readouterr()
    assert "results.json is missing: give the folder of a finished run" in err and str(other) in out


def test_alpha_spread_leaves_out_excluded_clients_and_empty_rounds():
    rounds = [{"participants": [0, 1, 2], "alpha": [0.5, 0.5, 0.0], "excluded": [2]},   # uniform over the 2 finite
              {"participants": [0, 1, 2], "alpha": [0.0, 0.0, 0.0], "excluded": [0, 1, 2]},  # nothing finite: skipped
              {"participants": [3, 4], "alpha": [0.75, 0.25], "excluded": []}]
    a = participation.alpha_spread(rounds)
    assert a["rounds"] == 2 and a["participants_mean"] == 2.0
    # round 1: P = 2, max 0.5 -> 1, share 1; round 3: 2 * 0.75 = 1.5, 1 / (2 * 0.625) = 0.8
    assert a["max_times_p_mean"] == pytest.approx((1 + 1.5) / 2) and a["effective_share_last"] == pytest.approx(0.8)
    assert participation.alpha_spread(rounds[1:2]) is None


def test_never_sampled_clients_are_a_bin_of_their_own():
    # 30 never sampled, 30 once, 30 twice, one each 5..9 times: 7 distinct counts among the sampled ones, so
    # quartile bins over the 65 sampled (edges 1, 2, 9: {1, 2} and {5..9}); the never sampled stay apart
    counts = np.array([0] * 30 + [1] * 30 + [2] * 30 + [5, 6, 7, 8, 9])
    bins = participation.sampling_bins(counts)
    assert [sorted(set(counts[b].tolist())) for b in bins] == [[0], [1, 2], [5, 6, 7, 8, 9]]
    assert [len(b) for b in bins] == [30, 60, 5]
    assert [counts[b].tolist() for b in participation.sampling_bins(np.array([0, 0]))] == [[0, 0]]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 30), min_size=1, max_size=200))
def test_bins_partition_the_clients_in_order_without_splitting_a_count(values):
    counts = np.asarray(values)
    bins = participation.sampling_bins(counts)
    assert 1 <= len(bins) <= 4 + bool((counts == 0).any())
    assert sorted(np.concatenate(bins).tolist()) == list(range(len(counts)))
    if (counts == 0).any():  # the never sampled clients, and only they, first
        assert counts[bins[0]].max() == 0
    for lower, upper in zip(bins, bins[1:]):
        assert counts[lower].max() < counts[upper].min()


def test_a_model_serving_several_groups_counts_for_one_of_them():
    """Groups and models are matched one to one: when every client ends on one model (IFCA collapsed
    this way at M = 1,000) one group has its model and the others none, so the share is not 1."""
    groups = [0, 0, 0, 1, 1, 2]
    clients = [{"id": i, "model": 3, "group": g, "acc": 0.5} for i, g in enumerate(groups)]
    assert participation.group_models(clients) == {0: 3}   # the largest group takes the one model
    counts = np.ones(len(clients), dtype=np.int64)
    bins = participation.by_times_sampled(clients, counts)
    assert bins[0]["with_group_model"] == 0.5 and bins[0]["assignment_ari"] == 0.0   # 3 of 6, not 1
    # two models for three groups: the matching takes the largest total (group 0 -> 1, group 1 -> 2: 5 of 6),
    # group 2's majority model (1) is taken already, so its client counts as off
    models = [1, 1, 1, 2, 2, 1]
    clients = [{"id": i, "model": m, "group": g, "acc": 0.5} for i, (m, g) in enumerate(zip(models, groups))]
    assert participation.group_models(clients) == {0: 1, 1: 2}
    assert participation.by_times_sampled(clients, counts)[0]["with_group_model"] == pytest.approx(5 / 6)
