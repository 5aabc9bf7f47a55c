"""K=auto (fedfew.stch.auto_k) and mu over rounds (fedfew.stch.mu_schedule), issue 19: the retire rule on
loss matrices computed by hand, its patience and order, K=auto that cannot retire equals fixed
K, a resume after K changed equals the uninterrupted run, the schedules' values, and the
config errors raised before any compute."""
from __future__ import annotations

import math

import pytest
import torch
from omegaconf import OmegaConf

from conftest import compose_config
from fedfew.stch.auto_k import AutoK, redundant_models
from fedfew.core.checkpoint import checkpoint_path
from fedfew.config.rules import ConfigError, validate_config
from fedfew.core.model_set import KModelSet
from fedfew.stch.mu_schedule import effective_clients, round_mu, spread_mu
from fedfew.simulator.simulation import Simulation
from fedfew.reporting.history_file import load_history
from torch import nn


def _w(L: torch.Tensor, mu: float) -> torch.Tensor:
    return torch.softmax(-L / mu, dim=1)


# -- the rule on constructed loss matrices ----------------------------------------------------

def test_duplicate_pair_by_hand():
    """Clients 0, 1 are served by models 0 and 1 within 0.1 nats (< mu = 0.5), models 0+1 hold
    almost all their weight; model 2 serves clients 2, 3. Model 1 is the best of one of the
    pair's clients, as model 0 is, so the tie goes to the soft counts: client 3 prefers model 0
    (3.0 < 3.1), so sum_i w_i1 < sum_i w_i0 and model 1 is the duplicate, of model 0."""
    L = torch.tensor([[0.1, 0.2, 3.0], [0.2, 0.1, 3.0], [3.0, 3.0, 0.1], [3.0, 3.1, 0.2]], dtype=torch.float64)
    mu = 0.5
    r = redundant_models(L, _w(L, mu), mu)
    assert r.unserved.tolist() == [False, False, False]
    assert r.duplicate_of.tolist() == [-1, 0, -1]
    assert r.served.tolist() == [1, 1, 2]
    assert float(r.gap[1]) == pytest.approx(0.1)
    e = math.exp
    pair = (e(-0.2) + e(-0.4)) / (e(-0.2) + e(-0.4) + e(-6.0))  # client 0 (and 1): w_i0 + w_i1 at mu = 0.5
    assert float(r.pair_weight[1]) == pytest.approx(pair, rel=1e-12)
    assert math.isnan(float(r.gap[0])) and math.isnan(float(r.gap[2]))
    assert [r.reason(k) for k in range(3)] == [None, "duplicate", None]


def test_gap_over_mu_is_not_a_duplicate_when_the_next_model_is_close():
    """Models 0 and 1 are 0.6 nats apart on client 1 (> mu = 0.5), and model 2 is only 0.2
    nats behind the pair there (half of it, 0.1, is below mu): not a duplicate."""
    L = torch.tensor([[0.1, 0.2, 1.0], [0.8, 0.2, 1.0], [3.0, 3.0, 0.1]], dtype=torch.float64)
    r = redundant_models(L, _w(L, 0.5), 0.5)
    assert r.duplicate_of.tolist() == [-1, -1, -1] and not bool(r.unserved.any())


def test_a_pair_far_from_every_other_model_is_a_duplicate_beyond_mu():
    """A small mu (0.05): models 0 and 1 serve clients 0-2 (one of them fits client 0 better by
    0.3 nats, > mu), model 2 serves client 3 and is 2.5+ nats worse on clients 0-2. Each of the
    pair's clients has its two losses closer than half the margin to the next model
    (0.3 <= (3.0 - 0.4) / 2): a duplicate. Model 1 is the best of 2 clients, model 0 of 1, so
    model 0 is the one to retire."""
    L = torch.tensor([[0.1, 0.4, 3.0], [0.3, 0.2, 3.1], [0.35, 0.25, 2.9], [3.0, 3.0, 0.2]], dtype=torch.float64)
    r = redundant_models(L, _w(L, 0.05), 0.05)
    assert r.duplicate_of.tolist() == [1, -1, -1]
    assert float(r.gap[0]) == pytest.approx(0.3)
    L[0, 2] = 0.8  # model 2 now 0.4 behind the pair on client 0: half of it, 0.2, is below the gap 0.3
    assert redundant_models(L, _w(L, 0.05), 0.05).duplicate_of.tolist() == [-1, -1, -1]


def test_unserved_is_relative_to_mu():
    """Model 1 is 0.9 and 0.7 nats worse than the best on the two clients: unserved at
    mu = 0.5 (both gaps > mu), served at mu = 0.8 (client 1's gap 0.7 <= 0.8)."""
    L = torch.tensor([[0.1, 1.0], [0.2, 0.9]], dtype=torch.float64)
    assert redundant_models(L, _w(L, 0.5), 0.5).unserved.tolist() == [False, True]
    r = redundant_models(L, _w(L, 0.8), 0.8)
    assert r.unserved.tolist() == [False, False]
    # nor is it a duplicate of model 0 at mu = 0.8: client 0's gap, 0.9, exceeds mu; it stays
    assert r.duplicate_of.tolist() == [-1, -1]
    L[0, 1] = 0.85  # now both gaps are <= 0.8 and the pair holds all the weight: model 1 (the best of
    r = redundant_models(L, _w(L, 0.8), 0.8)  # no client) duplicates model 0
    assert r.duplicate_of.tolist() == [-1, 0] and float(r.gap[1]) == pytest.approx(0.75)


def test_models_that_have_not_separated_are_not_redundant():
    """The first rounds: 8 models within 0.05 nats of each other on every client (mu = 0.2).
    Every loss is within mu, but each client spreads its weight over all 8 models, so no pair
    holds a majority (2/8 each): nothing is redundant."""
    g = torch.Generator().manual_seed(0)
    L = 2.3 + 0.05 * torch.rand(20, 8, generator=g, dtype=torch.float64)
    w = _w(L, 0.2)
    assert float((w.max(dim=1).values * 2).max()) < 0.5  # no pair reaches 1/2
    r = redundant_models(L, w, 0.2)
    assert r.duplicate_of.tolist() == [-1] * 8 and not bool(r.unserved.any())


def test_redundant_models_rejects_bad_input():
    L = torch.ones(3, 2)
    with pytest.raises(ValueError, match="same"):
        redundant_models(L, torch.ones(3, 3) / 3, 0.1)
    with pytest.raises(ValueError, match="mu"):
        redundant_models(L, L / 2, 0.0)


# -- patience, order, K_min ------------------------------------------------------------------------

def _dup_round():
    """Models 0, 1 duplicate (clients 0, 1), model 2 serves client 2, model 3 unserved."""
    L = torch.tensor([[0.1, 0.15, 3.0, 5.0], [0.15, 0.1, 3.0, 5.0], [3.0, 3.0, 0.1, 5.0]], dtype=torch.float64)
    return L, _w(L, 0.5)


def test_patience_order_and_k_min():
    L, w = _dup_round()
    auto = AutoK(K_min=2, patience=2)
    ids = [0, 1, 2, 3]
    assert auto.step(1, L, w, 0.5, ids) is None  # first round redundant: streak 1 < 2
    assert auto.streak == {0: 0, 1: 1, 2: 0, 3: 1}
    position, change = auto.step(2, L, w, 0.5, ids)
    assert (position, change.model, change.reason, change.K) == (3, 3, "unserved", 3)  # unserved first
    assert change.text().startswith("round 2: retired model 3 (unserved")
    ids = [0, 1, 2]
    L3, w3 = L[:, :3], _w(L[:, :3], 0.5)
    position, change = auto.step(3, L3, w3, 0.5, ids)  # model 1's streak continues (3 rounds)
    assert (position, change.model, change.reason, change.partner, change.K) == (1, 1, "duplicate", 0, 2)
    assert change.gap == pytest.approx(0.05)
    assert auto.step(4, L3[:, [0, 2]], _w(L3[:, [0, 2]], 0.5), 0.5, [0, 2]) is None  # K_min = 2 reached
    assert [c.model for c in auto.changes] == [3, 1]


def test_a_break_resets_the_streak():
    L, w = _dup_round()
    auto = AutoK(K_min=1, patience=2)
    auto.step(1, L, w, 0.5, [0, 1, 2, 3])
    clean = torch.tensor([[0.1, 3.0, 3.0, 3.0], [3.0, 0.1, 3.0, 3.0], [3.0, 3.0, 0.1, 3.0], [3.0, 3.0, 3.0, 0.1]],
                         dtype=torch.float64)
    assert auto.step(2, clean, _w(clean, 0.5), 0.5, [0, 1, 2, 3]) is None
    assert auto.streak == {0: 0, 1: 0, 2: 0, 3: 0}
    state = auto.state_dict()
    again = AutoK(K_min=1, patience=2)
    again.load_state_dict(state)
    assert again.streak == auto.streak and again.changes == auto.changes


# -- the schedules of mu --------------------------------------------------------------------------

def _alg(**kw):
    return OmegaConf.create({"mu": 0.2, "mu_schedule": "constant", "mu_end": 0.01, "mu_ratio": 0.1, "mu_clients": 0.5,
                             **kw})


def test_mu_schedules_first_middle_last_round():
    R = 5
    cos = _alg(mu_schedule="cosine")
    assert [round_mu(cos, r, R, None, 10) for r in (1, 3, 5)] == pytest.approx([0.2, 0.105, 0.01])
    exp = _alg(mu_schedule="exponential")
    assert [round_mu(exp, r, R, None, 10) for r in (1, 3, 5)] == pytest.approx([0.2, math.sqrt(0.2 * 0.01), 0.01])
    assert [round_mu(_alg(), r, R, None, 10) for r in (1, 3, 5)] == [0.2, 0.2, 0.2]
    loss = _alg(mu_schedule="loss")
    assert round_mu(loss, 1, R, None, 10) == pytest.approx(0.1 * math.log(10))  # untrained: log C
    assert round_mu(loss, 3, R, torch.tensor([0.6, 1.0]), 10) == pytest.approx(0.08)
    assert round_mu(loss, 5, R, torch.tensor([0.05]), 10) == pytest.approx(0.005)
    with pytest.raises(ValueError, match="mu_schedule='linear'"):
        round_mu(_alg(mu_schedule="linear"), 1, R, None, 10)


@pytest.mark.parametrize("schedule", ["loss", "spread"])
def test_loss_schedules_make_w_scale_free(schedule):
    """mu set from the previous round's best losses: scaling every loss by 7 scales mu by 7 and
    leaves w unchanged."""
    L = torch.tensor([[0.3, 0.9], [1.2, 0.4], [0.5, 0.6], [0.2, 0.8]], dtype=torch.float64)
    cfg = _alg(mu_schedule=schedule)
    mu = round_mu(cfg, 2, 5, L.min(dim=1).values, 10, previous_mu=0.2)
    mu7 = round_mu(cfg, 2, 5, (7 * L).min(dim=1).values, 10, previous_mu=0.2)
    assert mu7 == pytest.approx(7 * mu) and mu != 0.2
    torch.testing.assert_close(_w(7 * L, mu7), _w(L, mu))


def test_spread_by_hand():
    """Best losses [0, 0, 0, 1]: with x = e^(1/mu) the weights are (1, 1, 1, x) / (3 + x) and
    1 / sum a_i^2 = (3 + x)^2 / (3 + x^2). Half of P = 4 clients: (3 + x)^2 = 2 (3 + x^2), so
    x^2 - 6x - 3 = 0, x = 3 + 2 sqrt(3) and mu = 1 / log(3 + 2 sqrt(3))."""
    best = torch.tensor([0.0, 0.0, 0.0, 1.0])
    mu = spread_mu(best, 0.5)
    assert mu == pytest.approx(1 / math.log(3 + 2 * math.sqrt(3)), rel=1e-9)
    assert effective_clients(best, mu) == pytest.approx(2.0, rel=1e-9)
    assert spread_mu(torch.cat([best, best]), 0.5) == pytest.approx(mu, rel=1e-9)  # every client duplicated
    # undefined (the previous mu is kept): equal losses, one client, or a target of at most one client
    assert spread_mu(torch.ones(5), 0.5) is None and spread_mu(torch.ones(1), 0.5) is None
    assert spread_mu(best, 0.25) is None
    cfg = _alg(mu_schedule="spread")
    assert round_mu(cfg, 1, 5, None, 10) == 0.2  # round 1: algorithm.mu
    assert round_mu(cfg, 2, 5, torch.ones(5), 10, previous_mu=0.07) == 0.07
    assert round_mu(cfg, 2, 5, best, 10, previous_mu=0.07) == pytest.approx(mu)


# -- config errors before any compute ------------------------------------------------------------

@pytest.mark.parametrize("overrides,needle", [
    (["algorithm.K=auto", "algorithm.K_max=0"], "algorithm.K_max=0: allowed integer >= 1"),
    (["algorithm.K=auto", "algorithm.K_max=25"], "algorithm.K_max=25 > num_clients=20"),
    (["algorithm.K=auto", "algorithm.K_min=5", "algorithm.K_max=4"], "algorithm.K_min=5 > algorithm.K_max=4"),
    (["algorithm=fedavg", "+algorithm.K=auto"], "algorithm.K=auto: algorithm=fedavg has no automatic K"),
    (["algorithm=ifca", "algorithm.K=auto"], "algorithm.K=auto: algorithm=ifca has no automatic K"),
    (["algorithm.mu_schedule=cosine", "algorithm.mu=0.1", "algorithm.mu_end=0.5"],
     "algorithm.mu_end=0.5 > algorithm.mu=0.1 with mu_schedule=cosine"),
    (["algorithm.mu_schedule=exponential", "algorithm.mu=0.2", "algorithm.mu_end=1.0"], "mu_end=1.0 > algorithm.mu=0.2"),
    (["algorithm.mu_schedule=linear"], "algorithm.mu_schedule='linear': allowed constant | cosine"),
    (["algorithm.mu_schedule=spread", "algorithm.mu_clients=1.0"], "algorithm.mu_clients=1.0: allowed number in (0, 1)"),
    (["algorithm.K=many"], "algorithm.K='many': allowed integer >= 1, or auto"),
])
def test_bad_auto_k_and_mu_settings_are_named(overrides, needle):
    with pytest.raises(ConfigError) as err:
        validate_config(compose_config(*overrides))
    assert needle in str(err.value)


def test_good_settings_pass():
    validate_config(compose_config("algorithm.K=auto"))
    validate_config(compose_config("algorithm.K=auto", "algorithm.K_max=20", "algorithm.mu_schedule=loss"))
    validate_config(compose_config("algorithm.mu_schedule=spread", "algorithm.mu_clients=0.25"))
    validate_config(compose_config("algorithm.mu_schedule=cosine", "algorithm.mu=0.2", "algorithm.mu_end=0.2"))  # mu_end = mu


# -- the K-model set ---------------------------------------------------------------------------------

def test_retire_keeps_ids_and_order():
    module = KModelSet(lambda: nn.Linear(2, 2), K=4)
    weights = [m.weight.detach().clone() for m in module.models]
    assert module.retire_(1) == 1
    assert module.model_ids == [0, 2, 3] and module.K == 3 and module.initial_K == 4
    torch.testing.assert_close(module.models[1].weight, weights[2])
    other = KModelSet(lambda: nn.Linear(2, 2), K=4)
    other.keep_models_([0, 3])
    assert other.model_ids == [0, 3]
    torch.testing.assert_close(other.models[1].weight, weights[3])
    with pytest.raises(ValueError, match="not in the set"):
        other.keep_models_([1])
    other.retire_(0)
    with pytest.raises(ValueError, match="cannot retire"):
        other.retire_(0)


# -- runs --------------------------------------------------------------------------------------------

SMALL = ("num_clients=4", "partition=iid", "logger=none", "trainer.threads=1")


def _state(sim):
    return {k: v.clone() for k, v in sim.module.models.state_dict().items()}


@pytest.mark.slow
def test_auto_that_cannot_retire_equals_fixed_k(cpu_fabric, tmp_path):
    """K=auto with K_min = K_max = 3 (no retirement possible) gives the parameters of K = 3."""
    runs = {}
    for name, extra in {"fixed": ["algorithm.K=3"],
                        "auto": ["algorithm.K=auto", "algorithm.K_max=3", "algorithm.K_min=3", "algorithm.auto_patience=1"]}.items():
        cfg = compose_config(*SMALL, "rounds=2", "algorithm.mu=5.0", *extra)
        sim = Simulation(cfg, cpu_fabric, tmp_path / name)
        logs = [sim.run_round(r) for r in (1, 2)]
        runs[name] = (_state(sim), logs, sim.module.model_ids)
    (fixed, fixed_logs, fixed_ids), (auto, auto_logs, auto_ids) = runs["fixed"], runs["auto"]
    assert fixed_ids == auto_ids == [0, 1, 2]
    assert fixed.keys() == auto.keys()
    for key in fixed:
        assert torch.equal(fixed[key], auto[key]), key
    assert torch.equal(fixed_logs[1]["w"], auto_logs[1]["w"])
    # mu = 5 nats makes every pair of the 3 models a duplicate: only K_min stopped the retirement
    assert "model_set_change" not in auto_logs[1]


@pytest.mark.slow
def test_resume_after_k_changed_gives_the_uninterrupted_models(cpu_fabric, tmp_path):
    """mu_schedule=loss with mu_ratio = 20 (mu ~ 45 nats: every pair of models is a duplicate)
    and patience 1: K=auto retires one model after round 1 and one after round 2. A checkpoint
    after round 1 (K = 2), resumed, ends with the same model, ids, changes and parameters."""
    cfg = compose_config(*SMALL, "rounds=3", "algorithm.K=auto", "algorithm.K_max=3", "algorithm.auto_patience=1",
                         "algorithm.mu_schedule=loss", "algorithm.mu_ratio=20")
    whole = Simulation(cfg, cpu_fabric, tmp_path / "whole")
    whole_logs = [whole.run_round(r) for r in (1, 2, 3)]
    assert [h["K"] for h in whole_logs] == [3, 2, 1]
    assert whole_logs[0]["mu"] == pytest.approx(20 * math.log(10))
    assert [c.round for c in whole.algorithm.auto.changes] == [1, 2]

    first = Simulation(cfg, cpu_fabric, tmp_path / "part")
    first.history.append(first.run_round(1))
    first.save_checkpoint(1)
    assert first.module.K == 2
    resumed = Simulation(cfg, cpu_fabric, tmp_path / "resumed")
    resumed.load_state_dict(torch.load(checkpoint_path(tmp_path / "part"), weights_only=False))
    assert resumed.module.model_ids == first.module.model_ids
    logs = [resumed.run_round(r) for r in (2, 3)]
    assert logs[0]["mu"] == whole_logs[1]["mu"]  # the loss level of round 1 came with the checkpoint
    assert resumed.module.model_ids == whole.module.model_ids and len(whole.module.model_ids) == 1
    assert [c.as_dict() for c in resumed.algorithm.auto.changes] == [c.as_dict() for c in whole.algorithm.auto.changes]
    a, b = _state(whole), _state(resumed)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    summary = resumed.algorithm.summary()
    assert summary["K"] == 1 and summary["K_initial"] == 3 and len(summary["K_changes"]) == 2


@pytest.mark.slow
def test_every_change_of_k_is_logged(tmp_path):
    """A real run (CLI, W&B offline) whose K=auto retires a model after rounds 1 and 2 (mu ~ 45
    nats: every pair is a duplicate; patience 1): metrics.csv has K, mu and the change text in
    the rounds of the changes and per-model columns by model id; the history and results.json
    hold the model ids and changes; W&B gets the change table and the final one; the console
    prints the K=auto line."""
    import csv
    import json

    from fedfew.reporting.wandb_monitor import load_table, read_wandb_run
    from test_monitoring import train

    run_dir = tmp_path / "run"
    proc = train(tmp_path, f"hydra.run.dir={run_dir}", "num_clients=4", "partition=iid", "rounds=3", "eval_every=3",
                 "algorithm.K=auto", "algorithm.K_max=3", "algorithm.auto_patience=1", "algorithm.mu_schedule=loss",
                 "algorithm.mu_ratio=20", "logger=wandb", "logger.plots=false", "trainer.threads=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = list(csv.DictReader((run_dir / "metrics.csv").open()))
    assert [r["K"] for r in rows] == ["3.0", "2.0", "1.0"]
    assert float(rows[0]["mu"]) == pytest.approx(20 * math.log(10))
    changes = [r["model_set_change"] for r in rows]
    assert changes[0].startswith("round 1: retired model ") and "duplicate of model" in changes[0]
    assert changes[1].startswith("round 2: retired model ") and changes[2] == ""
    results = json.loads((run_dir / "results.json").read_text())
    # communication counts the models each round had (FedFew sends K models down and K deltas up)
    sent = [int(float(r["bytes_up"])) for r in rows]
    assert sent == [3 * sent[2], 2 * sent[2], sent[2]] and results["budget"]["bytes_up_total"] == sum(sent)
    s = results["summary"]
    assert s["K"] == 1 and s["K_initial"] == 3 and len(s["model_ids"]) == 1
    assert [c["text"] for c in s["K_changes"]] == changes[:2]
    kept = s["model_ids"][0]
    assert {c["model"] for c in s["K_changes"]} | {kept} == {0, 1, 2}
    assert s["models_served"][kept] == 4 and sum(s["models_served"]) == 4  # one entry per model id
    assert all(c["model"] == kept for c in results["clients"])
    # the last round trained only the model left: its per-model columns, and no others
    assert rows[2][f"effective_step/{kept}"] != "" and all(rows[2][f"effective_step/{m}"] == "" for m in {0, 1, 2} - {kept})
    history = load_history(run_dir)
    assert history["K"] == 3 and history["model_ids"] == [kept]
    assert [len(r["model_ids"]) for r in history["rounds"]] == [3, 2, 1]
    assert [r.get("model_set_change", "") for r in history["rounds"]] == changes
    assert all(set(r["assignment"]) <= set(r["model_ids"]) for r in history["rounds"])
    assert f"K=auto: 1 of 3 models left, ids [{kept}]" in proc.stdout
    run = read_wandb_run(run_dir)
    logged = [h for h in run.history if "round" in h]
    assert [h["train/K"] for h in logged] == [3, 2, 1]
    table = load_table(run, logged[1]["model_set/changes"])
    assert [r["change"] for r in table] == changes[:2]
    final = [h for h in run.history if "summary/K_changes" in h][0]
    assert [r["text"] for r in load_table(run, final["summary/K_changes"])] == changes[:2]
    assert run.summary["final/K"] == 1
