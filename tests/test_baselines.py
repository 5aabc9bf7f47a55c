"""The defining rule of every baseline, checked on a small problem against hand values or a
hand-written reimplementation (plain SGD written out, the rule applied by hand):

- FedAvg: the new global model is the sample-weighted mean of the clients' local models;
- FedProx: the local gradient carries mu_prox * (w - w_global);
- Local: no communication, each client continues its own model;
- IFCA: each client trains the argmin-loss model, an untaken model is unchanged;
- FedRep: only the body is averaged, heads stay personal;
- Ditto: the personal update carries lam * (v - w_global), clients are scored with v;
- APFL: the scored model is alpha * v + (1 - alpha) * w, alpha follows <v - w, grad f(v_bar)>.
"""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch import nn

from fedfew.algorithms import ALGORITHMS
from fedfew.algorithms._averaging import WeightedSum
from fedfew.algorithms._client_training import proximal_term
from fedfew.algorithms.apfl import alpha_step
from fedfew.algorithms.ifca import assign
from fedfew.core.local_training import evaluate_model
from fedfew.core.model_set import assign_flat_, flat_parameters
from fedfew.core.seeding import derive_seed
from fedfew.simulator.simulation import Simulation

from conftest import CONF_DIR, compose_config

LR, BATCH = 0.1, 32
BASELINES = ("fedavg", "fedprox", "local", "ifca", "fedrep", "ditto", "apfl")


def small_sim(tmp_path, cpu_fabric, algorithm: str, *overrides: str, epochs: int = 1) -> Simulation:
    cfg = compose_config(
        "num_clients=4", "partition=dirichlet", f"algorithm={algorithm}", "rounds=1", f"local_epochs={epochs}",
        f"dataset.batch_size={BATCH}", f"optim.lr={LR}", "logger=none", *overrides,
    )
    return Simulation(cfg, cpu_fabric, tmp_path)


def client_xy(sim: Simulation, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx = torch.as_tensor(sim.host_data.clients[i].train)
    return sim.host_data.inputs[idx], sim.host_data.targets[idx]


def manual_sgd(model, x, y, *, epochs, seed, only=None, prox=None, lr=LR, batch_size=BATCH):
    """Plain SGD written out, in train_local's sample order (torch.manual_seed + randperm).

    only: parameter-name prefix to train (others frozen); prox: (coeff, reference model)
    adding coeff * (p - p_ref) to each gradient.
    """
    model = copy.deepcopy(model)
    named = [(n, p) for n, p in model.named_parameters() if only is None or n.startswith(only)]
    refs = dict(prox[1].named_parameters()) if prox else {}
    torch.manual_seed(seed)
    n = len(y)
    for _ in range(epochs):
        order = torch.randperm(n)
        for start in range(0, n, batch_size):
            b = order[start : start + batch_size]
            loss = F.cross_entropy(model(x[b]), y[b])
            grads = torch.autograd.grad(loss, [p for _, p in named])
            with torch.no_grad():
                for (name, p), g in zip(named, grads):
                    if prox:
                        g = g + prox[0] * (p - refs[name])
                    p -= lr * g
    return model


def flat(model: nn.Module) -> torch.Tensor:
    return flat_parameters(model).double()


def weighted_mean(models, sizes) -> torch.Tensor:
    n = torch.tensor(sizes, dtype=torch.float64)
    return (torch.stack([flat(m) for m in models]) * n[:, None]).sum(0) / n.sum()


def close(a, b, **kw):
    torch.testing.assert_close(a.double(), b.double(), rtol=kw.get("rtol", 1e-5), atol=kw.get("atol", 1e-6))


# -- registry, configs, communication -------------------------------------------------------------

def test_every_baseline_is_registered_with_a_documented_config():
    names = ALGORITHMS.names()
    for name in (*BASELINES, "fedfew"):
        assert name in names
        path = Path(CONF_DIR) / "algorithm" / f"{name}.yaml"
        assert OmegaConf.load(path).name == name
        # every value carries a comment
        for line in path.read_text().splitlines():
            if line.strip() and not line.lstrip().startswith("#") and not line.startswith("name:"):
                assert "#" in line, f"{path.name}: undocumented value {line!r}"


def test_communication_per_client_and_round():
    body, head = nn.Linear(5, 3), nn.Linear(3, 2)  # 18 + 8 parameters, d = 26
    from fedfew.models.base import BodyHead

    model = BodyHead(body, head)
    cfg = {"fedfew": {"K": 3}, "ifca": {"K": 4}}
    comm = {a: ALGORITHMS.get(a).communication(OmegaConf.create(cfg.get(a, {})), model) for a in (*BASELINES, "fedfew")}
    assert comm["fedfew"] == (78, 78)           # K x d up and down
    assert comm["fedavg"] == comm["fedprox"] == comm["ditto"] == comm["apfl"] == (26, 26)
    assert comm["local"] == (0, 0)
    assert comm["ifca"] == (26, 104)            # one model up, all K down
    assert comm["fedrep"] == (18, 18)           # the body only


# -- FedAvg ------------------------------------------------------------------------------------------

def test_weighted_sum_is_the_sample_weighted_mean_and_leaves_empty_slots_alone():
    targets = [nn.Linear(2, 1, bias=False), nn.Linear(2, 1, bias=False)]
    base = [torch.zeros(2), torch.full((2,), 5.0)]
    for t, b in zip(targets, base):
        assign_flat_(t, b)
    acc = WeightedSum(K=2, dim=2)
    acc.add(0, 1.0, torch.tensor([0.0, 0.0]))   # client with n=1 sends theta = (0, 0)
    acc.add(0, 3.0, torch.tensor([4.0, 8.0]))   # client with n=3 sends theta = (4, 8)
    totals = acc.all_reduce_().apply_(targets, base)
    assert flat_parameters(targets[0]).tolist() == [3.0, 6.0]  # (1*0 + 3*4)/4, (1*0 + 3*8)/4
    assert flat_parameters(targets[1]).tolist() == [5.0, 5.0]  # nobody trained model 1
    assert totals.tolist() == [4.0, 0.0]


def test_fedavg_round_gives_the_sample_weighted_mean_of_local_models(tmp_path, cpu_fabric):
    sim = small_sim(tmp_path, cpu_fabric, "fedavg")
    before = copy.deepcopy(sim.module.models[0])
    local = [manual_sgd(before, *client_xy(sim, i), epochs=1, seed=derive_seed(0, "local", 1, i, 0)) for i in range(4)]
    sim.run_round(1)
    close(flat(sim.module.models[0]), weighted_mean(local, sim.num_train.tolist()))
    client = sim.host_data.clients[2]
    assert sim.algorithm.candidates(client) == [sim.module.models[0]]  # scored with the global model


# -- FedProx -----------------------------------------------------------------------------------------

def test_proximal_term_value_and_gradient_by_hand():
    model = nn.Linear(2, 1)  # 3 parameters
    assign_flat_(model, torch.tensor([3.0, 1.0, -1.0]))
    reference = [torch.ones_like(p) for p in model.parameters()]
    penalty = proximal_term(reference, 0.5)(model)
    penalty.backward()
    # (0.5 / 2) * ((3-1)^2 + 0 + (-1-1)^2) = 2 ; gradient 0.5 * (w - w_ref) = (1, 0, -1)
    assert float(penalty.detach()) == 2.0
    assert torch.cat([p.grad.reshape(-1) for p in model.parameters()]).tolist() == [1.0, 0.0, -1.0]


def test_fedprox_local_gradient_has_the_mu_prox_term(tmp_path, cpu_fabric):
    sim = small_sim(tmp_path, cpu_fabric, "fedprox", "algorithm.mu_prox=0.01")
    alg = sim.algorithm
    alg.begin_round(1, [0, 1, 2, 3])
    working = sim.module.working
    assign_flat_(working, flat_parameters(sim.module.models[0]) + 2.0)  # w = w_global + 2
    working.zero_grad()
    alg.penalty(working).backward()
    grad = torch.cat([p.grad.reshape(-1) for p in working.parameters()])
    close(grad, torch.full_like(grad, 0.02))  # mu_prox * (w - w_global) = 0.01 * 2


def test_fedprox_round_matches_sgd_with_the_proximal_gradient(tmp_path, cpu_fabric):
    mu = 1.0  # large, so that the term visibly changes the result
    sim = small_sim(tmp_path, cpu_fabric, "fedprox", f"algorithm.mu_prox={mu}", epochs=2)
    before = copy.deepcopy(sim.module.models[0])
    seeds = [derive_seed(0, "local", 1, i, 0) for i in range(4)]
    prox = [manual_sgd(before, *client_xy(sim, i), epochs=2, seed=seeds[i], prox=(mu, before)) for i in range(4)]
    plain = [manual_sgd(before, *client_xy(sim, i), epochs=2, seed=seeds[i]) for i in range(4)]
    sim.run_round(1)
    sizes = sim.num_train.tolist()
    close(flat(sim.module.models[0]), weighted_mean(prox, sizes))
    assert (weighted_mean(prox, sizes) - weighted_mean(plain, sizes)).abs().max() > 1e-3


# -- Local -------------------------------------------------------------------------------------------

def test_local_clients_continue_their_own_models_without_communication(tmp_path, cpu_fabric):
    sim = small_sim(tmp_path, cpu_fabric, "local")
    init = copy.deepcopy(sim.module.models[0])
    sim.run_round(1)
    sim.run_round(2)
    assert torch.equal(flat(sim.module.models[0]), flat(init))  # the server model never moves
    for i in (0, 3):
        x, y = client_xy(sim, i)
        expected = manual_sgd(init, x, y, epochs=1, seed=derive_seed(0, "local", 1, i, 0))
        expected = manual_sgd(expected, x, y, epochs=1, seed=derive_seed(0, "local", 2, i, 0))
        saved = sim.ctx.host_state[i]["model"]
        assert saved.device.type == "cpu"
        close(saved, flat(expected))
        (scored,) = sim.algorithm.candidates(sim.host_data.clients[i])
        close(flat(scored), flat(expected))


# -- IFCA --------------------------------------------------------------------------------------------

def test_assign_is_the_argmin_with_nan_as_worst():
    losses = torch.tensor([[0.3, 0.1, 0.2], [float("nan"), 0.5, 0.4], [0.2, 0.2, 0.9]])
    assert assign(losses).tolist() == [1, 2, 0]  # ties go to the lowest index


def test_ifca_trains_the_argmin_model_and_leaves_an_untaken_one_unchanged(tmp_path, cpu_fabric):
    sim = small_sim(tmp_path, cpu_fabric, "ifca", "algorithm.K=3")
    with torch.no_grad():
        sim.module.models[2].head.weight.mul_(1000.0)  # model 2: huge, random logits, nobody's best
    before = [copy.deepcopy(m) for m in sim.module.models]
    losses = torch.tensor([[evaluate_model(m, sim.data, torch.as_tensor(c.train))[0] for m in before]
                           for c in sim.host_data.clients])
    expected = losses.argmin(dim=1)
    assert 2 not in expected.tolist() and len(set(expected.tolist())) == 2  # two clusters taken, model 2 not
    logs = sim.run_round(1)
    assert logs["assignment"].tolist() == expected.tolist()
    close(logs["loss"], losses)
    assert torch.equal(flat(sim.module.models[2]), flat(before[2]))  # untaken: bit-identical
    sizes = sim.num_train.tolist()
    for k in (0, 1):
        members = [i for i in range(4) if expected[i] == k]
        local = [manual_sgd(before[k], *client_xy(sim, i), epochs=1, seed=derive_seed(0, "local", 1, i, k))
                 for i in members]
        close(flat(sim.module.models[k]), weighted_mean(local, [sizes[i] for i in members]))


def test_ifca_models_start_independent(tmp_path, cpu_fabric):
    sim = small_sim(tmp_path, cpu_fabric, "ifca")
    flats = [flat(m) for m in sim.module.models]
    assert not torch.equal(flats[0], flats[1]) and not torch.equal(flats[1], flats[2])


# -- FedRep ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("cached", [True, False], ids=["cached-features", "frozen-body-training"])
def test_fedrep_averages_only_the_body(tmp_path, cpu_fabric, cached):
    sim = small_sim(tmp_path, cpu_fabric, "fedrep", "algorithm.head_epochs=2")
    assert sim.algorithm._cache_features  # the MLP body is deterministic
    sim.algorithm._cache_features = cached  # both head-phase paths give the same result
    before = copy.deepcopy(sim.module.models[0])
    local = []
    for i in range(4):
        x, y = client_xy(sim, i)
        m = manual_sgd(before, x, y, epochs=2, seed=derive_seed(0, "local", 1, i, "head"), only="head.")
        local.append(manual_sgd(m, x, y, epochs=1, seed=derive_seed(0, "local", 1, i, "body"), only="body."))
    sim.run_round(1)
    server = sim.module.models[0]
    close(flat(server.body), weighted_mean([m.body for m in local], sim.num_train.tolist()))
    assert torch.equal(flat(server.head), flat(before.head))  # the head is never averaged
    heads = [sim.ctx.host_state[i]["head"] for i in range(4)]
    for i in range(4):
        assert heads[i].device.type == "cpu"
        close(heads[i], flat(local[i].head))
    assert not torch.equal(heads[0], heads[1])
    # scored with the global body and its own head
    (scored,) = sim.algorithm.candidates(sim.host_data.clients[1])
    close(flat(scored.body), flat(server.body))
    close(flat(scored.head), heads[1])
    assert all(p.requires_grad for p in sim.module.working.parameters())  # freezing undone


# -- Ditto -------------------------------------------------------------------------------------------

def test_ditto_personal_update_has_the_lambda_term(tmp_path, cpu_fabric):
    lam = 0.5
    sim = small_sim(tmp_path, cpu_fabric, "ditto", f"algorithm.lam={lam}", epochs=2)
    alg = sim.algorithm
    # the term itself: gradient lam * (v - w_global) at v = w_global + 1
    alg.begin_round(1, [0, 1, 2, 3])
    assign_flat_(sim.module.working, flat_parameters(sim.module.models[0]) + 1.0)
    sim.module.working.zero_grad()
    alg._penalty(sim.module.working).backward()
    grad = torch.cat([p.grad.reshape(-1) for p in sim.module.working.parameters()])
    close(grad, torch.full_like(grad, lam))
    # one round: personal model = SGD with grad F + lam (v - w^t); global model = FedAvg
    before = copy.deepcopy(sim.module.models[0])
    personal, global_ = [], []
    for i in range(4):
        x, y = client_xy(sim, i)
        personal.append(manual_sgd(before, x, y, epochs=2, seed=derive_seed(0, "local", 1, i, "personal"),
                                   prox=(lam, before)))
        global_.append(manual_sgd(before, x, y, epochs=2, seed=derive_seed(0, "local", 1, i, 0)))
    without = manual_sgd(before, *client_xy(sim, 0), epochs=2, seed=derive_seed(0, "local", 1, 0, "personal"))
    sim.run_round(1)
    close(flat(sim.module.models[0]), weighted_mean(global_, sim.num_train.tolist()))
    for i in range(4):
        close(sim.ctx.host_state[i]["personal"], flat(personal[i]))
    assert (flat(personal[0]) - flat(without)).abs().max() > 1e-3  # the term matters
    (scored,) = alg.candidates(sim.host_data.clients[3])
    close(flat(scored), flat(personal[3]))  # scored with the personal model


# -- APFL --------------------------------------------------------------------------------------------

def test_apfl_alpha_step_clips_and_keeps_alpha_on_a_nan_gradient():
    assert alpha_step(0.5, 0.1, 2.0) == pytest.approx(0.3)             # 0.5 - 0.1 * 2
    assert alpha_step(0.5, 0.1, -2.0) == pytest.approx(0.7)
    assert alpha_step(0.5, 0.1, 10.0) == 0.0 and alpha_step(0.5, 0.1, -10.0) == 1.0  # clipped to [0, 1]
    assert alpha_step(0.5, 0.1, float("inf")) == 0.0 and alpha_step(0.5, 0.1, float("-inf")) == 1.0
    # a diverged personal model: the old min(1, max(0, nan)) logged alpha = 0; alpha now stays
    assert alpha_step(0.37, 0.1, float("nan")) == 0.37


def test_apfl_scores_the_alpha_mixture(tmp_path, cpu_fabric):
    sim = small_sim(tmp_path, cpu_fabric, "apfl", "algorithm.alpha=0.25", "algorithm.adaptive=false")
    alg, client = sim.algorithm, sim.host_data.clients[0]
    d = flat(sim.module.models[0]).numel()
    assign_flat_(sim.module.models[0], torch.full((d,), 3.0))          # w = 3
    alg.save_client(0, personal=torch.ones(d), alpha=torch.tensor(0.25))  # v = 1, alpha = 0.25
    (scored,) = alg.candidates(client)
    assert flat(scored).tolist() == [2.5] * d  # 0.25 * 1 + 0.75 * 3
    # and its output is the mixture model's output
    x = sim.data.inputs[:5]
    mixture = copy.deepcopy(sim.module.models[0])
    assign_flat_(mixture, torch.full((d,), 2.5))
    close(scored(x).detach(), mixture(x).detach())
    # a client that never took part is scored with the global model
    (fresh,) = alg.candidates(sim.host_data.clients[1])
    close(flat(fresh), flat(sim.module.models[0]))


def test_apfl_round_matches_the_paper_updates(tmp_path, cpu_fabric):
    """Two full-batch steps (batch >= n): w, v and alpha updated from the pre-step state."""
    alpha0, lr = 0.5, LR
    sim = small_sim(tmp_path, cpu_fabric, "apfl", f"algorithm.alpha={alpha0}", "algorithm.adaptive=true",
                    "dataset.batch_size=10000", epochs=2)
    before = copy.deepcopy(sim.module.models[0])
    expected = []
    for i in range(4):
        x, y = client_xy(sim, i)
        w = [p.detach().clone() for p in before.parameters()]
        v = [p.clone() for p in w]
        alpha = alpha0
        names = [n for n, _ in before.named_parameters()]
        for _ in range(2):
            v_bar = {n: (alpha * a + (1 - alpha) * b).requires_grad_() for n, a, b in zip(names, v, w)}
            g_bar = torch.autograd.grad(F.cross_entropy(torch.func.functional_call(before, v_bar, (x,)), y),
                                        list(v_bar.values()))
            w_req = {n: p.clone().requires_grad_() for n, p in zip(names, w)}
            g_w = torch.autograd.grad(F.cross_entropy(torch.func.functional_call(before, w_req, (x,)), y),
                                      list(w_req.values()))
            grad_alpha = sum(float(((a - b) * g).sum()) for a, b, g in zip(v, w, g_bar))
            w = [p - lr * g for p, g in zip(w, g_w)]
            v = [p - lr * alpha * g for p, g in zip(v, g_bar)]
            alpha = min(1.0, max(0.0, alpha - lr * grad_alpha))
        expected.append((w, v, alpha))
    sim.run_round(1)
    sizes = torch.tensor(sim.num_train.tolist(), dtype=torch.float64)
    global_ = sum(sizes[i] * torch.cat([p.reshape(-1) for p in expected[i][0]]).double() for i in range(4)) / sizes.sum()
    close(flat(sim.module.models[0]), global_)
    for i in range(4):
        w, v, alpha = expected[i]
        close(sim.ctx.host_state[i]["personal"], torch.cat([p.reshape(-1) for p in v]))
        assert abs(float(sim.ctx.host_state[i]["alpha"]) - alpha) < 1e-6
    assert any(abs(float(sim.ctx.host_state[i]["alpha"]) - alpha0) > 1e-6 for i in range(4))  # alpha moved


def test_clients_never_change_process_under_partial_participation():
    """Personal state lives on the process that owns the client: with partial participation
    each rank trains exactly its own clients among each round's participants."""
    from types import SimpleNamespace

    from fedfew.simulator.simulation import Simulation, select_participants

    sizes = torch.tensor([5, 9, 2, 7, 7, 1, 3, 8])
    ranks = [SimpleNamespace(num_clients=8, num_train=sizes, _owned=None,
                             fabric=SimpleNamespace(world_size=2, global_rank=r)) for r in range(2)]
    owned = [set(Simulation.my_clients(rank, list(range(8)))) for rank in ranks]
    assert owned[0] | owned[1] == set(range(8)) and not owned[0] & owned[1]
    cfg = OmegaConf.create({"participation": 0.5, "clients_per_round": None, "seed": 0})
    for rnd in range(1, 6):
        participants = select_participants(cfg, rnd, 8)
        mine = [Simulation.my_clients(rank, participants) for rank in ranks]
        assert sorted(mine[0] + mine[1]) == participants
        assert set(mine[0]) <= owned[0] and set(mine[1]) <= owned[1]
