"""Gradient clipping (``optim.clip_norm``): the bound holds exactly, in every local step of every
method, fine-tuning included, and the vmap engine clips as the loop does."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from fedfew.algorithms import ALGORITHMS
from fedfew.config.rules import ConfigError, validate_config
from fedfew.core.model_set import clip_before_step
from fedfew.simulator.simulation import Simulation

from conftest import compose_config


def grad_norm(params) -> float:
    return math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in params if p.grad is not None))


def test_a_step_whose_gradient_is_above_the_bound_uses_exactly_the_bound():
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    optimizer = clip_before_step(torch.optim.SGD(model.parameters(), lr=0.5), clip_norm=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    loss = (model(torch.randn(4, 3)) ** 2).sum() * 100
    loss.backward()
    raw = [p.grad.detach().clone() for p in model.parameters()]
    raw_norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in raw))
    assert raw_norm > 1.0  # well above the bound
    optimizer.step()
    assert grad_norm(model.parameters()) == pytest.approx(0.1, rel=1e-5)
    # the step is -lr * g * bound / norm: the raw direction, shortened
    factor = 0.1 / (raw_norm + 1e-6)
    for p, b, g in zip(model.parameters(), before, raw):
        torch.testing.assert_close(p.detach(), b - 0.5 * g * factor, rtol=1e-6, atol=1e-7)


def test_a_gradient_below_the_bound_is_left_as_it_is():
    model = nn.Linear(3, 2)
    optimizer = clip_before_step(torch.optim.SGD(model.parameters(), lr=0.5), clip_norm=1e6)
    (model(torch.randn(4, 3)).sum()).backward()
    raw = [p.grad.detach().clone() for p in model.parameters()]
    optimizer.step()
    for p, g in zip(model.parameters(), raw):
        assert torch.equal(p.grad, g)


def test_a_bad_clip_norm_is_refused_before_any_run():
    with pytest.raises(ConfigError, match=r"optim.clip_norm.*null \(no clipping\) or number > 0"):
        validate_config(compose_config("optim.clip_norm=-1"))
    with pytest.raises(ConfigError, match=r"optim.clip_norm"):
        validate_config(compose_config("optim.clip_norm=0"))
    validate_config(compose_config("optim.clip_norm=2.5"))
    assert compose_config().optim.clip_norm is None  # digits: off by default


#: the overrides that make each method runnable on a 4-client digits run
SETUP = {"fedbn": ["model.norm=batch"]}


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS.names()))
def test_every_local_step_of_every_method_is_clipped_finetuning_included(algorithm, tmp_path, cpu_fabric):
    """One round + an evaluation under ``finetune`` with a bound far below the gradients' norms:
    every optimizer step of the run (counted by a global hook, as make compare counts steps)
    used a gradient of norm at most the bound, and there were steps."""
    bound = 1e-3
    cfg = compose_config(f"algorithm={algorithm}", "num_clients=4", "rounds=1", "eval.protocol=finetune",
                         "logger=none", f"optim.clip_norm={bound}", *SETUP.get(algorithm, []))
    validate_config(cfg)
    norms: list[float] = []

    def after_step(optimizer, args, kwargs) -> None:
        norms.append(grad_norm([p for g in optimizer.param_groups for p in g["params"]]))

    from torch.optim.optimizer import register_optimizer_step_post_hook

    handle = register_optimizer_step_post_hook(after_step)
    try:
        sim = Simulation(cfg, cpu_fabric, tmp_path)
        sim.run_round(1)
        trained = len(norms)
        sim.evaluate(1)
    finally:
        handle.remove()
    assert trained > 0, f"{algorithm}: no local step in the round"
    assert len(norms) > trained, f"{algorithm}: no fine-tuning step"
    assert max(norms) <= bound * (1 + 1e-5), f"{algorithm}: a step used a gradient of norm {max(norms)} > {bound}"
    assert max(norms) > bound * 0.99  # the bound was reached (the gradients are larger), so it did clip


def test_vmap_clips_each_copy_as_the_loop_does(tmp_path, cpu_fabric):
    """FedFew, 3 models, one round: losses and server models of engine=vmap equal engine=loop
    within 1e-5 with a bound that binds; and both differ from the unclipped round."""
    flats = {}
    for engine, clip in [("loop", 0.05), ("vmap", 0.05), ("loop", None)]:
        cfg = compose_config("num_clients=4", "algorithm.K=3", "dataset.batch_size=64", "optim.lr=0.5",
                             "optim.momentum=0.5", "optim.weight_decay=0.01", "logger=none", f"engine={engine}",
                             f"optim.clip_norm={'null' if clip is None else clip}")
        sim = Simulation(cfg, cpu_fabric, tmp_path / f"{engine}{clip}")
        logs = sim.run_round(1)
        flats[engine, clip] = logs["loss"], torch.cat([p.detach().reshape(-1) for p in sim.module.models.parameters()])
    (loss_l, flat_l), (loss_v, flat_v), (_, flat_raw) = flats.values()
    torch.testing.assert_close(loss_v, loss_l, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(flat_v, flat_l, rtol=1e-5, atol=1e-5)
    assert (flat_raw - flat_l).abs().max() > 1e-3
