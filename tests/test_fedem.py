"""FedEM (algorithm=fedem): the E-step against a hand computation, pi_i after a round, the M-step
against hand-written weighted SGD, K = 1 against FedAvg, and the mixture prediction by hand."""
from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch import nn

from fedfew.algorithms import ALGORITHMS
from fedfew.algorithms.fedem import Mixture, responsibilities
from fedfew.config.rules import validate_config
from fedfew.core.seeding import derive_seed
from fedfew.simulator.evaluation import finetune_copy

from conftest import CONF_DIR, compose_config
from test_baselines import BATCH, LR, client_xy, close, flat, small_sim, weighted_mean


def test_registered_with_a_documented_config_and_k_models_both_ways():
    assert "fedem" in ALGORITHMS.names()
    path = Path(CONF_DIR) / "algorithm" / "fedem.yaml"
    assert OmegaConf.load(path).name == "fedem"
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#") and not line.startswith("name:"):
            assert "#" in line, f"undocumented value {line!r}"
    validate_config(compose_config("algorithm=fedem"))
    assert compose_config("algorithm=fedem", "partition=dirichlet").algorithm.K == 3
    assert compose_config("algorithm=fedem").algorithm.K == 4  # digits' default: clustered, 4 groups
    comm = ALGORITHMS.get("fedem").communication(OmegaConf.create({"K": 3}), nn.Linear(5, 4))  # D = 24
    assert comm == (3 * 24, 3 * 24)  # the K components up and down; pi_i never leaves the client


# -- E-step ----------------------------------------------------------------------------------------

def test_e_step_matches_a_hand_computation_on_3_samples_and_2_components():
    pi = torch.tensor([0.25, 0.75], dtype=torch.float64)
    losses = torch.tensor([[0.5, 1.5], [2.0, 0.1], [1.0, 1.0]], dtype=torch.float64)  # l_sk = -log p_k(y_s|x_s)
    q, new_pi, nll = responsibilities(pi.log(), losses)
    # by hand: q_s1 = pi_1 e^{-l_s1} / (pi_1 e^{-l_s1} + pi_2 e^{-l_s2})
    expected = []
    evidence = []
    for l1, l2 in losses.tolist():
        a, b = 0.25 * math.exp(-l1), 0.75 * math.exp(-l2)
        expected.append([a / (a + b), b / (a + b)])
        evidence.append(a + b)
    expected = torch.tensor(expected, dtype=torch.float64)
    torch.testing.assert_close(q, expected, rtol=1e-12, atol=1e-14)
    # sample 3: equal losses -> q = pi exactly
    torch.testing.assert_close(q[2], pi, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(new_pi, expected.mean(dim=0), rtol=1e-12, atol=1e-14)
    assert float(new_pi.sum()) == pytest.approx(1.0, abs=1e-12)
    assert float(nll) == pytest.approx(-sum(math.log(e) for e in evidence) / 3, rel=1e-12)


def test_e_step_is_stable_in_log_space_and_handles_diverged_components():
    # losses of 1000 nats: exp(-l) underflows even in float64, the responsibilities do not
    pi = torch.tensor([0.5, 0.5], dtype=torch.float64)
    q, new_pi, _ = responsibilities(pi.log(), torch.tensor([[1000.0, 1001.0]]))
    torch.testing.assert_close(q[0], torch.tensor([1 / (1 + math.exp(-1)), 1 / (1 + math.e)], dtype=torch.float64))
    # a NaN / inf loss is likelihood 0; a sample with no finite likelihood keeps the prior
    q, new_pi, nll = responsibilities(torch.tensor([0.2, 0.8]).log(), torch.tensor([[float("nan"), 1.0],
                                                                                 [float("inf"), float("nan")]]))
    assert q[0].tolist() == [0.0, 1.0]
    torch.testing.assert_close(q[1], torch.tensor([0.2, 0.8], dtype=torch.float64))
    assert math.isinf(float(nll))
    # no samples: pi unchanged
    _, same, _ = responsibilities(torch.tensor([0.3, 0.7]).log(), torch.zeros((0, 2)))
    torch.testing.assert_close(same, torch.tensor([0.3, 0.7], dtype=torch.float64))


# -- a round -----------------------------------------------------------------------------------------

def weighted_sgd(model, x, y, q, *, seed, lr=LR, batch_size=BATCH):
    """One epoch of plain SGD on (1/|B|) sum_{s in B} q_s CE_s, in train_local's sample order."""
    model = copy.deepcopy(model)
    torch.manual_seed(seed)
    order = torch.randperm(len(y))
    for start in range(0, len(y), batch_size):
        b = order[start : start + batch_size]
        loss = (F.cross_entropy(model(x[b]), y[b], reduction="none") * q[b]).mean()
        grads = torch.autograd.grad(loss, list(model.parameters()))
        with torch.no_grad():
            for p, g in zip(model.parameters(), grads):
                p -= lr * g
    return model


def test_a_round_by_hand_e_step_pi_and_m_step(tmp_path, cpu_fabric):
    """K = 2, 4 clients, one round: pi_i is the mean responsibility of the broadcast components
    (eval mode) and sums to 1; each server component is the n_i-weighted mean of the clients'
    copies trained on the q-weighted loss from it (hand-written SGD)."""
    sim = small_sim(tmp_path, cpu_fabric, "fedem", "algorithm.K=2")
    start = [copy.deepcopy(m) for m in sim.module.models]
    trained = {0: [], 1: []}
    pis = []
    for i in range(4):
        x, y = client_xy(sim, i)
        with torch.no_grad():
            losses = torch.stack([F.cross_entropy(m.eval()(x), y, reduction="none") for m in start], dim=1)
        q, pi, _ = responsibilities(torch.full((2,), 0.5, dtype=torch.float64).log(), losses)
        pis.append(pi)
        for k in range(2):
            trained[k].append(weighted_sgd(start[k].train(), x, y, q[:, k].float(),
                                           seed=derive_seed(0, "local", 1, i, k)))
    logs = sim.run_round(1)
    sizes = [len(sim.host_data.clients[i].train) for i in range(4)]
    for i in range(4):
        saved = sim.ctx.host_state[i]["pi"]
        close(saved, pis[i], rtol=1e-6, atol=1e-6)
        assert float(saved.sum()) == pytest.approx(1.0, abs=1e-12)
        assert (saved > 0).all()
    close(logs["w"], torch.stack(pis), rtol=1e-6, atol=1e-6)
    assert logs["assignment"].tolist() == torch.stack(pis).argmax(dim=1).tolist()
    n = torch.tensor(sizes, dtype=torch.float64)
    close(logs["effective_step"], (n[:, None] * torch.stack(pis)).sum(0) / n.sum(), rtol=1e-6, atol=1e-6)
    for k in range(2):
        close(flat(sim.module.models[k]), weighted_mean(trained[k], sizes), atol=1e-5)
    # the scored model's assignment is argmax pi; pi stays on the client for the next round
    assert sim.algorithm.model_assignment(sim.host_data.clients[0], 0) == int(pis[0].argmax())


def test_k1_is_fedavg(tmp_path, cpu_fabric):
    """With one component q = 1, pi = 1: the same server model and per-client accuracy as FedAvg
    after 3 rounds (same seed and config), within 1e-6."""
    runs = {}
    for alg, extra in (("fedavg", ()), ("fedem", ("algorithm.K=1",))):
        sim = small_sim(tmp_path / alg, cpu_fabric, alg, "rounds=3", "eval_every=3", *extra)
        result = sim.fit()
        runs[alg] = (flat(sim.module.models[0]), [c["acc"] for c in result["clients"]], result["summary"])
    (w_avg, acc_avg, s_avg), (w_em, acc_em, s_em) = runs["fedavg"], runs["fedem"]
    torch.testing.assert_close(w_em, w_avg, rtol=0, atol=1e-6)
    assert acc_em == pytest.approx(acc_avg, abs=1e-6)
    assert s_em["acc_mean"] == pytest.approx(s_avg["acc_mean"], abs=1e-6)


# -- prediction --------------------------------------------------------------------------------------

def test_mixture_prediction_is_the_pi_weighted_sum_of_softmaxes():
    torch.manual_seed(0)
    models = [nn.Linear(3, 4) for _ in range(3)]
    pi = torch.tensor([0.2, 0.5, 0.3], dtype=torch.float64)
    x = torch.randn(6, 3)
    mixture = Mixture(models, pi)
    with torch.no_grad():
        by_hand = sum(float(p) * F.softmax(m(x), dim=1) for p, m in zip(pi, models))
        out = mixture(x)
    torch.testing.assert_close(out.exp(), by_hand, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(out.exp().sum(dim=1), torch.ones(6), rtol=1e-6, atol=1e-6)
    assert out.argmax(dim=1).tolist() == by_hand.argmax(dim=1).tolist()
    # cross-entropy on the output is the mixture's negative log-likelihood
    y = torch.tensor([0, 1, 2, 3, 0, 1])
    assert float(F.cross_entropy(out, y)) == pytest.approx(float(-by_hand[torch.arange(6), y].log().mean()), rel=1e-5)
    # one component: exactly its log_softmax
    with torch.no_grad():
        assert torch.equal(Mixture(models[:1], torch.tensor([1.0]))(x), F.log_softmax(models[0](x), dim=1))
    # a diverged component (NaN weights) with pi_k = 0 takes no part: the others' mixture, no NaN
    broken = copy.deepcopy(models[2])
    with torch.no_grad():
        broken.weight.fill_(float("nan"))
        out = Mixture([models[0], models[1], broken], torch.tensor([0.4, 0.6, 0.0], dtype=torch.float64))(x)
        by_hand = 0.4 * F.softmax(models[0](x), dim=1) + 0.6 * F.softmax(models[1](x), dim=1)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.exp(), by_hand, rtol=1e-5, atol=1e-7)


def test_clients_are_scored_with_their_mixture_and_finetune_tunes_all_components(tmp_path, cpu_fabric):
    sim = small_sim(tmp_path, cpu_fabric, "fedem", "algorithm.K=2", "eval.also=[finetune]")
    sim.run_round(1)
    client = sim.host_data.clients[1]
    (scored,) = sim.algorithm.candidates(client)
    x, _ = client_xy(sim, 1)
    pi = sim.ctx.host_state[1]["pi"]
    with torch.no_grad():
        by_hand = sum(float(p) * F.softmax(m.eval()(x), dim=1) for p, m in zip(pi, sim.module.models))
        torch.testing.assert_close(scored.eval()(x).exp(), by_hand, rtol=1e-5, atol=1e-7)
    before = [flat(m) for m in sim.module.models]
    result = sim.evaluate(1)
    assert 0.0 <= result["also"]["finetune"]["summary"]["acc_mean"] <= 1.0
    for k, m in enumerate(sim.module.models):  # fine-tuning works on a copy of the mixture
        assert torch.equal(flat(m), before[k])
    # as the evaluation does it: the mixture copied whole, then fine-tuned; every component moves, pi stays
    tuned = finetune_copy(scored, copy.deepcopy(scored), sim.ctx, client, 1, 1)
    for k, component in enumerate(tuned.components):
        assert not torch.equal(flat(component), before[k]), f"component {k} was not fine-tuned"
    assert torch.equal(tuned.log_pi, scored.log_pi)


def test_a_client_that_never_took_part_is_scored_with_uniform_pi_and_assigned_component_0(tmp_path, cpu_fabric):
    """participation 0.5 of 4 clients: after round 1, the two absent clients have no pi of their own;
    their mixture weighs the K components equally and their model assignment is component 0."""
    sim = small_sim(tmp_path, cpu_fabric, "fedem", "algorithm.K=2", "participation=0.5")
    logs = sim.run_round(1)
    absent = sorted(set(range(4)) - set(logs["participants"]))
    assert len(absent) == 2 and all("pi" not in sim.ctx.host_state.get(i, {}) for i in absent)
    for i in absent:
        client = sim.host_data.clients[i]
        (mixture,) = sim.algorithm.candidates(client)
        torch.testing.assert_close(mixture.log_pi.exp(), torch.full((2,), 0.5))
        assert sim.algorithm.model_assignment(client, 0) == 0
    for i in logs["participants"]:  # the participants keep their own pi, summing to 1
        assert float(sim.ctx.host_state[i]["pi"].sum()) == pytest.approx(1.0, abs=1e-12)
