"""One FedFew round of the simulator against a hand-written reimplementation:
plain SGD per client and model, STCH-Set weights, theta_k += sum_i alpha_i w_ik d_ik."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from fedfew.stch.scalarization import stch_set
from fedfew.core.seeding import derive_seed
from fedfew.simulator.simulation import Simulation, shard_clients

from conftest import compose_config


def manual_local_sgd(model, x, y, lr, epochs, batch_size, seed):
    """SGD as the paper describes it, written out: returns (running loss, trained model)."""
    model = copy.deepcopy(model)
    torch.manual_seed(seed)
    n = len(y)
    for _ in range(epochs):
        order = torch.randperm(n)
        total = 0.0
        for start in range(0, n, batch_size):
            b = order[start : start + batch_size]
            loss = F.cross_entropy(model(x[b]), y[b])
            grads = torch.autograd.grad(loss, list(model.parameters()))
            with torch.no_grad():
                for p, g in zip(model.parameters(), grads):
                    p -= lr * g
            total += float(loss.detach()) * len(b)
    return total / n, model


@pytest.mark.parametrize("weighting,normalize", [("samples", False), ("none", True)])
def test_one_round_matches_hand_computation(tmp_path, cpu_fabric, weighting, normalize):
    cfg = compose_config(
        "num_clients=6", "rounds=1", "algorithm.K=3", "algorithm.mu=0.5", "local_epochs=2",
        f"algorithm.sample_weighting={weighting}", f"algorithm.normalize={normalize}",
        "dataset.batch_size=16", "optim.lr=0.1", "logger=none",
    )
    sim = Simulation(cfg, cpu_fabric, tmp_path)
    before = [copy.deepcopy(m) for m in sim.module.models]
    data = sim.host_data
    M, K = data.num_clients, 3
    losses = torch.zeros(M, K, dtype=torch.float64)
    deltas = []
    for i, client in enumerate(data.clients):
        idx = torch.as_tensor(client.train)
        row = []
        for k in range(K):
            loss, trained = manual_local_sgd(before[k], data.inputs[idx], data.targets[idx], 0.1, 2, 16,
                                             derive_seed(cfg.seed, "local", 1, i, k))
            losses[i, k] = loss
            row.append(torch.cat([(a - b).reshape(-1) for a, b in zip(trained.parameters(), before[k].parameters())]))
        deltas.append(torch.stack(row))
    deltas = torch.stack(deltas).double()  # (M, K, d)
    n = torch.tensor([len(c.train) for c in data.clients])
    ref = stch_set(losses, 0.5, n, weighting)
    weight = ref.alpha[:, None] * ref.w
    step = torch.einsum("ik,ikd->kd", weight, deltas)
    if normalize:
        step = step / weight.sum(dim=0)[:, None]

    logs = sim.run_round(1)
    torch.testing.assert_close(logs["loss"], losses, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logs["alpha"], ref.alpha, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(logs["w"], ref.w, rtol=1e-5, atol=1e-7)
    for k in range(K):
        expected = torch.cat([p.reshape(-1) for p in before[k].parameters()]).double() + step[k]
        got = torch.cat([p.detach().reshape(-1) for p in sim.module.models[k].parameters()]).double()
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_independent_init_differs_and_identical_init_matches(tmp_path, cpu_fabric):
    sims = {
        init: Simulation(compose_config("num_clients=4", f"algorithm.init={init}", "logger=none"), cpu_fabric, tmp_path)
        for init in ("independent", "identical")
    }
    flat = {i: [torch.cat([p.reshape(-1) for p in m.parameters()]) for m in s.module.models] for i, s in sims.items()}
    assert not torch.equal(flat["independent"][0], flat["independent"][1])
    assert torch.equal(flat["identical"][0], flat["identical"][1]) and torch.equal(flat["identical"][1], flat["identical"][2])


def test_shard_clients_balances_by_size_and_covers_everyone():
    sizes = torch.tensor([100, 10, 40, 60, 50, 5]).numpy()
    shards = [shard_clients(list(range(6)), sizes, 2, r) for r in range(2)]
    assert sorted(shards[0] + shards[1]) == list(range(6))
    loads = [int(sizes[s].sum()) for s in shards]
    # longest first: 100->r0, 60->r1, 50->r1, 40->r0, 10->r1, 5->r1
    assert shards == [[0, 2], [1, 3, 4, 5]] and loads == [140, 125]
    # more ranks than clients: some ranks get none, no client twice
    shards4 = [shard_clients([0, 1, 2], sizes, 4, r) for r in range(4)]
    assert sorted(sum(shards4, [])) == [0, 1, 2] and shards4[3] == []
