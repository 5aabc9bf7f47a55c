"""Baselines II: the defining rule of each, checked against hand values or a hand-written
reimplementation, plus a short end-to-end run on digits.

- FedMGDA+: min-norm weights on the simplex within the epsilon box (hand cases, an exact
  projection, a reference QP solver), the server step w + eta * sum_i lambda_i d_i / ||d_i||;
- CFL: split a cluster whose updates disagree (opposite), not one whose updates agree, only
  after warm-up and while a model slot is free; the halves take their own mean updates;
- FedSoft: importance weights (hand count, floor, rows sum to 1), the proximal gradient
  lam * sum_k u_k (w - c_k), centres = sum_i u_ik n_i w_i / sum_i u_ik n_i;
- FedAMP: attention weights for a hand-computed 3-client case, personal step with
  (lam / alphaK) * (w - u_i), cloud models u_i = sum_j xi_ij w_j;
- FedMTL: the regulariser's gradient lam * W Omega against autograd, personal step with that
  gradient, the server's mean over every client's latest model.
"""
from __future__ import annotations

import copy
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from fedfew.algorithms import ALGORITHMS
from fedfew.algorithms._client_training import proximal_term
from fedfew.algorithms.cfl import bipartition, cosine_similarity, should_split
from fedfew.algorithms.fedamp import attention_weights, squared_distances
from fedfew.algorithms.fedmgda import min_norm_weights, project_simplex_box, weight_bounds
from fedfew.algorithms.fedmtl import centering_omega, regulariser, regulariser_gradient
from fedfew.algorithms.fedsoft import importance_weights, per_sample_losses, proximal_centre
from fedfew.config.rules import ConfigError, validate_config
from fedfew.core.model_set import assign_flat_
from fedfew.core.seeding import derive_seed

from conftest import CONF_DIR, compose_config
from test_baselines import client_xy, close, flat, manual_sgd, small_sim

NEW = ("fedamp", "fedmtl", "cfl", "fedsoft", "fedmgda", "fedem")


def with_flat(model: nn.Module, vector: torch.Tensor) -> nn.Module:
    """A copy of ``model`` holding the parameters ``vector``."""
    out = copy.deepcopy(model)
    assign_flat_(out, vector.to(torch.float32))
    return out


def rows_for(sim, updates: list[torch.Tensor], valid=None) -> dict[str, torch.Tensor]:
    """Gathered rows as end_round sees them: vector (P, d), valid (P, 1), loss (P, 1)."""
    P = len(updates)
    valid = [1.0] * P if valid is None else valid
    return {"vector": torch.stack([u.double() for u in updates]),
            "valid": torch.tensor(valid, dtype=torch.float64)[:, None],
            "loss": torch.zeros((P, 1), dtype=torch.float64)}


# -- registry, configs, communication -------------------------------------------------------------

def test_new_baselines_are_registered_with_documented_configs():
    names = ALGORITHMS.names()
    for name in NEW:
        assert name in names
        path = Path(CONF_DIR) / "algorithm" / f"{name}.yaml"
        assert OmegaConf.load(path).name == name
        for line in path.read_text().splitlines():
            if line.strip() and not line.lstrip().startswith("#") and not line.startswith("name:"):
                assert "#" in line, f"{path.name}: undocumented value {line!r}"
        validate_config(compose_config(f"algorithm={name}"))  # the defaults are valid


def test_communication_per_client_and_round():
    model = nn.Linear(5, 4)  # d = 24
    comm = {a: ALGORITHMS.get(a).communication(OmegaConf.load(Path(CONF_DIR) / "algorithm" / f"{a}.yaml"), model)
            for a in NEW}
    assert comm["fedamp"] == comm["fedmtl"] == comm["fedmgda"] == (24, 24)
    assert comm["cfl"] == (24, 24)              # its cluster's model only, whatever max_clusters
    assert comm["fedsoft"] == (24 + 3, 3 * 24)  # up: w_i and u_i; down: the K = 3 centres
    assert comm["fedem"] == (3 * 24, 3 * 24)    # the K = 3 components both ways; pi_i stays on the client


@pytest.mark.parametrize("algorithm,override,needle", [
    ("fedamp", "algorithm.alphaK=0.0", "algorithm.alphaK=0.0: allowed number in (0, 1]"),
    ("fedamp", "algorithm.sigma=0.0", "algorithm.sigma=0.0: allowed number > 0"),
    ("fedamp", "algorithm.lam=-1.0", "algorithm.lam=-1.0: allowed number >= 0"),
    ("fedmtl", "algorithm.lam=-0.5", "algorithm.lam=-0.5: allowed number >= 0"),
    ("cfl", "algorithm.max_clusters=0", "algorithm.max_clusters=0: allowed integer >= 1"),
    ("cfl", "algorithm.warmup=-1", "algorithm.warmup=-1: allowed integer >= 0"),
    ("cfl", "algorithm.eps_2=-0.1", "algorithm.eps_2=-0.1: allowed number >= 0"),
    ("fedsoft", "algorithm.sigma=0.5", "algorithm.sigma=0.5 > 1/algorithm.K = 0.333333"),
    ("fedsoft", "algorithm.estimate_every=0", "algorithm.estimate_every=0: allowed integer >= 1"),
    ("fedsoft", "algorithm.score=best", "algorithm.score='best': allowed personal | centres"),
    ("fedmgda", "algorithm.epsilon=-0.1", "algorithm.epsilon=-0.1: allowed number >= 0"),
    ("fedmgda", "algorithm.server_lr=0.0", "algorithm.server_lr=0.0: allowed number > 0"),
    ("fedmgda", "algorithm.prior=sizes", "algorithm.prior='sizes': allowed uniform | samples"),
])
def test_bad_values_raise_value_error_naming_key_and_range(tmp_path, cpu_fabric, algorithm, override, needle):
    with pytest.raises(ValueError) as err:
        small_sim(tmp_path, cpu_fabric, algorithm, override)
    assert needle in str(err.value)


@pytest.mark.parametrize("overrides,needle", [
    (("algorithm=fedamp", "algorithm.alphaK=1.5"), "algorithm.alphaK=1.5: allowed number in (0, 1]"),
    (("algorithm=cfl", "algorithm.max_clusters=0"), "algorithm.max_clusters=0: allowed integer >= 1"),
    (("algorithm=fedmgda", "algorithm.epsilon=-1"), "algorithm.epsilon=-1: allowed number >= 0"),
    (("algorithm=fedsoft", "algorithm.sigma=0.5"), "algorithm.sigma=0.5 > 1/algorithm.K"),
    (("algorithm=fedmtl", "algorithm.lam=-1"), "algorithm.lam=-1: allowed number >= 0"),
])
def test_config_rules_cover_the_new_keys(overrides, needle):
    with pytest.raises(ConfigError) as err:
        validate_config(compose_config(*overrides))
    assert needle in str(err.value)


# -- FedMGDA+ ----------------------------------------------------------------------------------------

def test_project_simplex_box_by_hand():
    lo, hi = np.full(3, 0.2), np.full(3, 0.6)
    # (1, 0, 0): the two small coordinates hit the floor 0.2, the large one the cap 0.6
    np.testing.assert_allclose(project_simplex_box(np.array([1.0, 0.0, 0.0]), lo, hi), [0.6, 0.2, 0.2], atol=1e-12)
    # a feasible point projects onto itself; a shift of every coordinate is removed
    np.testing.assert_allclose(project_simplex_box(np.array([0.3, 0.3, 0.4]), lo, hi), [0.3, 0.3, 0.4], atol=1e-12)
    np.testing.assert_allclose(project_simplex_box(np.array([5.3, 5.3, 5.4]), lo, hi), [0.3, 0.3, 0.4], atol=1e-12)
    with pytest.raises(ValueError, match="empty set"):
        project_simplex_box(np.zeros(3), np.full(3, 0.5), np.ones(3))


def test_min_norm_weights_hand_cases():
    box = lambda P, eps: weight_bounds(np.full(P, 1.0 / P), eps)  # noqa: E731
    # two orthogonal unit vectors: the midpoint
    np.testing.assert_allclose(min_norm_weights(np.eye(2), *box(2, 1.0)), [0.5, 0.5], atol=1e-8)
    # raw (unnormalised) orthogonal vectors of norms 1 and 10: argmin l^2 + 100 (1 - l)^2 = 100/101
    np.testing.assert_allclose(min_norm_weights(np.diag([1.0, 100.0]), *box(2, 1.0)), [100 / 101, 1 / 101], atol=1e-8)
    # e1, e2, (e1 + e2)/sqrt2: the min-norm point (1/2, 1/2) of the hull is reached only with l3 = 0
    a = 1 / math.sqrt(2)
    G = np.array([[1, 0, a], [0, 1, a], [a, a, 1]])
    np.testing.assert_allclose(min_norm_weights(G, *box(3, 1.0)), [0.5, 0.5, 0.0], atol=1e-7)
    # with the box |l - 1/3| <= 0.1, l3 sits at its floor 1/3 - 0.1 and the rest is shared
    lam = min_norm_weights(G, *box(3, 0.1))
    np.testing.assert_allclose(lam, [(1 - (1 / 3 - 0.1)) / 2] * 2 + [1 / 3 - 0.1], atol=1e-7)
    # epsilon = 0: the prior itself
    np.testing.assert_allclose(min_norm_weights(G, *box(3, 0.0)), [1 / 3] * 3, atol=1e-12)


@pytest.mark.parametrize("eps", [0.02, 0.1, 0.3, 1.0])
def test_min_norm_weights_respect_the_box_and_match_a_reference_solver(eps):
    from scipy.optimize import minimize

    rng = np.random.default_rng(int(eps * 100))
    P = 6
    g = rng.normal(size=(P, 4)) + np.array([1.0, 0.0, 0.0, 0.0])  # correlated, rank 4 < P
    g /= np.linalg.norm(g, axis=1, keepdims=True)
    G = g @ g.T
    lo, hi = weight_bounds(np.full(P, 1 / P), eps)
    lam = min_norm_weights(G, lo, hi)
    assert abs(lam.sum() - 1) < 1e-12
    assert np.all(lam >= lo - 1e-12) and np.all(lam <= hi + 1e-12)
    ref = minimize(lambda x: x @ G @ x, np.full(P, 1 / P), jac=lambda x: 2 * G @ x, method="SLSQP",
                   bounds=list(zip(lo, hi)), constraints=[{"type": "eq", "fun": lambda x: x.sum() - 1}],
                   options={"ftol": 1e-15, "maxiter": 1000})
    assert lam @ G @ lam <= ref.fun + 1e-9


def test_fedmgda_end_round_normalises_the_updates(tmp_path, cpu_fabric):
    sim = small_sim(tmp_path, cpu_fabric, "fedmgda", "algorithm.epsilon=1.0", "algorithm.server_lr=0.5")
    alg, server = sim.algorithm, sim.module.models[0]
    w0 = flat(server)
    d = w0.numel()
    e0, e1 = torch.zeros(d, dtype=torch.float64), torch.zeros(d, dtype=torch.float64)
    e0[0], e1[1] = 1.0, 1.0
    alg.begin_round(1, [0, 1])
    logs = alg.end_round(1, [0, 1], rows_for(sim, [e0, 10 * e1]))  # norms 1 and 10
    close(logs["alpha"], torch.tensor([0.5, 0.5]))  # after normalisation the norms do not matter
    close(flat(server), w0 + 0.5 * (0.5 * e0 + 0.5 * e1))
    # without normalisation: MGDA on the raw updates favours the short one, 100/101 vs 1/101
    alg.normalize = False
    alg.begin_round(2, [0, 1])
    w1 = flat(server)
    logs = alg.end_round(2, [0, 1], rows_for(sim, [e0, 10 * e1]))
    close(logs["alpha"], torch.tensor([100 / 101, 1 / 101]), atol=1e-7)
    close(flat(server), w1 + 0.5 * (100 / 101 * e0 + 10 / 101 * e1), atol=1e-6)
    # a client left out (non-finite update) gets weight 0, the others share the simplex
    alg.normalize = True
    alg.begin_round(3, [0, 1, 2])
    logs = alg.end_round(3, [0, 1, 2], rows_for(sim, [e0, e1, e0], valid=[1.0, 1.0, 0.0]))
    close(logs["alpha"], torch.tensor([0.5, 0.5, 0.0]))


def test_fedmgda_round_matches_the_server_step_by_hand(tmp_path, cpu_fabric):
    eps, eta = 0.1, 0.5
    sim = small_sim(tmp_path, cpu_fabric, "fedmgda", f"algorithm.epsilon={eps}", f"algorithm.server_lr={eta}")
    before = copy.deepcopy(sim.module.models[0])
    deltas = []
    for i in range(4):
        local = manual_sgd(before, *client_xy(sim, i), epochs=1, seed=derive_seed(0, "local", 1, i, 0))
        deltas.append(flat(local) - flat(before))
    unit = torch.stack([u / u.norm() for u in deltas])
    lo, hi = weight_bounds(np.full(4, 0.25), eps)
    lam = torch.as_tensor(min_norm_weights((unit @ unit.T).numpy(), lo, hi))
    logs = sim.run_round(1)
    close(logs["alpha"], lam, atol=1e-6)
    assert float(lam.min()) >= 0.25 - eps - 1e-9 and float(lam.max()) <= 0.25 + eps + 1e-9
    close(flat(sim.module.models[0]), flat(before) + eta * (lam @ unit), atol=1e-5)
    assert sim.algorithm.candidates(sim.host_data.clients[1]) == [sim.module.models[0]]


# -- CFL ---------------------------------------------------------------------------------------------

def test_bipartition_separates_two_directions():
    a, b = torch.tensor([1.0, 0.1, 0.0]), torch.tensor([0.0, 0.2, 1.0])
    U = torch.stack([a, -b, a + 0.05, -b + 0.1, a - 0.1])
    S = cosine_similarity(U)
    close(S.diagonal(), torch.ones(5))
    assert bipartition(S) == ([0, 2, 4], [1, 3])
    assert bipartition(cosine_similarity(torch.stack([a, -a]))) == ([0], [1])
    assert should_split(0.1, 2.0, 2, eps_1=0.4, eps_2=1.6)
    assert not should_split(0.5, 2.0, 2, 0.4, 1.6) and not should_split(0.1, 1.0, 2, 0.4, 1.6)
    assert not should_split(0.1, 2.0, 1, 0.4, 1.6)


def _cfl(tmp_path, cpu_fabric, *overrides):
    sim = small_sim(tmp_path, cpu_fabric, "cfl", "algorithm.eps_1=0.9", "algorithm.eps_2=0.5",
                    "algorithm.warmup=0", *overrides)
    return sim, sim.algorithm


def test_cfl_splits_clients_with_opposite_updates(tmp_path, cpu_fabric):
    sim, alg = _cfl(tmp_path, cpu_fabric, "algorithm.max_clusters=3")
    base = flat(sim.module.models[0])
    a = torch.randn(base.numel(), dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    a /= a.norm()
    alg.begin_round(1, [0, 1])
    # weighted mean (n0 - n1) / (n0 + n1) * a: norm < eps_1; max norm 1 > eps_2
    logs = alg.end_round(1, [0, 1], rows_for(sim, [a, -a]))
    assert alg.membership.tolist() == [0, 1, 0, 0]  # client 1 moves to the free slot 1
    assert logs["splits"] == 1.0 and logs["num_clusters"] == 2.0 and logs["assignment"].tolist() == [0, 1]
    close(flat(sim.module.models[0]), base + a)  # each half: parent model + its own mean update
    close(flat(sim.module.models[1]), base - a)
    assert alg.candidates(sim.host_data.clients[1]) == [sim.module.models[1]]
    assert alg.candidates(sim.host_data.clients[3]) == [sim.module.models[0]]  # non-participant stays


def test_cfl_does_not_split_clients_with_equal_updates(tmp_path, cpu_fabric):
    sim, alg = _cfl(tmp_path, cpu_fabric)
    base = flat(sim.module.models[0])
    a = torch.zeros(base.numel(), dtype=torch.float64)
    a[:3] = torch.tensor([0.6, 0.0, 0.8])  # unit norm: mean norm 1 > eps_1
    alg.begin_round(1, [0, 1])
    logs = alg.end_round(1, [0, 1], rows_for(sim, [a, a]))
    assert alg.membership.tolist() == [0, 0, 0, 0] and logs["splits"] == 0.0
    close(flat(sim.module.models[0]), base + a)
    close(logs["mean_update_norm"][:1], torch.tensor([1.0]))


def test_cfl_splits_four_clients_into_their_groups_and_respects_warmup_and_slots(tmp_path, cpu_fabric):
    sim, alg = _cfl(tmp_path, cpu_fabric, "algorithm.warmup=1", "algorithm.max_clusters=2")
    d = flat(sim.module.models[0]).numel()
    g = torch.Generator().manual_seed(1)
    a = torch.randn(d, dtype=torch.float64, generator=g)
    a /= a.norm()
    noise = [0.05 * torch.randn(d, dtype=torch.float64, generator=g) / d ** 0.5 for _ in range(4)]  # norm ~0.05
    updates = [a + noise[0], -a + noise[1], a + noise[2], -a + noise[3]]
    alg.begin_round(1, [0, 1, 2, 3])
    alg.end_round(1, [0, 1, 2, 3], rows_for(sim, updates))
    assert alg.membership.tolist() == [0, 0, 0, 0]  # round 1 <= warmup
    alg.begin_round(2, [0, 1, 2, 3])
    base = flat(sim.module.models[0])
    alg.end_round(2, [0, 1, 2, 3], rows_for(sim, updates))
    assert alg.membership.tolist() == [0, 1, 0, 1]
    n = sim.num_train.double()
    close(flat(sim.module.models[1]), base + (n[1] * updates[1] + n[3] * updates[3]) / (n[1] + n[3]), atol=1e-6)
    # both slots in use: cluster 0 (clients 0, 2) cannot split further
    alg.begin_round(3, [0, 1, 2, 3])
    logs = alg.end_round(3, [0, 1, 2, 3], rows_for(sim, [a, a, -a, a]))
    assert alg.membership.tolist() == [0, 1, 0, 1] and logs["splits_blocked"] == 1.0
    # the membership is server state: checkpointed and restored
    state = copy.deepcopy(alg.state_dict())
    alg.membership.zero_()
    alg.load_state_dict(state)
    assert alg.membership.tolist() == [0, 1, 0, 1]


def test_cfl_round_trains_each_client_from_its_cluster_model(tmp_path, cpu_fabric):
    sim, alg = _cfl(tmp_path, cpu_fabric, "algorithm.eps_1=0.0")  # never splits
    before = copy.deepcopy(sim.module.models[0])
    local = [manual_sgd(before, *client_xy(sim, i), epochs=1, seed=derive_seed(0, "local", 1, i, 0)) for i in range(4)]
    logs = sim.run_round(1)
    n = sim.num_train.double()
    expected = sum(n[i] * flat(local[i]) for i in range(4)) / n.sum()  # one cluster: FedAvg
    close(flat(sim.module.models[0]), expected)
    norms = torch.stack([flat(m) - flat(before) for m in local]).norm(dim=1)
    close(logs["max_update_norm"][:1], norms.max()[None], atol=1e-5)


# -- FedSoft -----------------------------------------------------------------------------------------

def test_importance_weights_by_hand():
    losses = torch.tensor([[0.1, 0.5, 0.9], [0.2, 0.1, 0.3], [0.0, 0.4, 0.4], [0.7, 0.3, 0.8], [0.3, 0.3, 0.3]])
    # argmin per sample: 0, 1, 0, 1, 0 (tie -> lowest) -> counts (3, 2, 0) -> (0.6, 0.4, 0) -> floor 0.1
    u = importance_weights(losses, sigma=0.1)
    close(u, torch.tensor([0.6, 0.4, 0.1]) / 1.1)
    assert abs(float(u.sum()) - 1) < 1e-12
    close(importance_weights(losses, sigma=1e-4), torch.tensor([0.6, 0.4, 1e-4]) / 1.0001)
    close(importance_weights(losses, sigma=1 / 3), torch.tensor([0.6, 0.4, 1 / 3]) / (4 / 3))  # (0.45, 0.3, 0.25)
    nan = torch.tensor([[float("nan"), 0.5, 0.9]])
    close(importance_weights(nan, 0.1), torch.tensor([0.1, 1.0, 0.1]) / 1.2)
    with pytest.raises(ValueError, match=r"algorithm.sigma=0.5 must be in \(0, 1/K\]"):
        importance_weights(losses, 0.5)


def test_fedsoft_proximal_term_is_the_u_weighted_sum_over_centres():
    g = torch.Generator().manual_seed(0)
    centres = [torch.randn(7, dtype=torch.float64, generator=g) for _ in range(3)]
    u, lam = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64), 0.7
    w = torch.randn(7, dtype=torch.float64, generator=g, requires_grad=True)
    explicit = lam / 2 * sum(u[k] * ((w - centres[k]) ** 2).sum() for k in range(3))
    (grad,) = torch.autograd.grad(explicit, w)
    close(grad, lam * sum(u[k] * (w.detach() - centres[k]) for k in range(3)))
    model = nn.Linear(7, 1, bias=False).double()
    assign_flat_(model, w.detach())
    proximal_term([proximal_centre(u, centres).view(1, 7)], lam)(model).backward()
    close(model.weight.grad.reshape(-1), grad)


def test_fedsoft_round_by_hand(tmp_path, cpu_fabric):
    lam, sigma = 0.5, 0.2
    sim = small_sim(tmp_path, cpu_fabric, "fedsoft", f"algorithm.lam={lam}", f"algorithm.sigma={sigma}",
                    "algorithm.estimate_every=2")
    alg = sim.algorithm
    before = [copy.deepcopy(m) for m in sim.module.models]
    centres = [flat(m) for m in before]
    us, personal = [], []
    for i in range(4):
        idx = sim.ctx.train_index[i]
        losses = per_sample_losses(before, sim.data, idx)
        counts = torch.bincount(losses.argmin(dim=1), minlength=3).double()
        u = (counts / counts.sum()).clamp_min(sigma)
        u = u / u.sum()
        us.append(u)
        centre = with_flat(before[0], sum(u[k] * centres[k] for k in range(3)))
        personal.append(manual_sgd(centre, *client_xy(sim, i), epochs=1,
                                   seed=derive_seed(0, "local", 1, i, "personal"), prox=(lam, centre)))
    logs = sim.run_round(1)
    U = torch.stack(us)
    close(logs["w"], U)
    assert len({tuple(r) for r in U.tolist()}) > 1  # clients differ in their mixtures
    n = sim.num_train.double()
    for i in range(4):
        close(sim.ctx.host_state[i]["importance"], us[i])
        close(sim.ctx.host_state[i]["personal"], flat(personal[i]))
    for k in range(3):
        v = U[:, k] * n
        close(flat(sim.module.models[k]), sum(v[i] * flat(personal[i]) for i in range(4)) / v.sum(), atol=1e-5)
    # round 2 (2 - 1 not a multiple of estimate_every=2): the saved u is reused
    sim.run_round(2)
    for i in range(4):
        close(sim.ctx.host_state[i]["importance"], us[i])
    (scored,) = alg.candidates(sim.host_data.clients[2])
    close(flat(scored), sim.ctx.host_state[2]["personal"])
    alg.score = "centres"
    assert alg.candidates(sim.host_data.clients[2]) == list(sim.module.models)


# -- FedAMP ------------------------------------------------------------------------------------------

def test_fedamp_attention_weights_hand_computed_three_clients():
    W = torch.tensor([[0.0], [1.0], [3.0]], dtype=torch.float64)  # squared distances 1, 9, 4
    dist = squared_distances(W)
    close(dist, torch.tensor([[0.0, 1.0, 9.0], [1.0, 0.0, 4.0], [9.0, 4.0, 0.0]]))
    xi = attention_weights(dist, alphaK=0.5, sigma=1.0)
    e = math.exp
    # row i: 0.5 on itself, 0.5 split over the others in proportion to A'(d) = exp(-d)
    expected = torch.tensor([
        [0.5, 0.5 * e(-1) / (e(-1) + e(-9)), 0.5 * e(-9) / (e(-1) + e(-9))],
        [0.5 * e(-1) / (e(-1) + e(-4)), 0.5, 0.5 * e(-4) / (e(-1) + e(-4))],
        [0.5 * e(-9) / (e(-9) + e(-4)), 0.5 * e(-4) / (e(-9) + e(-4)), 0.5],
    ], dtype=torch.float64)
    close(xi, expected, atol=1e-12)
    close(xi.sum(dim=1), torch.ones(3))
    close(xi @ W, expected @ W)  # cloud models u_i = sum_j xi_ij w_j
    close(attention_weights(dist, 1.0, 1.0), torch.eye(3))  # alphaK = 1: no message passing
    close(attention_weights(dist, 0.4, 1e9), torch.tensor([[0.4, 0.3, 0.3], [0.3, 0.4, 0.3], [0.3, 0.3, 0.4]]))
    # far-apart models do not underflow into 0/0
    assert torch.isfinite(attention_weights(dist * 1e6, 0.5, 1.0)).all()
    with pytest.raises(ValueError, match="alphaK"):
        attention_weights(dist, 0.0, 1.0)


def test_fedamp_rounds_by_hand(tmp_path, cpu_fabric):
    lam, alphaK, sigma = 1.0, 0.5, 1.0
    sim = small_sim(tmp_path, cpu_fabric, "fedamp", f"algorithm.lam={lam}", f"algorithm.alphaK={alphaK}",
                    f"algorithm.sigma={sigma}")
    alg = sim.algorithm
    w0 = copy.deepcopy(sim.module.models[0])
    # round 1: every cloud model is the initial model, personal models start there too
    personal = [manual_sgd(w0, *client_xy(sim, i), epochs=1, seed=derive_seed(0, "local", 1, i, 0),
                           prox=(lam / alphaK, w0)) for i in range(4)]
    plain = manual_sgd(w0, *client_xy(sim, 0), epochs=1, seed=derive_seed(0, "local", 1, 0, 0))
    sim.run_round(1)
    W = torch.stack([flat(m) for m in personal])
    xi = attention_weights(squared_distances(W), alphaK, sigma)
    for i in range(4):
        close(sim.ctx.host_state[i]["personal"], W[i])
        close(sim.ctx.host_state[i]["cloud"], xi[i] @ W, atol=1e-5)
    assert (W[0] - flat(plain)).abs().max() > 1e-3  # the proximal term matters
    # round 2: client 2 continues its personal model, pulled towards its cloud model
    cloud2 = with_flat(w0, xi[2] @ W)
    expected = manual_sgd(personal[2], *client_xy(sim, 2), epochs=1, seed=derive_seed(0, "local", 2, 2, 0),
                          prox=(lam / alphaK, cloud2))
    sim.run_round(2)
    close(sim.ctx.host_state[2]["personal"], flat(expected), atol=1e-5)
    (scored,) = alg.candidates(sim.host_data.clients[2])
    close(flat(scored), flat(expected), atol=1e-5)


# -- FedMTL ------------------------------------------------------------------------------------------

def test_fedmtl_regulariser_gradient_matches_autograd():
    M, d, lam = 4, 5, 0.3
    omega = centering_omega(M)
    close(omega @ omega, omega)  # (I - 11^T/M)^2 = I - 11^T/M
    W = torch.randn(d, M, dtype=torch.float64, generator=torch.Generator().manual_seed(0), requires_grad=True)
    (auto,) = torch.autograd.grad(regulariser(W, omega, lam), W)
    close(auto, regulariser_gradient(W.detach(), omega, lam))
    # = lam * sum_i ||w_i - w_bar||^2 / 2 ...
    Wd = W.detach()
    close(regulariser(Wd, omega, lam), lam / 2 * ((Wd - Wd.mean(dim=1, keepdim=True)) ** 2).sum())
    # ... and column i is the algorithm's proximal form lam (1 - 1/M) (w_i - mean of the others)
    for i in range(M):
        others = (Wd.sum(dim=1) - Wd[:, i]) / (M - 1)
        close(auto[:, i], lam * (1 - 1 / M) * (Wd[:, i] - others))


def test_fedmtl_rounds_by_hand(tmp_path, cpu_fabric):
    lam, M = 1.0, 4
    sim = small_sim(tmp_path, cpu_fabric, "fedmtl", f"algorithm.lam={lam}")
    w0 = copy.deepcopy(sim.module.models[0])
    coeff = lam * (1 - 1 / M)
    # round 1: every other column of W is w0
    r1 = [manual_sgd(w0, *client_xy(sim, i), epochs=1, seed=derive_seed(0, "local", 1, i, 0), prox=(coeff, w0))
          for i in range(4)]
    sim.run_round(1)
    close(flat(sim.module.models[0]), torch.stack([flat(m) for m in r1]).mean(dim=0))
    # round 2: client 0 is pulled towards the mean of the other clients' round-1 models
    others = with_flat(w0, torch.stack([flat(r1[j]) for j in (1, 2, 3)]).mean(dim=0))
    expected = manual_sgd(r1[0], *client_xy(sim, 0), epochs=1, seed=derive_seed(0, "local", 2, 0, 0),
                          prox=(coeff, others))
    sim.run_round(2)
    close(sim.ctx.host_state[0]["personal"], flat(expected), atol=1e-5)
    personals = torch.stack([sim.ctx.host_state[i]["personal"].double() for i in range(4)])
    close(flat(sim.module.models[0]), personals.mean(dim=0), atol=1e-6)
    (scored,) = sim.algorithm.candidates(sim.host_data.clients[0])
    close(flat(scored), flat(expected), atol=1e-5)


def test_fedmtl_mean_counts_absent_clients_with_the_initial_model(tmp_path, cpu_fabric):
    sim = small_sim(tmp_path, cpu_fabric, "fedmtl", "participation=0.5")
    w0 = flat(sim.module.models[0])
    logs = sim.run_round(1)
    taken = logs["participants"]
    assert len(taken) == 2
    columns = [sim.ctx.host_state[i]["personal"].double() if i in taken else w0 for i in range(4)]
    close(flat(sim.module.models[0]), torch.stack(columns).mean(dim=0), atol=1e-6)


# -- end to end on digits ------------------------------------------------------------------------------

@pytest.mark.parametrize("algorithm,overrides", [
    ("fedamp", ()),
    ("fedmtl", ()),
    ("cfl", ("algorithm.warmup=3",)),
    ("fedsoft", ()),
    ("fedmgda", ()),
    ("fedem", ()),
])
def test_end_to_end_on_digits_beats_the_majority_label(tmp_path, cpu_fabric, algorithm, overrides):
    sim = small_sim(tmp_path, cpu_fabric, algorithm, "rounds=8", "eval_every=8", *overrides)
    results = sim.fit()
    summary = results["summary"]
    assert summary["acc_mean"] > summary["majority_acc_mean"] + 0.2, summary
    assert summary["acc_mean"] > 0.6, summary  # 10 classes: chance 0.1
