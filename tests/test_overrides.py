"""Our own errors where Hydra's mislead: keys no config defines (with or without ``+``) are
rejected before any compute naming the closest valid key; ``++`` adds a key on purpose; the
partition errors name only fixes that can work."""
from __future__ import annotations

import sys

import numpy as np
import pytest

from fedfew.config.overrides import (IgnoredKeyError, UnknownChoiceError, UnknownKeyError, check_overrides, closest_key,
                              has_key)
from test_train_cli import train


def message(*overrides: str) -> str:
    with pytest.raises(UnknownKeyError) as err:
        check_overrides(list(overrides))
    return str(err.value)


@pytest.mark.parametrize("key,expected", [
    ("mu", "algorithm.mu"), ("round", "rounds"), ("seeds", "seed"), ("threads", "trainer.threads"),
    ("algorithm.mu_prox", "algorithm.mu"), ("partition.alpah", "partition.alpha"), ("batch_size", "dataset.batch_size"),
])
def test_closest_key(key, expected):
    keys = ["seed", "rounds", "algorithm.K", "algorithm.mu", "algorithm.mu_scale", "algorithm.name", "trainer.threads",
            "partition.alpha", "partition.name", "dataset.batch_size", "optim.lr"]
    assert closest_key(key, keys)[0] == expected


def test_bare_unknown_key_names_the_nested_one(monkeypatch):
    monkeypatch.setattr(sys, "executable", "/opt/my env/bin/python")
    text = message("mu=-1")
    assert "mu=-1: no config defines mu; closest valid key: algorithm.mu (e.g. algorithm.mu=-1)" in text
    assert "+mu" not in text  # not Hydra's hint, which trains with the key ignored
    assert "++<key>=<value>" in text  # the documented escape
    assert text.endswith("(see every key with: '/opt/my env/bin/python' -m fedfew.train --cfg job)")


def test_added_keys_no_config_defines_are_rejected():
    text = message("+no_such_key=1", "rounds=2")
    assert "+no_such_key=1: no config defines no_such_key; no similar key (nearest: " in text
    assert "rounds=2" not in text  # valid overrides are not listed
    text = message("algorithm=fedfew", "+algorithm.mu_prox=0.1")
    assert ("+algorithm.mu_prox=0.1: algorithm=fedfew has no key algorithm.mu_prox (it exists for algorithm=fedprox); "
            "closest valid key: algorithm.mu") in text


def test_valid_keys_group_choices_and_force_add_pass():
    check_overrides(["algorithm=fedprox", "+algorithm.mu_prox=0.1"])  # +: Hydra's add, of fedprox's key
    check_overrides(["algorithm=fedprox", "algorithm.mu_prox=0.1", "rounds=3", "trainer.threads=1"])
    check_overrides(["++algorithm.mu_prox=0.1"])  # the escape: force-add a key on purpose
    check_overrides(["engine_clients=4", "dataset=agnews", "model.embed_init_std=0.3"])
    check_overrides(["partition=pathological", "partition.classes_per_client=3", "hydra.run.dir=/tmp/x"])
    check_overrides(["tuned=digits_partition-dirichlet/digits_fedfew"])  # a preset in a setup folder


def test_unknown_group_options_name_the_closest_ones():
    """``algorithm=fedavgg`` is answered with the options most like it, not Hydra's bare list."""
    with pytest.raises(UnknownChoiceError) as err:
        check_overrides(["algorithm=fedavgg", "mu=1"])  # the choice first: no config to judge keys against
    assert str(err.value) == (
        "unknown algorithm 'fedavgg'; did you mean fedavg or fedamp? available: apfl, cfl, ditto, fedamp, fedavg, fedbn, "
        "fedem, fedfew, fedfew_reference, fedmgda, fedmtl, fedprox, fedrep, fedsoft, ifca, local, oracle "
        "(set `algorithm=<one of these>`)")
    with pytest.raises(UnknownChoiceError) as err:
        check_overrides(["dataset=mnist", "model=cnnn", "partition=diriclet", "logger=csvv", "algorithm=fedfew,zzz"])
    lines = str(err.value).splitlines()
    assert [line.split("?")[0].split(";")[:2] for line in lines] == [
        ["unknown dataset 'mnist'", " did you mean femnist"], ["unknown model 'cnnn'", " did you mean cnn"],
        ["unknown partition 'diriclet'", " did you mean dirichlet"], ["unknown logger 'csvv'", " did you mean csv"],
        ["unknown algorithm 'zzz'", " available: apfl, cfl, ditto, fedamp, fedavg, fedbn, fedem, fedfew, fedfew_reference, "
                                    "fedmgda, fedmtl, fedprox, fedrep, fedsoft, ifca, local, oracle (set `algorithm=<one of these>`)"]]


def test_registry_names_the_closest_too():
    from fedfew.experiments.training import check_registered

    with pytest.raises(ValueError, match=r"^unknown algorithm 'fedfeww'; did you mean fedfew or fedem or fedrep\? available: "):
        check_registered("algorithm", "fedfew.algorithms", "fedfeww")


def test_command_line_names_the_closest_group_option(tmp_path):
    proc = train(f"hydra.run.dir={tmp_path / 'run'}", "algorithm=fedavgg", timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.startswith("error: unknown algorithm 'fedavgg'; did you mean fedavg or fedamp? available: apfl,")
    assert "Could not find" not in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()


def test_every_swept_group_choice_is_checked():
    # algorithm.K exists for fedfew, not for fedavg: the multirun's fedavg job would ignore it
    text = message("algorithm=fedfew,fedavg", "algorithm.K=3")
    assert "algorithm.K=3: algorithm=fedavg has no key algorithm.K (it exists for algorithm=" in text
    check_overrides(["algorithm=fedfew,ifca", "algorithm.K=3"])


IGNORED = ("config key(s) that the chosen settings ignore, so they would change nothing (and their values are never "
           "checked):\n")


def test_keys_the_chosen_partition_ignores_are_refused_by_name():
    """digits' default split is clustered with within=iid: partition.alpha exists there (for
    within=dirichlet) but nothing reads it, so alpha=0 would train 50 rounds with the value never
    checked; the error names the split that ignores it and the ones that use it."""
    with pytest.raises(IgnoredKeyError) as err:
        check_overrides(["partition.alpha=0"])
    assert str(err.value) == IGNORED + (
        "  partition.alpha=0: the chosen partition=clustered (within=iid) ignores it; partition.alpha is used by "
        "partition=dirichlet, or partition=clustered with partition.within=dirichlet: drop it, or choose one of those")
    with pytest.raises(IgnoredKeyError) as err:
        check_overrides(["partition.within=dirichlet", "partition.classes_per_client=3", "partition.min_size=5"])
    assert str(err.value) == IGNORED + (
        "  partition.classes_per_client=3: the chosen partition=clustered (within=dirichlet) ignores it; "
        "partition.classes_per_client is used by partition=pathological, or partition=clustered with "
        "partition.within=pathological: drop it, or choose one of those")  # min_size: dirichlet's, used
    # where the chosen split uses them they pass (their values are validate_config's to judge)
    check_overrides(["partition.within=dirichlet", "partition.alpha=0"])
    check_overrides(["partition=dirichlet", "partition.alpha=0.1", "partition.min_size=5", "partition.max_retries=9"])
    check_overrides(["partition.within=pathological", "partition.classes_per_client=3", "partition.groups=2"])
    check_overrides(["dataset=femnist", "partition.client_sample=random"])  # femnist's split is natural
    check_overrides(["++partition.alpha=0"])  # on purpose: the force-add escape is not checked
    # every swept choice is checked, and an unknown key and an ignored one are named together
    text = message("partition.within=iid,dirichlet", "partition.alpha=0.2", "mu=1")
    assert "  mu=1: no config defines mu;" in text
    assert IGNORED + "  partition.alpha=0.2: the chosen partition=clustered (within=iid) ignores it;" in text


def test_command_line_refuses_an_ignored_key_before_anything_runs(tmp_path):
    run_dir = tmp_path / "run"
    proc = train(f"hydra.run.dir={run_dir}", "partition.alpha=0", "rounds=2", timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.startswith("error: " + IGNORED + "  partition.alpha=0: the chosen partition=clustered")
    assert "Traceback" not in proc.stderr and not run_dir.exists()


def test_has_key_walks_dicts_and_lists():
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({"a": {"b": [1, {"c": 2}]}, "d": None})
    assert has_key(cfg, "a.b.1.c") and has_key(cfg, "a.b.0") and has_key(cfg, "d")
    assert not has_key(cfg, "a.b.2") and not has_key(cfg, "a.c") and not has_key(cfg, "d.e")


def test_command_line_rejects_unknown_keys_before_anything_runs(tmp_path):
    run_dir = tmp_path / "run"
    proc = train(f"hydra.run.dir={run_dir}", "algorithm=fedfew", "mu=-1", "+no_such_key=1", "+algorithm.mu_prox=0.1",
                 "rounds=2", timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.splitlines()
    assert lines[0] == "error: unknown config key(s); no config defines them, so they would change nothing:"
    assert lines[1] == "  mu=-1: no config defines mu; closest valid key: algorithm.mu (e.g. algorithm.mu=-1)"
    assert lines[2].startswith("  +no_such_key=1: no config defines no_such_key")
    assert lines[3].startswith("  +algorithm.mu_prox=0.1: algorithm=fedfew has no key algorithm.mu_prox")
    assert "Traceback" not in proc.stderr and not run_dir.exists()


def test_command_line_force_add_and_engine_clients_need_no_plus(tmp_path):
    proc = train("++algorithm.mu_prox=0.1", "engine_clients=3", "--cfg", "job", timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "mu_prox: 0.1" in proc.stdout and "engine_clients: 3" in proc.stdout


# -- partition errors: only fixes that can work ------------------------------------------------

def partition(targets, M, **cfg):
    from fedfew.data.partition import PartitionError, partition_clients

    with pytest.raises(PartitionError) as err:
        partition_clients(np.asarray(targets), M, {"test_fraction": 0.25, **cfg}, seed=0)
    return str(err.value)


def test_dirichlet_with_more_clients_than_samples_allow_names_the_client_bound_not_alpha():
    # N = 100, min_size 10: at most 10 clients, whatever alpha
    text = partition(np.repeat(np.arange(10), 10), 20, name="dirichlet", alpha=0.5, min_size=10, max_retries=5)
    assert "no alpha can help" in text and text.endswith("fix: num_clients <= 10 or partition.min_size=2")
    assert "raise alpha" not in text and "partition.alpha" not in text
    # 60 clients do not fit even with the smallest min_size (2 samples each): only fewer clients
    text = partition(np.repeat(np.arange(10), 10), 60, name="dirichlet", alpha=0.5, min_size=10)
    assert text.endswith("fix: num_clients <= 10")


def test_dirichlet_draws_that_fail_name_every_knob_that_can_help():
    # 10 clients x 10 samples = N exactly: with alpha 0.01 no draw gives every client 10
    text = partition(np.repeat(np.arange(10), 10), 10, name="dirichlet", alpha=0.01, min_size=10, max_retries=3)
    assert text.endswith("fix: partition.alpha > 0.01 (more even client sizes), num_clients < 10, "
                         "partition.min_size=2 or partition.max_retries > 3")


def test_iid_clients_too_small_name_fewer_clients_and_the_validation_split():
    # N = 10 over 8 clients: 6 clients get 1 sample; at most 5 clients of 2
    text = partition(np.arange(10) % 2, 8, name="iid")
    assert "client 2 has 1 sample(s)" in text and text.endswith("fix: num_clients < 8 (at most 5 can get 2 samples each)")
    # 2 samples each with a validation split: 1 test, 1 train, no validation sample; dropping it works
    text = partition(np.arange(16) % 2, 8, name="iid", val_fraction=0.5)
    assert text.endswith("fix: num_clients < 8 (at most 5 can get 3 samples each) or partition.val_fraction=0")


def test_engine_clients_is_a_real_key_checked_before_training():
    from conftest import compose_config
    from fedfew.config.rules import ConfigError, validate_config

    assert compose_config().engine_clients == "auto"
    validate_config(compose_config("engine_clients=4"))
    for bad, shown in (("0", "0"), ("many", "'many'")):
        with pytest.raises(ConfigError, match=f"engine_clients={shown}: allowed auto or integer >= 1"):
            validate_config(compose_config(f"engine_clients={bad}"))
