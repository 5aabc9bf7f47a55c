"""FEMNIST uses every writer found by default; ``num_clients`` caps them (first N or a seeded
sample) and says so in the log; the config rules and the partition's errors agree."""
from __future__ import annotations

import json
import logging
import shutil

import pytest

from conftest import compose_config
from fedfew.config.rules import ConfigError, validate_config
from fedfew.data.federated import build_federated_data
from fedfew.data.partition import PartitionError

FEMNIST = "femnist/leaf_niid_05"
FEMNIST_FILES = (f"{FEMNIST}/train/all_data_0_niid_05_keep_0_train_9.json",
                 f"{FEMNIST}/test/all_data_0_niid_05_keep_0_test_9.json")
EXTRA = "zz_extra_writer"  # sorts after LEAF's f0000_00-style ids: the last client


@pytest.fixture(autouse=True)
def _own_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("FEDFEW_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    monkeypatch.setenv("FEDFEW_OFFLINE", "1")


@pytest.fixture
def femnist_plus_one(tmp_path, real_data_dir):
    """A copy of the 26-writer LEAF sample with one more writer (3 train, 2 test samples, taken
    from the first train file's first writer) in its own pair of files."""
    src = real_data_dir / FEMNIST
    dst = tmp_path / "data" / FEMNIST
    shutil.copytree(src, dst)
    blob = json.loads((src / "train" / "all_data_0_niid_05_keep_0_train_9.json").read_text())
    donor = blob["user_data"][blob["users"][0]]
    for split, take in (("train", slice(0, 3)), ("test", slice(3, 5))):
        x, y = donor["x"][take], donor["y"][take]
        (dst / split / f"extra_{split}.json").write_text(json.dumps(
            {"users": [EXTRA], "num_samples": [len(y)], "user_data": {EXTRA: {"x": x, "y": y}}}))
    return tmp_path / "data", donor["y"][:5]


def _writers(data_dir) -> list[str]:
    names = set()
    for path in (data_dir / FEMNIST / "train").glob("*.json"):
        names.update(json.loads(path.read_text())["users"])
    return sorted(names)


@pytest.mark.realdata(*FEMNIST_FILES)
def test_every_writer_is_a_client_by_default(femnist_plus_one, caplog):
    data_dir, extra_labels = femnist_plus_one
    writers = _writers(data_dir)
    assert len(writers) == 27 and writers[-1] == EXTRA
    cfg = compose_config("dataset=femnist", f"data_dir={data_dir}")
    assert cfg.num_clients is None and cfg.partition.name == "natural"
    validate_config(cfg)
    with caplog.at_level(logging.INFO, logger="fedfew.data.federated"):
        data = build_federated_data(cfg)
    assert data.num_clients == 27
    last = data.clients[26]
    assert (len(last.train), len(last.test)) == (3, 2)
    assert data.targets[last.train].tolist() == extra_labels[:3]
    assert data.targets[last.test].tolist() == extra_labels[3:]
    assert sum(len(c.train) + len(c.test) for c in data.clients) == len(data.targets)  # nothing dropped
    assert ("femnist: natural partition, 27 groups (writers/centres) found, 27 used as clients "
            "(every group; num_clients=null)") in caplog.text


@pytest.mark.realdata(*FEMNIST_FILES)
def test_num_clients_caps_the_writers_first_or_seeded_sample(femnist_plus_one, caplog):
    data_dir, _ = femnist_plus_one
    writers = _writers(data_dir)
    with caplog.at_level(logging.INFO, logger="fedfew.data.federated"):
        first = build_federated_data(compose_config("dataset=femnist", f"data_dir={data_dir}", "num_clients=4"))
    assert first.num_clients == 4
    assert (f"27 groups (writers/centres) found, 4 used as clients (num_clients=4 caps them; "
            f"partition.client_sample=first: the first 4 in sorted id order, {writers[0]} .. {writers[3]})") in caplog.text
    caplog.clear()
    overrides = ("dataset=femnist", f"data_dir={data_dir}", "num_clients=4", "partition.client_sample=random")
    with caplog.at_level(logging.INFO, logger="fedfew.data.federated"):
        sample = build_federated_data(compose_config(*overrides))
        again = build_federated_data(compose_config(*overrides))
        other = build_federated_data(compose_config(*overrides, "seed=1"))
    line = next(r.getMessage() for r in caplog.records if "client_sample=random" in r.getMessage())
    named = line.split("): ")[-1].split(", ")
    assert len(named) == 4 and named == sorted(named) and set(named) <= set(writers)
    # each client holds exactly its named writer's samples: the writer's size in the files
    sizes = {}
    for split in ("train", "test"):
        for path in (data_dir / FEMNIST / split).glob("*.json"):
            blob = json.loads(path.read_text())
            for w, n in zip(blob["users"], blob["num_samples"]):
                sizes[w] = sizes.get(w, 0) + n
    assert [len(c.train) + len(c.test) for c in sample.clients] == [sizes[w] for w in named]
    assert sample.partition_hash == again.partition_hash  # seeded
    assert sample.partition_hash != first.partition_hash or named == writers[:4]
    assert other.partition_hash != sample.partition_hash
    with pytest.raises(PartitionError, match=r"num_clients=30 but the dataset has only 27 groups .*num_clients=null for all 27"):
        build_federated_data(compose_config("dataset=femnist", f"data_dir={data_dir}", "num_clients=30"))


def test_config_rules_say_null_for_every_writer():
    ok = compose_config("dataset=femnist")
    validate_config(ok)  # null: every writer
    validate_config(compose_config("dataset=femnist", "num_clients=10"))
    with pytest.raises(ConfigError) as err:
        validate_config(compose_config("dataset=femnist", "num_clients=0"))
    assert "num_clients=0: allowed partition=natural: null (every writer/centre found) or integer >= 1" in str(err.value)
    with pytest.raises(ConfigError) as err:  # another partition needs a number of clients
        validate_config(compose_config("dataset=femnist", "partition=dirichlet"))
    assert "num_clients=None: allowed integer >= 1 (null only with partition=natural)" in str(err.value)
    with pytest.raises(ConfigError, match="partition.client_sample='every'"):
        validate_config(compose_config("dataset=femnist", "partition.client_sample=every"))
