"""Every registered algorithm keeps the contract a new method must keep (docs/contributing.md): its
config validates, its own keys are declared and a bad value of each is refused before any data is
read, it runs two rounds, it counts the bytes it sends, and a run resumed from its round-1 checkpoint
ends round 2 bitwise where the uninterrupted run does. The list of methods is the registry's."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from fedfew.config.rules import ConfigError, algorithm_rules, validate_config
from fedfew.core.checkpoint import load_checkpoint, save_checkpoint
from fedfew.core.registry import registered_names

from conftest import compose_config

CONF = Path(__file__).resolve().parents[1] / "conf" / "algorithm"
METHODS = registered_names("fedfew.algorithms")
#: what a method needs from the setup, where the small default setup lacks it (validation says why)
NEEDS = {"fedbn": ("model.norm=batch",)}


def small(name: str, *extra: str):
    """The default digits setup (4 known groups), 8 clients, 2 rounds, no logger."""
    return compose_config(f"algorithm={name}", "num_clients=8", "rounds=2", "logger=none", *NEEDS.get(name, ()), *extra)


def test_the_registry_and_the_config_folder_name_the_same_methods():
    assert METHODS and set(METHODS) == {p.stem for p in CONF.glob("*.yaml")}


@pytest.mark.parametrize("name", METHODS)
def test_every_own_key_is_declared_and_a_bad_value_is_refused(name):
    cfg = small(name)
    validate_config(cfg)  # the defaults pass their own rules
    own = {k for k in OmegaConf.to_container(cfg.algorithm) if k != "name"}
    declared = {rule.key.split(".", 1)[1] for rule in algorithm_rules(name)}
    assert own == declared, f"{name}: keys without a rule {sorted(own - declared)}, rules without a key {sorted(declared - own)}"
    for key in sorted(own):
        with pytest.raises(ConfigError, match=rf"algorithm\.{key}='bogus': allowed"):
            validate_config(small(name, f"algorithm.{key}=bogus"))


def _server_models(sim) -> list[torch.Tensor]:
    return [torch.cat([p.detach().reshape(-1) for p in m.parameters()]) for m in sim.module.models]


@pytest.mark.parametrize("name", METHODS)
def test_two_rounds_count_their_bytes_and_resume_bitwise(name, tmp_path, cpu_fabric):
    from fedfew.simulator.simulation import Simulation

    cfg = small(name)
    straight = Simulation(cfg, cpu_fabric, tmp_path / "straight")
    first = straight.run_round(1)
    straight.history.append(first)
    checkpoint = save_checkpoint(tmp_path / "last.ckpt", straight.state_dict(1))
    second = straight.run_round(2)
    expected = straight.evaluate(2)

    P = len(first["participants"])
    assert P == 8 and first["bytes_up"] == straight.communication.bytes_up * P
    assert first["bytes_down"] == straight.communication.bytes_down * P
    assert second["bytes_up_cumulative"] == 2 * first["bytes_up"]
    assert straight.communication.bytes_per_parameter == 4  # float32 on the wire
    if name != "local":  # Local trains alone: nothing goes up or down
        assert first["bytes_up"] > 0 and first["bytes_down"] > 0

    resumed = Simulation(cfg, cpu_fabric, tmp_path / "resumed")
    resumed.load_state_dict(load_checkpoint(checkpoint))
    assert resumed.start_round == 2
    again = resumed.run_round(2)
    got = resumed.evaluate(2)
    for a, b in zip(_server_models(straight), _server_models(resumed)):
        assert torch.equal(a, b), f"{name}: a server model differs after resuming"
    assert [c["acc"] for c in got["clients"]] == [c["acc"] for c in expected["clients"]]
    assert again["bytes_up_cumulative"] == second["bytes_up_cumulative"]


def test_the_docs_list_every_method_with_its_own_keys():
    """docs/algorithms.md has a row per registered method naming exactly its declared keys, and the
    README's algorithm row names every method: a new method cannot be left out of either."""
    import re

    root = CONF.parents[1]
    rows = {}
    for line in (root / "docs" / "algorithms.md").read_text().splitlines():
        m = re.match(r"\| `(\w+)` \|.*\|([^|]*)\|$", line)
        if m and m.group(1) in METHODS:
            rows[m.group(1)] = m.group(2)
    assert set(rows) == set(METHODS)
    for name, cell in rows.items():
        parent = re.fullmatch(r"\s*as `(\w+)`\s*", cell)
        if parent:  # "as `fedfew`": the same keys as that method
            cell = rows[parent.group(1)]
        keys = {r.key.split(".", 1)[1] for r in algorithm_rules(name)}
        named = set(re.findall(r"`(\w+)(?:=\w+)?`", cell)) - {"partition"}
        assert named == keys, f"docs/algorithms.md, {name}: the row names {sorted(named)}, the method declares {sorted(keys)}"
    readme_row = next(line for line in (root / "README.md").read_text().splitlines() if line.startswith("| `algorithm` |"))
    assert set(re.findall(r"`(\w+)`", readme_row.split("|")[3])) == set(METHODS)
