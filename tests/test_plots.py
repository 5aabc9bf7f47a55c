"""Pictures built from synthetic histories with known values: the accuracy plot's training-loss
fallback, legends of the models in use only, the assignment plot's two labelled selections."""
from __future__ import annotations

import numpy as np
import pytest

from fedfew.reporting import plots as plots

SUMMARY = {"acc_mean": 0.5, "acc_std": 0.1, "acc_min": 0.3, "acc_max": 0.8, "acc_weighted": 0.55,
           "majority_acc_mean": 0.2}


def history(rounds, evaluations, M=4, K=3, algorithm="fedfew"):
    return {"num_clients": M, "K": K, "algorithm": algorithm, "dataset": "synthetic", "rounds": rounds,
            "evaluations": evaluations}


def legend_labels(ax) -> list[str]:
    legend = ax.get_legend()
    return [t.get_text() for t in legend.get_texts()] if legend is not None else []


# three rounds, 4 clients (all taking part), K = 3; model 2 is never assigned nor selected
LOSS = [
    [[1.0, 2.0, 3.0], [2.0, 1.0, 3.0], [4.0, 2.0, 6.0], [1.0, 1.0, 1.0]],
    [[0.5, 1.5, 2.5], [1.5, 0.5, 2.5], [3.0, 1.0, 5.0], [1.0, 0.5, 1.0]],
    [[0.2, 1.0, 2.0], [1.0, 0.2, 2.0], [2.0, 0.6, 4.0], [0.4, 0.4, 0.9]],
]
W = [[[0.7, 0.2, 0.1], [0.2, 0.7, 0.1], [0.1, 0.8, 0.1], [0.4, 0.5, 0.1]]] * 3
ASSIGN = [[0, 1, 1, 1], [0, 1, 1, 0], [0, 1, 1, 0]]


def fedfew_rounds():
    return [{"round": t + 1, "participants": [0, 1, 2, 3], "g": 3.0 - t, "loss": LOSS[t], "w": W[t],
             "assignment": ASSIGN[t]} for t in range(3)]


def test_accuracy_plot_shows_training_loss_until_two_evaluations():
    h = history(fedfew_rounds(), [{"round": 3, "summary": SUMMARY, "acc": [0.5] * 4, "model": [0, 1, 1, 0]}])
    fig = plots.accuracy_figure(h)
    ax = fig.axes[0]
    assert ax.get_ylabel() == "training loss"
    assert "accuracy curve from two evaluations on" in ax.get_title() and "round 3: client-mean acc 0.5000" in ax.get_title()
    lines = {line.get_label(): line for line in ax.get_lines()}
    mean = lines["mean loss (all clients and models)"]
    best = lines["best model's loss (client mean)"]
    assert mean.get_xdata().tolist() == [1, 2, 3]
    # round 1: (6 + 6 + 12 + 3) / 12 = 2.25; best per client 1, 1, 2, 1 -> 1.25
    np.testing.assert_allclose(mean.get_ydata(), [27 / 12, 20.5 / 12, 14.7 / 12])
    np.testing.assert_allclose(best.get_ydata(), [1.25, (0.5 + 0.5 + 1.0 + 0.5) / 4, (0.2 + 0.2 + 0.6 + 0.4) / 4])


def test_accuracy_plot_without_loss_uses_g_and_with_two_evaluations_accuracy():
    rounds = [{"round": t, "participants": [0, 1], "g": 2.0 / t} for t in (1, 2)]
    fig = plots.accuracy_figure(history(rounds, [], M=2, K=1, algorithm="fedavg"))
    line, = fig.axes[0].get_lines()
    assert line.get_label() == "g (STCH-Set objective)" and line.get_ydata().tolist() == [2.0, 1.0]
    evals = [{"round": r, "summary": {**SUMMARY, "acc_mean": a}} for r, a in ((1, 0.4), (2, 0.6))]
    fig = plots.accuracy_figure(history(fedfew_rounds(), evals))
    ax = fig.axes[0]
    assert ax.get_ylabel() == "personalized test accuracy"
    mean = next(line for line in ax.get_lines() if line.get_label() == "client mean")
    assert mean.get_xdata().tolist() == [1, 2] and mean.get_ydata().tolist() == [0.4, 0.6]
    # nothing to draw at all: no figure
    assert plots.accuracy_figure(history([], [])) is None


def test_assignment_plot_labels_both_selections_and_lists_only_models_in_use():
    final = [0, 1, 1, 1]  # argmin eval loss: client 3 differs from its last argmax w (model 0)
    h = history(fedfew_rounds(), [{"round": 3, "summary": SUMMARY, "acc": [0.9, 0.8, 0.7, 0.6], "model": final}])
    assert plots.models_in_use(h) == [0, 1]
    assert plots.final_selection(h)[0] == 3 and plots.final_selection(h)[1].tolist() == final
    fig = plots.assignment_figure(h)
    ax_img, ax_final, ax_count = fig.axes[:3]
    assert ax_img.get_title() == "during training: argmax_k w_ik"
    assert "final\nselection\n(round 3)" == ax_final.get_title() and "argmin_k\neval loss" == ax_final.get_xlabel()
    assert ax_final.get_images()[0].get_array().ravel().tolist() == final
    assert legend_labels(ax_count) == ["model 0", "model 1", "final selection (round 3)"]
    counts = {line.get_label(): line.get_ydata().tolist() for line in ax_count.get_lines() if line.get_label().startswith("model")}
    assert counts == {"model 0": [1, 2, 2], "model 1": [3, 2, 2]}
    # stars at the final round: model 0 chosen by 1 client, model 1 by 3
    stars = sorted(line.get_ydata().tolist()[0] for line in ax_count.get_lines()
                   if line.get_marker() == "*" and len(line.get_xdata()) == 1)
    assert stars == [1, 3]
    assert len(fig.axes) == 3  # no colour bar listing unused models: the legend is the key


def test_assignment_plot_of_an_algorithm_without_w_names_its_own_assignment():
    rounds = [{"round": t, "participants": [0, 1, 2], "loss": [[1, 2], [2, 1], [1, 2]], "assignment": [0, 1, 0]}
              for t in (1, 2)]
    fig = plots.assignment_figure(history(rounds, [], M=3, K=2, algorithm="ifca"))
    assert fig.axes[0].get_title() == "during training: ifca's assignment"
    assert legend_labels(fig.axes[1]) == ["model 0", "model 1"]  # no final selection recorded


@pytest.mark.parametrize("models,expected", [([0, 2, 2, 0], ["model 0", "model 2"]), ([1, 1, 1, 1], ["model 1"])])
def test_client_accuracy_legend_lists_chosen_models_only(models, expected):
    h = history([], [{"round": 5, "summary": SUMMARY, "acc": [0.9, 0.5, 0.7, 0.6], "model": models}])
    fig = plots.client_accuracy_figure(h)
    assert legend_labels(fig.axes[1]) == expected


def test_alpha_plot_draws_uniform_at_one_over_the_round_participants():
    """alpha sums to 1 over a round's participants: with 2 of 6 clients, then 3, uniform is 1/2, then 1/3."""
    rounds = [{"round": 1, "participants": [0, 4], "alpha": [0.5, 0.5]},
              {"round": 2, "participants": [1, 2, 5], "alpha": [0.2, 0.3, 0.5]}]
    fig = plots.alpha_figure(history(rounds, [], M=6))
    (uniform,) = [line for line in fig.axes[0].get_lines() if line.get_label().startswith("uniform")]
    assert uniform.get_ydata().tolist() == pytest.approx([1 / 2, 1 / 3])


def test_alpha_plot_of_many_clients_shows_the_largest_means_and_skips_the_never_sampled(recwarn):
    """M = 1,000 with participation 0.05 leaves clients never sampled (all-NaN alpha columns): the plot
    shows the 10 largest means over the rounds each client took part in, with no warning about them."""
    M = plots.MAX_LINES + 30
    rounds = [{"round": 1, "participants": list(range(0, 20)), "alpha": [(i + 1) / 210 for i in range(20)]},
              {"round": 2, "participants": list(range(10, 30)), "alpha": [1 / 20] * 20}]
    fig = plots.alpha_figure(history(rounds, [], M=M))
    labels = [line.get_label() for line in fig.axes[0].get_lines() if line.get_label().startswith("client")]
    # means: clients 0-9 took part once ((i+1)/210); 10-19 twice ((i+1)/210 and 1/20); 20-29 once, 1/20
    means = {i: (i + 1) / 210 for i in range(10)}
    means.update({i: ((i + 1) / 210 + 1 / 20) / 2 for i in range(10, 20)})
    means.update({i: 1 / 20 for i in range(20, 30)})
    top = sorted(means, key=lambda i: -means[i])[:10]
    assert labels == [f"client {i}" for i in top]
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]
