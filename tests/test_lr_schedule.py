"""Local learning-rate schedules over rounds (``optim.schedule``): hand values of
:func:`fedfew.core.model_set.round_lr`, and the scheduled lr reaching every engine's optimizer."""
from __future__ import annotations

import math

import pytest
import torch
from omegaconf import OmegaConf

from fedfew.core.model_set import flat_parameters, round_lr
from fedfew.simulator.simulation import Simulation

from conftest import compose_config


def optim(**kw):
    return OmegaConf.create({"lr": 0.2, **kw})


def test_constant_is_the_default():
    assert [round_lr(optim(), r, 40) for r in (1, 20, 40)] == [0.2, 0.2, 0.2]


def test_exponential_multiplies_by_gamma_each_round():
    o = optim(schedule="exponential", gamma=0.5)
    assert [round_lr(o, r, 10) for r in (1, 2, 3, 4)] == pytest.approx([0.2, 0.1, 0.05, 0.025], abs=0, rel=1e-12)


def test_cosine_starts_at_lr_ends_at_min_lr_and_halves_at_the_middle():
    o = optim(schedule="cosine", min_lr=0.02)
    R = 41
    assert round_lr(o, 1, R) == pytest.approx(0.2, rel=1e-12)
    assert round_lr(o, R, R) == pytest.approx(0.02, rel=1e-12)
    assert round_lr(o, 21, R) == pytest.approx(0.11, rel=1e-12)  # (0.2 + 0.02) / 2
    # round 11 of 41: a quarter of the way, cos(pi/4)
    assert round_lr(o, 11, R) == pytest.approx(0.02 + 0.18 * 0.5 * (1 + math.cos(math.pi / 4)), rel=1e-12)
    lrs = [round_lr(o, r, R) for r in range(1, R + 1)]
    assert all(a > b for a, b in zip(lrs, lrs[1:]))  # strictly decreasing
    assert round_lr(optim(schedule="cosine"), 1, 1) == 0.2  # a single round keeps lr


def test_warmup_ramps_linearly_then_follows_the_schedule():
    o = optim(schedule="exponential", gamma=0.5, warmup_rounds=4)
    assert [round_lr(o, r, 10) for r in (1, 2, 4, 5)] == pytest.approx(
        [0.2 * 0.25, 0.2 * 0.5 * 0.5, 0.2 * 0.125, 0.2 * 0.0625], rel=1e-12)
    assert round_lr(optim(warmup_rounds=5), 6, 10) == 0.2


def test_unknown_schedule_names_the_key_and_the_choices():
    with pytest.raises(ValueError, match=r"optim.schedule='linear'.*constant.*exponential.*cosine"):
        round_lr(optim(schedule="linear"), 1, 10)


@pytest.mark.parametrize("engine", ["loop", "vmap"])
def test_scheduled_lr_reaches_the_local_optimizer(tmp_path, cpu_fabric, engine):
    """Two rounds with lr 0.1 * 0.5^(r-1) equal two constant-lr rounds run with lr 0.1 and then 0.05."""
    common = ["num_clients=4", "algorithm.K=2", "rounds=2", "optim.lr=0.1", "logger=none", f"engine={engine}"]
    scheduled = Simulation(compose_config(*common, "optim.schedule=exponential", "optim.gamma=0.5"), cpu_fabric, tmp_path)
    logs = [scheduled.run_round(r) for r in (1, 2)]
    assert [entry["lr"] for entry in logs] == [0.1, 0.05]

    by_hand = Simulation(compose_config(*common), cpu_fabric, tmp_path)
    by_hand.run_round(1)
    by_hand.cfg.optim.lr = 0.05
    by_hand.run_round(2)
    for a, b in zip(scheduled.module.models, by_hand.module.models):
        torch.testing.assert_close(flat_parameters(a), flat_parameters(b), rtol=0, atol=0)
    # and the lr mattered: a constant 0.1 for both rounds ends elsewhere
    constant = Simulation(compose_config(*common), cpu_fabric, tmp_path)
    constant.run_round(1), constant.run_round(2)
    assert not torch.equal(flat_parameters(constant.module.models[0]), flat_parameters(scheduled.module.models[0]))
