"""Config validation: each rule rejects bad values with the key named; the README lists them."""
from __future__ import annotations

from pathlib import Path

import pytest

from fedfew.config.rules import RULES, ConfigError, rules_markdown, validate_config

from conftest import compose_config


def test_default_config_is_valid():
    validate_config(compose_config())
    validate_config(compose_config("dataset=agnews"))


@pytest.mark.parametrize(
    "override,needle",
    [
        ("algorithm.K=0", "algorithm.K=0: allowed integer >= 1"),
        ("algorithm.mu=0.0", "algorithm.mu=0.0: allowed number > 0"),
        ("optim.lr=-0.1", "optim.lr=-0.1"),
        ("rounds=0", "rounds=0"),
        ("participation=0.0", "participation=0.0: allowed number in (0, 1]"),
        ("participation=1.5", "participation=1.5"),
        ("partition=dirichlet partition.alpha=0.0", "partition.alpha=0.0"),
        ("partition.within=dirichlet partition.alpha=0.0", "partition.alpha=0.0"),
        ("partition.within=bogus", "partition.within='bogus'"),
        ("partition.group_data=copy", "partition.group_data='copy'"),
        ("algorithm.mu_scale=absolute", "algorithm.mu_scale='absolute'"),
        ("local_epochs=1.5", "local_epochs=1.5: allowed integer >= 1"),
        ("algorithm.K=25", "algorithm.K=25 > num_clients=20"),
        ("optim.name=rmsprop", "optim.name='rmsprop': allowed sgd | adam | adamw"),
        ("engine=jit", "engine='jit': allowed loop | vmap"),
        ("engine=vmap optim.name=adam", "engine=vmap with optim.name='adam'"),
        ("algorithm=fedavg engine=vmap", "engine=vmap with algorithm=fedavg: only fedfew and fedfew_reference train "
                                         "through an engine; fedavg trains with its own loop and would ignore "
                                         "engine=vmap; use engine=loop (the default) or algorithm=fedfew"),
        ("algorithm=ifca compile=aot_eager", "compile=aot_eager with algorithm=ifca: only fedfew and fedfew_reference"),
        ("algorithm=oracle algorithm.K=3", "algorithm=oracle with algorithm.K=3 and partition.groups=4"),
        ("optim.schedule=linear", "optim.schedule='linear': allowed constant | exponential | cosine"),
        ("optim.gamma=0.0", "optim.gamma=0.0: allowed number in (0, 1]"),
        ("dataset=agnews model.embed_lr_scale=0", "model.embed_lr_scale=0: allowed number > 0"),
        ("dataset=agnews model.embed_init_std=-1", "model.embed_init_std=-1: allowed number > 0"),
        ("optim.schedule=cosine optim.lr=0.1 optim.min_lr=0.5", "optim.min_lr=0.5 > optim.lr=0.1"),
    ],
)
def test_bad_values_are_named(override, needle):
    with pytest.raises(ConfigError) as err:
        validate_config(compose_config(*override.split()))
    assert needle in str(err.value)


def test_min_lr_is_checked_only_under_cosine_and_only_against_a_valid_lr():
    validate_config(compose_config("optim.lr=0.1", "optim.min_lr=0.5"))  # constant schedule: min_lr unused
    with pytest.raises(ConfigError) as err:
        validate_config(compose_config("optim.schedule=cosine", "optim.lr=-1"))
    assert "optim.lr=-1: allowed number > 0" in str(err.value)
    assert "min_lr" not in str(err.value)  # the bad lr is the one problem, reported once


def test_rule_choices_match_the_registries():
    """The names a rule accepts are exactly what the code can build (no drift between the two)."""
    from fedfew.engines import ENGINES
    from fedfew.core.model_set import LR_SCHEDULES, OPTIMIZERS

    rules = {rule.key: rule for rule in RULES}
    for key, names in (("optim.name", OPTIMIZERS), ("optim.schedule", LR_SCHEDULES), ("engine", ENGINES.names())):
        assert all(rules[key].check(name) for name in names), key
        assert not rules[key].check("not-a-" + key), key
        assert " | ".join(names) in rules[key].allowed, key


def test_engine_methods_are_read_from_the_sources_as_the_classes_say():
    """validate_config reads ``uses_engine`` from the algorithms' sources (no torch); what it reads
    is what the imported classes say, for every algorithm (inherited values included)."""
    from fedfew.algorithms import ALGORITHMS
    from fedfew.core.registry import declared, registered_names

    assert registered_names("fedfew.algorithms") == ALGORITHMS.names()
    read = {name: declared("fedfew.algorithms", name, "uses_engine") for name in ALGORITHMS.names()}
    assert read == {name: ALGORITHMS.get(name).uses_engine for name in ALGORITHMS.names()}
    assert {name for name, uses in read.items() if uses} == {"fedfew", "fedfew_reference"}
    assert declared("fedfew.algorithms", "no_such_method", "uses_engine", "absent") == "absent"
    validate_config(compose_config("algorithm=fedfew_reference", "engine=vmap", "compile=aot_eager"))


def test_all_problems_reported_at_once():
    with pytest.raises(ConfigError) as err:
        validate_config(compose_config("algorithm.K=0", "rounds=0", "algorithm.mu=-1"))
    text = str(err.value)
    assert "algorithm.K=0" in text and "rounds=0" in text and "algorithm.mu=-1" in text


def test_unknown_key_rejected_by_hydra():
    from fedfew.config.compose import ComposeError

    with pytest.raises(ComposeError, match="no_such_key"):
        compose_config("no_such_key=1")


def test_configuration_page_lists_every_rule():
    page = (Path(__file__).resolve().parents[1] / "docs" / "configuration.md").read_text()
    table = page.split("<!-- rules:start -->\n")[1].split("\n<!-- rules:end -->")[0]
    assert table == rules_markdown(), (
        "docs/configuration.md's rules table is stale: run .venv/bin/python scripts/update_rules_table.py")
    assert len(RULES) >= 20
