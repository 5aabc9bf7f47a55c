"""What a run spends (fedfew.core.budget, issue #16): bytes per participating client per round equal
hand counts (FedFew K models both ways, FedAvg one, FedRep the body, IFCA 1 up K down, Local
nothing; element size of the parameters' dtype), and a run's results.json / metrics.csv report
bytes per round, cumulative bytes and the local SGD steps actually taken."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from fedfew.algorithms import ALGORITHMS
from fedfew.core.budget import StepCounter, bytes_per_parameter, communication
from fedfew.models.base import BodyHead
from fedfew.simulator.simulation import Simulation

from conftest import compose_config


def tiny_model(dtype=torch.float32) -> BodyHead:
    """body Linear(3, 4): 3*4 + 4 = 16 parameters; head Linear(4, 2): 4*2 + 2 = 10; d = 26."""
    return BodyHead(nn.Sequential(nn.Linear(3, 4), nn.ReLU()), nn.Linear(4, 2)).to(dtype)


def algorithm_cfg(name: str, *overrides: str):
    return compose_config("partition=dirichlet", f"algorithm={name}", *overrides).algorithm


def test_bytes_equal_hand_counts_on_a_tiny_model():
    model = tiny_model()
    assert sum(p.numel() for p in model.parameters()) == 26
    fedfew = communication(ALGORITHMS.get("fedfew"), algorithm_cfg("fedfew", "algorithm.K=3"), model)
    assert (fedfew.params_up, fedfew.params_down) == (3 * 26, 3 * 26)     # K deltas up, K models down
    assert (fedfew.bytes_up, fedfew.bytes_down) == (3 * 26 * 4, 3 * 26 * 4)  # float32: 4 bytes each
    fedavg = communication(ALGORITHMS.get("fedavg"), algorithm_cfg("fedavg"), model)
    assert (fedavg.bytes_up, fedavg.bytes_down) == (104, 104)
    fedrep = communication(ALGORITHMS.get("fedrep"), algorithm_cfg("fedrep"), model)
    assert (fedrep.params_up, fedrep.bytes_up, fedrep.bytes_down) == (16, 64, 64)  # the body only
    ifca = communication(ALGORITHMS.get("ifca"), algorithm_cfg("ifca", "algorithm.K=3"), model)
    assert (ifca.bytes_up, ifca.bytes_down) == (104, 3 * 104)          # its one model up, all K down
    local = communication(ALGORITHMS.get("local"), algorithm_cfg("local"), model)
    assert (local.bytes_up, local.bytes_down) == (0, 0)
    half = communication(ALGORITHMS.get("fedavg"), algorithm_cfg("fedavg"), tiny_model(torch.bfloat16))
    assert half.bytes_per_parameter == 2 and half.bytes_up == 52        # bfloat16: 2 bytes each


def test_bytes_per_parameter_is_the_size_weighted_element_size():
    mixed = nn.Module()
    mixed.a = nn.Parameter(torch.zeros(3, dtype=torch.float32))   # 12 bytes
    mixed.b = nn.Parameter(torch.zeros(1, dtype=torch.float64))   # 8 bytes
    assert bytes_per_parameter(mixed) == pytest.approx(20 / 4)
    with pytest.raises(ValueError, match="no parameters"):
        bytes_per_parameter(nn.ReLU())


def test_step_counter_counts_optimizer_steps_only_while_active():
    p = nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=0.1)
    opt.step()
    with StepCounter() as steps:
        for _ in range(3):
            opt.step()
        torch.optim.Adam([p]).step()
    opt.step()
    assert steps.count == 4


def _run(tmp_path, cpu_fabric, algorithm: str, *overrides: str, batch: int = 32):
    cfg = compose_config("partition=dirichlet", "num_clients=4", f"algorithm={algorithm}", "rounds=2", "eval_every=2",
                         f"dataset.batch_size={batch}", "logger=none", *overrides)
    sim = Simulation(cfg, cpu_fabric, tmp_path / algorithm)
    results = sim.fit()
    sizes = [len(c.train) for c in sim.host_data.clients]
    return sim, results, sizes


@pytest.mark.slow
@pytest.mark.parametrize("algorithm,overrides,models,epochs", [
    ("fedavg", (), 1, 1),
    ("fedfew", ("algorithm.K=2",), 2, 1),            # K local trainings per client per round
    ("fedrep", ("algorithm.head_epochs=3",), 1, 4),  # head epochs + body epochs, one model
])
def test_run_reports_bytes_and_local_steps(tmp_path, cpu_fabric, algorithm, overrides, models, epochs):
    sim, results, sizes = _run(tmp_path, cpu_fabric, algorithm, *overrides)
    budget = results["budget"]
    d = 9610  # digits MLP 64 -> 128 -> 10
    per_client = communication(ALGORITHMS.get(algorithm), sim.cfg.algorithm, sim.module.models[0])
    assert budget["bytes_up_per_client_round"] == per_client.bytes_up
    assert budget["bytes_up_per_round"] == 4 * per_client.bytes_up        # all 4 clients take part
    assert budget["bytes_up_total"] == 2 * 4 * per_client.bytes_up        # 2 rounds
    assert budget["bytes_down_total"] == 2 * 4 * per_client.bytes_down
    assert budget["num_parameters"] == d and budget["server_models"] == models
    if algorithm != "fedrep":
        assert per_client.bytes_up == models * d * 4
    # every SGD step of local training: per client, epochs x models x ceil(n_i / B), each round
    steps_per_round = sum(epochs * models * math.ceil(n / 32) for n in sizes)
    assert budget["local_steps"] == 2 * steps_per_round
    assert [h["local_steps"] for h in sim.history] == [steps_per_round] * 2
    assert [h["bytes_down_cumulative"] for h in sim.history] == [4 * per_client.bytes_down * r for r in (1, 2)]


@pytest.mark.slow
def test_local_training_communicates_nothing(tmp_path, cpu_fabric):
    _, results, _ = _run(tmp_path, cpu_fabric, "local")
    assert results["budget"]["bytes_up_total"] == results["budget"]["bytes_down_total"] == 0
