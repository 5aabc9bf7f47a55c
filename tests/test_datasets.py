"""Dataset loaders, the on-disk cache and the materialisation of image data.

Real data (``FEDFEW_DATA_DIR``, see conftest): CIFAR-10 (the JPEG tarballs, unpacked once per
session into a temporary folder: all 10,000 test images and the first 300 train images of
each class), FEMNIST (LEAF 5% sample, 26 writers) and AG News. The loaders of the sets that
are not there are tested on small files generated here in their real on-disk format.
"""
from __future__ import annotations

import csv
import io
import json
import os
import pickle
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from PIL import Image

from conftest import compose_config, real_data_dir
from fedfew.data.base import DataFormatError, DataNotFoundError
from fedfew.data.cache import TensorCache, cache_key, files_identity
from fedfew.data.datasets import DATASETS
from fedfew.data.federated import StreamedData, build_federated_data, encode_texts_cached, to_device
from fedfew.data.images import ImageDataset, _jpeg_size, decode_images, normalize

CIFAR_TARS = ("cifar10/cifar10_train_jpg.tar.gz", "cifar10/cifar10_test_jpg.tar.gz")
FEMNIST = "femnist/leaf_niid_05"
FEMNIST_FILES = (f"{FEMNIST}/train/all_data_0_niid_05_keep_0_train_9.json",
                 f"{FEMNIST}/test/all_data_0_niid_05_keep_0_test_9.json")
AGNEWS_FILES = ("ag_news_csv/train.csv", "ag_news_csv/test.csv")
CIFAR_CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
TRAIN_PER_CLASS = 300
NEW_DATASETS = ("cifar10", "cifar100", "tinyimagenet", "femnist", "kvasir", "fedisic", "imagefolder")


@pytest.fixture(autouse=True)
def cache_dir(tmp_path_factory, monkeypatch) -> Path:
    """Every test gets its own cache directory (never ~/.cache/fedfew, never inside the test's
    data directory) and no network."""
    path = tmp_path_factory.mktemp("cache")
    monkeypatch.setenv("FEDFEW_CACHE_DIR", str(path))
    monkeypatch.setenv("FEDFEW_OFFLINE", "1")
    return path


def _cfg(**kw):
    base = {"image_size": None, "channels": 3, "mean": 0.5, "std": 0.5, "cache": True, "download": False}
    return OmegaConf.create({**base, **kw})


def _jpeg(path: Path, array: np.ndarray, quality: int = 95) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(array).save(path, "JPEG", quality=quality)


# --------------------------------------------------------------------------- CIFAR-10 (real)
@pytest.fixture(scope="session")
def cifar_dir(tmp_path_factory) -> Path:
    """Data dir with cifar10/test (all 10,000) and cifar10/train (first 300 per class) unpacked
    from the real tarballs, once per session."""
    src = real_data_dir(*CIFAR_TARS)
    root = tmp_path_factory.mktemp("cifar_data")
    with tarfile.open(src / CIFAR_TARS[1], mode="r|gz") as tar:
        tar.extractall(root / "cifar10", filter="data")
    taken: dict[str, int] = {}
    with tarfile.open(src / CIFAR_TARS[0], mode="r|gz") as tar:  # one sequential pass, no seeking back
        for m in tar:
            cls = m.name.split("/")[-2] if m.isfile() else ""
            if m.isfile() and taken.get(cls, 0) < TRAIN_PER_CLASS:
                taken[cls] = taken.get(cls, 0) + 1
                tar.extract(m, root / "cifar10", filter="data")
    return root


@pytest.fixture(scope="session")
def cifar_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cifar_cache")


@pytest.fixture
def cifar_loaded(cifar_dir, cifar_cache, monkeypatch):
    """(dataset, seconds) of a CIFAR-10 load with the session's cache directory."""
    monkeypatch.setenv("FEDFEW_CACHE_DIR", str(cifar_cache))
    start = time.perf_counter()
    ds = DATASETS.get("cifar10")(_cfg(image_size=32), cifar_dir)
    return ds, time.perf_counter() - start


@pytest.mark.realdata(*CIFAR_TARS)
def test_cifar10_imagefolder_real(real_data_dir, cifar_dir, cifar_loaded):
    ds, _ = cifar_loaded
    n_train, n_test = 10 * TRAIN_PER_CLASS, 10_000
    assert isinstance(ds, ImageDataset) and ds.name == "cifar10"
    assert ds.inputs.shape == (n_train + n_test, 3, 32, 32) and ds.inputs.dtype == torch.uint8
    assert ds.class_names == CIFAR_CLASSES and ds.num_classes == 10
    assert ds.official_test[:n_train].sum() == 0 and ds.official_test[n_train:].all()
    assert torch.bincount(ds.targets[:n_train]).tolist() == [TRAIN_PER_CLASS] * 10
    assert torch.bincount(ds.targets[n_train:]).tolist() == [1000] * 10
    assert int(ds.targets[0]) == 0 and int(ds.targets[n_train]) == 0 and int(ds.targets[-1]) == 9
    # first train sample = first airplane file in sorted order, decoded like PIL does
    first = sorted((cifar_dir / "cifar10" / "train" / "airplane").iterdir())[0]
    ref = torch.from_numpy(np.array(Image.open(first).convert("RGB"))).permute(2, 0, 1).int()
    assert (ds.inputs[0].int() - ref).abs().max() <= 2
    last = sorted((cifar_dir / "cifar10" / "test" / "truck").iterdir())[-1]
    ref = torch.from_numpy(np.array(Image.open(last).convert("RGB"))).permute(2, 0, 1).int()
    assert (ds.inputs[-1].int() - ref).abs().max() <= 2
    x = ds.normalized(torch.arange(4))
    assert x.dtype == torch.float32 and torch.allclose(x, ds.inputs[:4].float() / 127.5 - 1, atol=1e-6)


@pytest.mark.realdata(*CIFAR_TARS)
def test_cifar10_cache_hit_and_invalidation(real_data_dir, cifar_dir, cifar_cache, cifar_loaded, monkeypatch):
    first, _ = cifar_loaded
    monkeypatch.setenv("FEDFEW_CACHE_DIR", str(cifar_cache))
    start = time.perf_counter()
    again = DATASETS.get("cifar10")(_cfg(image_size=32), cifar_dir)
    elapsed = time.perf_counter() - start
    assert again.cache_hit and elapsed < 3.0, elapsed
    assert torch.equal(again.inputs, first.inputs) and torch.equal(again.targets, first.targets)
    entries = sorted(p.name for p in cifar_cache.iterdir() if p.name != ".locks")  # .locks: the builds' locks
    assert entries and all(e.startswith("cifar10-") and e.endswith(".pt") for e in entries)
    assert not list(cifar_dir.rglob("*.pt"))  # nothing written into the data directory
    # other preprocessing -> other key (a miss, other tensors)
    small = DATASETS.get("cifar10")(_cfg(image_size=16), cifar_dir)
    assert not small.cache_hit and small.inputs.shape[1:] == (3, 16, 16)
    assert len(list(cifar_cache.glob("cifar10-*.pt"))) == len(entries) + 1


@pytest.mark.realdata(*CIFAR_TARS)
def test_cifar10_partition_keeps_official_test_out_of_train(real_data_dir, cifar_dir, cifar_cache, cifar_loaded,
                                                              monkeypatch):
    monkeypatch.setenv("FEDFEW_CACHE_DIR", str(cifar_cache))
    cfg = compose_config("dataset=cifar10", f"data_dir={cifar_dir}", "num_clients=10", "partition=dirichlet",
                         "partition.keep_official_test=true", "seed=1")
    data = build_federated_data(cfg)
    pooled, _ = cifar_loaded
    official = pooled.official_test.numpy()
    assert data.num_clients == 10 and data.inputs.dtype == torch.float32 and data.inputs.shape[1:] == (3, 32, 32)
    assert all(not official[c.train].any() and official[c.test].all() for c in data.clients)
    assert sum(len(c.train) for c in data.clients) == 3000 and sum(len(c.test) for c in data.clients) == 10_000
    x, y = data.batch(torch.as_tensor(data.clients[0].train[:5]))
    assert x.shape == (5, 3, 32, 32) and torch.equal(y, pooled.targets[data.clients[0].train[:5]])
    # the host-streamed fallback gives the very same batches
    streamed = build_federated_data(compose_config(
        "dataset=cifar10", f"data_dir={cifar_dir}", "num_clients=10", "partition=dirichlet",
        "partition.keep_official_test=true", "seed=1", "dataset.in_memory=false"))
    assert isinstance(streamed, StreamedData) and streamed.inputs.dtype == torch.uint8
    assert streamed.partition_hash == data.partition_hash
    index = torch.as_tensor(data.clients[3].test[:64])
    xs, ys = streamed.batch(index)
    assert torch.equal(xs, data.batch(index)[0]) and torch.equal(ys, data.batch(index)[1])
    moved = to_device(streamed, torch.device("cpu"))
    assert isinstance(moved, StreamedData) and torch.equal(moved.batch(index)[0], xs)


# --------------------------------------------------------------------------- FEMNIST (real)
def _leaf_split(root: Path, split: str) -> dict:
    out = {}
    for f in sorted((root / split).glob("*.json")):
        blob = json.loads(f.read_text())
        for w in blob["users"]:
            out[w] = blob["user_data"][w]
    return out


@pytest.mark.realdata(*FEMNIST_FILES)
def test_femnist_real_writers_are_clients(real_data_dir):
    ds = DATASETS.get("femnist")(_cfg(channels=1), real_data_dir)
    train, test = _leaf_split(real_data_dir / FEMNIST, "train"), _leaf_split(real_data_dir / FEMNIST, "test")
    writers = sorted(train)
    assert len(writers) == 26 and sorted(test) == writers and ds.group_names == writers
    assert ds.inputs.shape == (3877 + 443, 1, 28, 28) and ds.num_classes == 62
    assert int((~ds.official_test).sum()) == 3877 and int(ds.official_test.sum()) == 443
    # first sample = first train sample of the first writer, pixels exact (k/255)
    w0 = train[writers[0]]
    assert int(ds.targets[0]) == w0["y"][0] and ds.class_names[:11] == [*"0123456789", "A"]
    assert np.array_equal(ds.inputs[0, 0].numpy().reshape(-1) / 255.0, np.asarray(w0["x"][0], dtype=np.float64))

    cfg = compose_config("dataset=femnist", f"data_dir={real_data_dir}", "partition=natural", "num_clients=26")
    data = build_federated_data(cfg)
    groups, official = ds.groups.numpy(), ds.official_test.numpy()
    assert data.num_clients == 26
    for i, c in enumerate(data.clients):
        w = writers[i]
        assert set(groups[c.train]) == {i} and set(groups[c.test]) == {i}
        assert len(c.train) == len(train[w]["y"]) and len(c.test) == len(test[w]["y"])
        assert not official[c.train].any() and official[c.test].all()
        assert sorted(data.targets[c.test].tolist()) == sorted(test[w]["y"])
    # fewer clients than writers keeps the first writers in sorted order
    fewer = build_federated_data(compose_config("dataset=femnist", f"data_dir={real_data_dir}",
                                                "partition=natural", "num_clients=5"))
    assert fewer.num_clients == 5 and set(groups[fewer.clients[4].train]) == {4}


# --------------------------------------------------------------------------- AG News text cache (real)
@pytest.mark.realdata(*AGNEWS_FILES)
def test_agnews_token_cache_hit_and_key(real_data_dir, cache_dir):
    from fedfew.data.text import encode_texts

    pooled = DATASETS.get("agnews")(None, real_data_dir)
    cfg = OmegaConf.create({"tokenizer": "basic_english", "max_vocab": 5000, "max_length": 64})
    train_index = np.flatnonzero(~pooled.official_test.numpy())
    a = encode_texts_cached(pooled, train_index, cfg, real_data_dir)
    assert len(list(cache_dir.glob("agnews-tokens-*.pt"))) == 1
    start = time.perf_counter()
    b = encode_texts_cached(pooled, train_index, cfg, real_data_dir)
    assert time.perf_counter() - start < 1.0
    ref = encode_texts(pooled.texts, train_index, cfg, real_data_dir)
    for got in (a, b):
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]) and got[2] == ref[2] == 5000
        assert got[0].dtype == torch.int64 and got[0].shape == (2000 + 7600, 64)
    encode_texts_cached(pooled, train_index[:1000], cfg, real_data_dir)  # other vocabulary source: other key
    assert len(list(cache_dir.glob("agnews-tokens-*.pt"))) == 2


# --------------------------------------------------------------------------- CIFAR formats (generated)
def _cifar_pickles(root: Path, names: list[str], label_key: bytes, names_key: bytes, files: dict[str, int],
                   meta: str) -> dict[str, tuple[np.ndarray, list[int]]]:
    root.mkdir(parents=True)
    rng = np.random.default_rng(0)
    written = {}
    for f, n in files.items():
        data = rng.integers(0, 256, size=(n, 3072), dtype=np.uint8)
        labels = [int(v) for v in rng.integers(0, len(names), size=n)]
        with open(root / f, "wb") as fh:
            pickle.dump({b"data": data, label_key: labels, b"filenames": [b"x"] * n}, fh)
        written[f] = (data, labels)
    with open(root / meta, "wb") as fh:
        pickle.dump({names_key: [n.encode() for n in names]}, fh)
    return written


def test_cifar10_torchvision_pickles(tmp_path):
    files = {f"data_batch_{i}": 3 for i in range(1, 6)} | {"test_batch": 4}
    written = _cifar_pickles(tmp_path / "cifar-10-batches-py", CIFAR_CLASSES, b"labels", b"label_names", files,
                             "batches.meta")
    ds = DATASETS.get("cifar10")(_cfg(image_size=32), tmp_path)
    assert ds.inputs.shape == (19, 3, 32, 32) and ds.class_names == CIFAR_CLASSES
    assert ds.official_test.tolist() == [False] * 15 + [True] * 4
    data, labels = written["data_batch_1"]
    assert ds.targets[:3].tolist() == labels
    # rows are R, G, B planes of 32x32, row-major
    assert torch.equal(ds.inputs[0, 1, 0, :5], torch.from_numpy(data[0, 1024:1029]))
    assert torch.equal(ds.inputs[-1].reshape(-1), torch.from_numpy(written["test_batch"][0][-1]))
    gray = DATASETS.get("cifar10")(_cfg(image_size=8, channels=1), tmp_path)
    assert gray.inputs.shape == (19, 1, 8, 8) and gray.mean == (0.5,)


def test_cifar100_torchvision_pickles_in_subfolder(tmp_path):
    names = [f"class_{i:03d}" for i in range(100)]
    written = _cifar_pickles(tmp_path / "cifar100" / "cifar-100-python", names, b"fine_labels", b"fine_label_names",
                             {"train": 6, "test": 2}, "meta")
    ds = DATASETS.get("cifar100")(_cfg(image_size=32), tmp_path)
    assert ds.num_classes == 100 and ds.class_names == names and len(ds) == 8
    assert ds.targets.tolist() == written["train"][1] + written["test"][1]


def test_cifar_missing_names_layouts_and_setting(tmp_path):
    for download in (False, True):  # True: FEDFEW_OFFLINE=1 (autouse) -> not attempted, no wait
        start = time.perf_counter()
        with pytest.raises(DataNotFoundError) as err:
            DATASETS.get("cifar10")(_cfg(download=download), tmp_path)
        msg = str(err.value)
        assert time.perf_counter() - start < 5
        assert f"{tmp_path}/cifar10/train/<class>" in msg and "cifar-10-batches-py" in msg
        assert "FEDFEW_DATA_DIR" in msg and "data_dir=" in msg and "cifar-10-python.tar.gz" in msg
        assert ("not attempted" in msg) if download else ("dataset.download=false" in msg)
    assert not (tmp_path / "cifar10").exists()


def test_cifar_tree_with_wrong_class_count(tmp_path):
    for split in ("train", "test"):
        for c in ("a", "b"):
            _jpeg(tmp_path / "cifar10" / split / c / "0.jpg", np.zeros((32, 32, 3), np.uint8))
    with pytest.raises(ValueError, match="2 class folders, expected 10"):
        DATASETS.get("cifar10")(_cfg(), tmp_path)


# --------------------------------------------------------------------------- Tiny ImageNet (generated)
def _tiny_release(root: Path) -> None:
    rng = np.random.default_rng(1)
    wnids = ["n02", "n01", "n03"]  # wnids.txt is not sorted in the release
    (root / "val" / "images").mkdir(parents=True)
    (root / "wnids.txt").write_text("\n".join(wnids) + "\n")
    (root / "words.txt").write_text("n01\tgoldfish, Carassius auratus\nn02\tsalamander\nn03\tbullfrog\nn99\tother\n")
    for w in wnids:
        for k in range(2):
            _jpeg(root / "train" / w / "images" / f"{w}_{k}.JPEG", rng.integers(0, 256, (64, 64, 3), dtype=np.uint8))
        (root / "train" / w / f"{w}_boxes.txt").write_text("")
    Image.fromarray(rng.integers(0, 256, (64, 64), dtype=np.uint8), "L").save(root / "val" / "images" / "val_1.JPEG")
    _jpeg(root / "val" / "images" / "val_0.JPEG", rng.integers(0, 256, (64, 64, 3), dtype=np.uint8))
    (root / "val" / "val_annotations.txt").write_text("val_1.JPEG\tn01\t0\t0\t10\t10\nval_0.JPEG\tn03\t1\t2\t3\t4\n")


def test_tinyimagenet_release_layout(tmp_path):
    _tiny_release(tmp_path / "tiny-imagenet-200")
    ds = DATASETS.get("tinyimagenet")(_cfg(image_size=64), tmp_path)
    assert ds.inputs.shape == (8, 3, 64, 64) and ds.num_classes == 3
    assert ds.class_names == ["goldfish", "salamander", "bullfrog"]  # sorted wnids n01, n02, n03
    assert ds.targets.tolist() == [0, 0, 1, 1, 2, 2, 2, 0]  # val rows sorted by file: val_0 (n03), val_1 (n01)
    assert ds.official_test.tolist() == [False] * 6 + [True] * 2
    gray = ds.inputs[7].int()  # the grayscale JPEG, converted to RGB: equal channels
    assert torch.equal(gray[0], gray[1]) and torch.equal(gray[1], gray[2])
    with open(tmp_path / "tiny-imagenet-200" / "val" / "val_annotations.txt", "a") as fh:
        fh.write("val_9.JPEG\tn07\t0\t0\t1\t1\n")
    with pytest.raises(ValueError, match=r"val_annotations.txt:3: wnid 'n07'"):
        DATASETS.get("tinyimagenet")(_cfg(image_size=64), tmp_path)


def test_tinyimagenet_missing(tmp_path):
    with pytest.raises(DataNotFoundError) as err:
        DATASETS.get("tinyimagenet")(_cfg(), tmp_path)
    msg = str(err.value)
    assert f"{tmp_path}/tiny-imagenet-200/train/<wnid>/images" in msg and "val_annotations.txt" in msg
    assert "tiny-imagenet-200.zip" in msg and "FEDFEW_DATA_DIR" in msg


# --------------------------------------------------------------------------- FEMNIST (generated)
def _leaf(path: Path, users: dict[str, tuple[list, list]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    blob = {"users": list(users), "num_samples": [len(y) for _, y in users.values()],
            "user_data": {u: {"x": x, "y": y} for u, (x, y) in users.items()}}
    path.write_text(json.dumps(blob))


def test_femnist_generated_leaf_files(tmp_path):
    px = lambda k: [k / 255.0] * 784  # noqa: E731
    root = tmp_path / "femnist" / "data"
    _leaf(root / "train" / "a.json", {"w2": ([px(1), px(2)], [3, 61]), "w1": ([px(3)], [0])})
    _leaf(root / "train" / "b.json", {"w3": ([px(4), px(5)], [10, 10])})
    _leaf(root / "test" / "a.json", {"w1": ([px(6)], [1]), "w2": ([px(7)], [2]), "w3": ([px(8)], [10])})
    ds = DATASETS.get("femnist")(_cfg(channels=1), tmp_path)
    assert ds.group_names == ["w1", "w2", "w3"]
    assert ds.groups.tolist() == [0, 0, 1, 1, 1, 2, 2, 2]
    assert ds.targets.tolist() == [0, 1, 3, 61, 2, 10, 10, 10]
    assert ds.official_test.tolist() == [False, True, False, False, True, False, False, True]
    assert ds.inputs[:, 0, 0, 0].tolist() == [3, 6, 1, 2, 7, 4, 5, 8]
    # a second LEAF folder makes the choice ambiguous unless dataset.root says which
    _leaf(tmp_path / "femnist" / "other" / "train" / "a.json", {"w1": ([px(0)], [0])})
    _leaf(tmp_path / "femnist" / "other" / "test" / "a.json", {"w1": ([px(0)], [0])})
    (root.parent / "data").rename(root.parent / "sample")
    with pytest.raises(ValueError, match="dataset.root"):
        DATASETS.get("femnist")(_cfg(channels=1), tmp_path)
    assert len(DATASETS.get("femnist")(_cfg(channels=1, root="femnist/other"), tmp_path)) == 2


def test_femnist_bad_files_and_missing(tmp_path):
    with pytest.raises(DataNotFoundError) as err:
        DATASETS.get("femnist")(_cfg(channels=1), tmp_path)
    assert f"{tmp_path}/femnist/train/*.json" in str(err.value) and "LEAF" in str(err.value)
    _leaf(tmp_path / "femnist" / "train" / "a.json", {"w1": ([[0.0] * 10], [0])})
    _leaf(tmp_path / "femnist" / "test" / "a.json", {"w1": ([[0.0] * 784], [0])})
    with pytest.raises(DataFormatError, match=r"a.json: user 'w1': x has shape \(1, 10\)"):
        DATASETS.get("femnist")(_cfg(channels=1), tmp_path)


def _damage_leaf(path: Path, how: str) -> str:
    """Damage the LEAF file ``path`` (users w1 and w2) in one way; returns the user it names."""
    text = path.read_text()
    blob = json.loads(text)
    if how == "truncated":
        path.write_text(text[: len(text) // 2])
        return ""
    if how == "listed, no data":
        del blob["user_data"]["w2"]
    elif how == "data, not listed":
        blob["users"].remove("w2")
        blob["num_samples"].pop()
    elif how == "listed twice":
        blob["users"].append("w2")
        blob["num_samples"].append(1)
    elif how == "num_samples per user":
        blob["num_samples"] = [2, 5]
    elif how == "num_samples length":
        blob["num_samples"] = [2]
    elif how == "x and y lengths":
        blob["user_data"]["w2"]["y"].append(0)
        blob["num_samples"] = [2, 2]
    path.write_text(json.dumps(blob))
    return "" if how == "num_samples length" else "w2"


@pytest.mark.parametrize(("how", "match"), [
    ("truncated", "not valid JSON at line 1 column"),
    ("listed, no data", "listed in `users` but has no entry in `user_data`"),
    ("data, not listed", "has an entry in `user_data` but is not listed in `users`"),
    ("listed twice", "listed twice in `users`"),
    ("num_samples per user", "`num_samples` says 5 samples but x and y have 1"),
    ("num_samples length", "`num_samples` should hold one count per user (2 users), got [2]"),
    ("x and y lengths", "x has 1 samples but y has 2 labels"),
])
def test_femnist_damaged_leaf_file_names_file_and_user(tmp_path, how, match):
    """A damaged LEAF file stops the data building (before any training) with an error naming
    the file and the user; the same files undamaged load."""
    px = [0.5] * 784
    for split in ("train", "test"):
        _leaf(tmp_path / "femnist" / split / "a.json", {"w1": ([px, px], [1, 2]), "w2": ([px], [3])})
    cfg = compose_config("dataset=femnist", f"data_dir={tmp_path}", "dataset.cache=false")
    assert build_federated_data(cfg).num_clients == 2
    damaged = tmp_path / "femnist" / "test" / "a.json"
    user = _damage_leaf(damaged, how)
    with pytest.raises(DataFormatError) as err:
        build_federated_data(cfg)
    msg = str(err.value)
    assert msg.startswith(f"{damaged}: user '{user}': " if user else f"{damaged}: ") and match in msg, msg
    assert f"put it in {damaged.parent}" in msg and "LEAF" in msg


# --------------------------------------------------------------------------- Kvasir / ImageFolder (generated)
def test_kvasir_layout_resizes_large_jpegs(tmp_path):
    base = tmp_path / "kvasir" / "kvasir-dataset-v2"
    rng = np.random.default_rng(2)
    for c in ("polyps", "esophagitis"):
        for k in range(2):
            _jpeg(base / c / f"{k}.jpg", rng.integers(0, 256, (288, 360, 3), dtype=np.uint8))
    (base / "polyps" / "notes.txt").write_text("not an image")
    ds = DATASETS.get("kvasir")(_cfg(image_size=24), tmp_path)
    assert ds.inputs.shape == (4, 3, 24, 24) and ds.class_names == ["esophagitis", "polyps"]
    assert ds.targets.tolist() == [0, 0, 1, 1] and ds.official_test is None
    # a flat colour stays that colour through DCT-scaled decoding, resize and crop
    _jpeg(base / "polyps" / "2.jpg", np.full((500, 700, 3), (200, 40, 90), np.uint8))
    ds = DATASETS.get("kvasir")(_cfg(image_size=24), tmp_path)
    assert not ds.cache_hit  # a new file changes the key
    assert (ds.inputs[-1].float().mean(dim=(1, 2)) - torch.tensor([200.0, 40, 90])).abs().max() < 4


def test_kvasir_missing(tmp_path):
    with pytest.raises(DataNotFoundError) as err:
        DATASETS.get("kvasir")(_cfg(), tmp_path)
    msg = str(err.value)
    assert f"{tmp_path}/kvasir/kvasir-dataset-v2/<class>/*.jpg" in msg and "datasets.simula.no/kvasir" in msg
    assert "manual download" in msg and "FEDFEW_DATA_DIR" in msg


def test_imagefolder_split_tree_mixed_formats(tmp_path):
    root = tmp_path / "mine"
    rng = np.random.default_rng(3)
    _jpeg(root / "train" / "cat" / "b.jpg", rng.integers(0, 256, (20, 30, 3), dtype=np.uint8))
    Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(root / "train" / "cat" / "a.png")
    (root / "train" / "dog" / "sub").mkdir(parents=True)
    Image.fromarray(rng.integers(0, 256, (40, 40), dtype=np.uint8), "L").save(root / "train" / "dog" / "sub" / "c.bmp")
    _jpeg(root / "test" / "dog" / "d.jpg", rng.integers(0, 256, (16, 16, 3), dtype=np.uint8))
    ds = DATASETS.get("imagefolder")(_cfg(root="mine", image_size=16), tmp_path)
    assert ds.inputs.shape == (4, 3, 16, 16) and ds.class_names == ["cat", "dog"]
    assert ds.targets.tolist() == [0, 0, 1, 1] and ds.official_test.tolist() == [False, False, False, True]
    png = np.asarray(Image.open(root / "train" / "cat" / "a.png"))
    assert np.array_equal(ds.inputs[0].permute(1, 2, 0).numpy(), png)  # a.png sorts first, no resize needed
    gray = DATASETS.get("imagefolder")(_cfg(root=str(root), image_size=8, channels=1), tmp_path / "elsewhere")
    assert gray.inputs.shape == (4, 1, 8, 8)
    with pytest.raises(ValueError, match=r"images differ in size: .*a.png is 16x16 but .*b.jpg is 30x20"):
        DATASETS.get("imagefolder")(_cfg(root="mine", cache=False), tmp_path)
    _jpeg(root / "test" / "bird" / "e.jpg", np.zeros((16, 16, 3), np.uint8))
    with pytest.raises(ValueError, match=r"class folders \['bird'\] are not among the training classes"):
        DATASETS.get("imagefolder")(_cfg(root="mine", image_size=16), tmp_path)


def test_imagefolder_errors_name_the_path(tmp_path):
    with pytest.raises(DataNotFoundError, match="Set dataset.root="):
        DATASETS.get("imagefolder")(_cfg(), tmp_path)
    with pytest.raises(DataNotFoundError) as err:
        DATASETS.get("imagefolder")(_cfg(root="nope"), tmp_path)
    assert f"{tmp_path}/nope" in str(err.value) and "does not exist" in str(err.value)


# --------------------------------------------------------------------------- Fed-ISIC2019 (generated)
def _flamby(base: Path, rows: list[tuple[str, int, int, str]]) -> None:
    images = base / "ISIC_2019_Training_Input_preprocessed"
    base.mkdir(parents=True)
    classes = ["MEL", "NV", "BCC", "AK", "BKL", "DF", "VASC", "SCC", "UNK"]
    with open(base / "train_test_split", "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["image", *classes, "target", "center", "fold", "fold2"])
        for k, (name, target, center, fold) in enumerate(rows):
            onehot = [1.0 if j == target else 0.0 for j in range(9)]
            w.writerow([name, *onehot, target, center, fold, f"{fold}_{center}"])
            _jpeg(images / f"{name}.jpg", np.full((224, 300, 3), 10 * k, np.uint8))


def test_fedisic_flamby_layout_natural_by_centre(tmp_path):
    rows = [("ISIC_3", 1, 0, "train"), ("ISIC_1", 0, 1, "test"), ("ISIC_2", 7, 1, "train"),
            ("ISIC_0", 2, 0, "test"), ("ISIC_4", 4, 1, "train"), ("ISIC_5", 4, 0, "train")]
    _flamby(tmp_path / "fedisic", rows)
    ds = DATASETS.get("fedisic")(_cfg(image_size=32), tmp_path)
    # train rows then test rows, each sorted by image name
    assert ds.targets.tolist() == [7, 1, 4, 4, 2, 0] and ds.groups.tolist() == [1, 0, 1, 0, 0, 1]
    assert ds.official_test.tolist() == [False] * 4 + [True] * 2
    assert ds.inputs.shape == (6, 3, 32, 32) and ds.num_classes == 8 and ds.group_names == ["BCN", "HAM_vidir_molemax"]
    assert int(ds.inputs[0].float().mean()) == 20  # ISIC_2 was written with value 10 * 2
    cfg = compose_config("dataset=fedisic", f"data_dir={tmp_path}", "partition=natural", "num_clients=2",
                         "dataset.image_size=32")
    data = build_federated_data(cfg)
    assert [(len(c.train), len(c.test)) for c in data.clients] == [(2, 1), (2, 1)]
    official = ds.official_test.numpy()
    assert all(not official[c.train].any() and official[c.test].all() for c in data.clients)
    (tmp_path / "fedisic" / "ISIC_2019_Training_Input_preprocessed" / "ISIC_4.jpg").unlink()
    with pytest.raises(ValueError, match=r"train_test_split:6: image .*ISIC_4.jpg does not exist"):
        DATASETS.get("fedisic")(_cfg(image_size=32), tmp_path)


def test_fedisic_missing(tmp_path):
    with pytest.raises(DataNotFoundError) as err:
        DATASETS.get("fedisic")(_cfg(), tmp_path)
    msg = str(err.value)
    assert f"{tmp_path}/fedisic/ISIC_2019_Training_Input_preprocessed/<image>.jpg" in msg
    assert "train_test_split" in msg and "github.com/owkin/FLamby" in msg and "manual download" in msg


# --------------------------------------------------------------------------- cache mechanics
def test_cache_key_and_identity(tmp_path):
    f = tmp_path / "a.bin"
    f.write_bytes(b"abc")
    ident = files_identity([f])
    assert cache_key("x", ident, {"s": 1}) == cache_key("x", ident, {"s": 1})
    assert cache_key("x", ident, {"s": 1}) != cache_key("x", ident, {"s": 2}) != cache_key("y", ident, {"s": 2})
    os.utime(f, ns=(1, 1))
    assert files_identity([f]) != ident


def test_cache_refuses_data_dir_and_recovers_from_damage(tmp_path, monkeypatch):
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    with pytest.warns(UserWarning, match="inside the data directory"):
        cache = TensorCache(data_dir / "cache", data_dir=data_dir)
    assert not cache.enabled
    entry, hit = cache.get("x", "k" * 64, lambda: {"t": torch.arange(3)})
    assert not hit and not (data_dir / "cache").exists()
    with pytest.warns(UserWarning, match="working directory"):
        monkeypatch.chdir(tmp_path)
        assert not TensorCache(tmp_path).enabled
    monkeypatch.setenv("FEDFEW_CACHE_DIR", "off")
    assert not TensorCache().enabled

    good = TensorCache(tmp_path / "c")
    calls = []
    build = lambda: calls.append(1) or {"t": torch.arange(5, dtype=torch.uint8)}  # noqa: E731
    a, hit_a = good.get("x", "f" * 64, build)
    b, hit_b = good.get("x", "f" * 64, build)
    assert (hit_a, hit_b, len(calls)) == (False, True, 1) and torch.equal(a["t"], b["t"])
    # no temporary file left; the build's lock lies apart, in .locks
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == [".locks", f"x-{'f' * 24}.pt"]
    good.path("x", "f" * 64).write_bytes(b"garbage")
    with pytest.warns(UserWarning, match="unreadable cache entry"):
        c, hit_c = good.get("x", "f" * 64, build)
    assert not hit_c and len(calls) == 2 and torch.equal(c["t"], torch.arange(5, dtype=torch.uint8))


def test_concurrent_misses_of_one_entry_build_it_once(tmp_path):
    """Two runs missing the same entry at once (make compare JOBS=2) build it once: the second waits
    for the first's lock, then reads its file (a hit). Threads stand in for processes: the lock is
    the operating system's (flock), held per open file, so two threads contend as two processes do."""
    import threading

    cache = TensorCache(tmp_path / "c")
    builds, results = [], {}

    def build():
        builds.append(threading.get_ident())
        time.sleep(0.5)  # long enough for the other thread to miss too
        return {"t": torch.arange(4)}

    def run(who):
        results[who] = cache.get("x", "a" * 64, build)

    threads = [threading.Thread(target=run, args=(w,)) for w in ("first", "second")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(builds) == 1
    assert sorted(hit for _, hit in results.values()) == [False, True]
    assert all(torch.equal(entry["t"], torch.arange(4)) for entry, _ in results.values())


def test_decode_helpers(tmp_path):
    img = np.random.default_rng(4).integers(0, 256, (30, 50, 3), dtype=np.uint8)
    _jpeg(tmp_path / "a.jpg", img)
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, "JPEG", progressive=True)
    assert _jpeg_size((tmp_path / "a.jpg").read_bytes()) == (50, 30) and _jpeg_size(buf.getvalue()) == (50, 30)
    assert _jpeg_size(b"\x89PNG....") is None
    out = decode_images([str(tmp_path / "a.jpg")], 10)
    assert out.shape == (1, 3, 10, 10) and out.dtype == torch.uint8
    (tmp_path / "bad.jpg").write_bytes(b"\xff\xd8 not really")
    with pytest.raises(ValueError, match="cannot decode image .*bad.jpg"):
        decode_images([str(tmp_path / "bad.jpg")], None)
    x = torch.tensor([[[[0, 255]], [[51, 102]]]], dtype=torch.uint8)
    y = normalize(x, (0.5, 0.2), (0.25, 0.1))
    assert torch.allclose(y, torch.tensor([[[[-2.0, 2.0]], [[0.0, 2.0]]]]), atol=1e-6)


def test_num_classes_mismatch_and_natural_hint(tmp_path):
    root = tmp_path / "mine"
    for c in ("a", "b", "c"):
        _jpeg(root / c / "0.jpg", np.zeros((8, 8, 3), np.uint8))
        _jpeg(root / c / "1.jpg", np.zeros((8, 8, 3), np.uint8))
    cfg = compose_config("dataset=imagefolder", f"data_dir={tmp_path}", "dataset.root=mine", "dataset.num_classes=4",
                         "num_clients=2", "partition=iid")
    with pytest.raises(ValueError, match="hold 3 classes but dataset.num_classes=4"):
        build_federated_data(cfg)
    cfg = compose_config("dataset=imagefolder", f"data_dir={tmp_path}", "dataset.root=mine", "num_clients=2",
                         "partition=iid", "dataset.image_size=8")
    data = build_federated_data(cfg)
    assert data.num_classes == 3 and data.inputs.shape == (6, 3, 8, 8)


# --------------------------------------------------------------------------- configs
@pytest.mark.parametrize("name", NEW_DATASETS)
def test_dataset_configs_compose(name):
    cfg = compose_config(f"dataset={name}")
    d = cfg.dataset
    assert d.name == name and d.kind == "image" and d.batch_size == 50
    assert d.lr > 0 and d.rounds >= 1 and "num_classes" in d
    assert {"image_size", "channels", "mean", "std", "cache", "in_memory"} <= set(d)
    # the reference trains ResNet-18 on Kvasir and Fed-ISIC2019, the two-conv CNN elsewhere
    assert cfg.model.name == ("resnet18" if name in ("kvasir", "fedisic") else "cnn") and name in DATASETS.names()


def test_cifar10_jpeg_tarballs_are_unpacked_once_into_the_cache(tmp_path, monkeypatch):
    """A data folder holding only cifar10/cifar10_{train,test}_jpg.tar.gz (the shared folder's layout)
    loads without a manual `tar xzf`: the tarballs are unpacked once into the cache directory, image by
    image the same tree, and a second load unpacks nothing."""
    classes = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
    tree, data = tmp_path / "tree", tmp_path / "data" / "cifar10"
    rng = np.random.default_rng(0)
    for split, per_class in (("train", 2), ("test", 1)):
        for c in classes:
            for i in range(per_class):
                _jpeg(tree / split / c / f"{i:04d}.jpg", rng.integers(0, 256, (32, 32, 3), dtype=np.uint8))
    data.mkdir(parents=True)
    for split in ("train", "test"):
        with tarfile.open(data / f"cifar10_{split}_jpg.tar.gz", "w:gz") as tar:
            tar.add(tree / split, arcname=split)
    cache = tmp_path / "cache"
    monkeypatch.setenv("FEDFEW_CACHE_DIR", str(cache))
    ds = DATASETS.get("cifar10")(_cfg(image_size=32, cache=False), data.parent)
    assert len(ds) == 30 and ds.class_names == classes
    assert ds.targets.tolist() == [k for k in range(10) for _ in range(2)] + list(range(10))
    assert ds.official_test.tolist() == [False] * 20 + [True] * 10
    unpacked = list((cache / "cifar10_jpg").iterdir())
    assert len(unpacked) == 1 and not any(p.name.startswith(".unpacking-") for p in (cache / "cifar10_jpg").iterdir())
    first = unpacked[0] / "train" / "airplane" / "0000.jpg"
    assert first.read_bytes() == (tree / "train" / "airplane" / "0000.jpg").read_bytes()
    stamp = first.stat().st_mtime_ns
    from fedfew.data.cache import TensorCache

    def no_lock(self, name):  # a tree unpacked before is read without waiting on another run's unpack
        raise AssertionError(f"took the lock {name} for a tree already unpacked")

    monkeypatch.setattr(TensorCache, "lock", no_lock)
    again = DATASETS.get("cifar10")(_cfg(image_size=32, cache=False), data.parent)
    assert torch.equal(again.inputs, ds.inputs) and first.stat().st_mtime_ns == stamp  # not unpacked again


def test_cifar10_tarballs_unpacked_by_concurrent_runs_once(tmp_path, monkeypatch):
    """Two runs starting at once on the tarballs (make compare JOBS=2) unpack them once and both load
    every image. Before the lock both unpacked, and the second to finish replaced the tree while the
    first was reading it (FileNotFoundError on a JPEG, 2026-12-07)."""
    import threading

    classes = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
    tree, data = tmp_path / "tree", tmp_path / "data" / "cifar10"
    rng = np.random.default_rng(1)
    for split in ("train", "test"):
        for c in classes:
            _jpeg(tree / split / c / "0000.jpg", rng.integers(0, 256, (32, 32, 3), dtype=np.uint8))
    data.mkdir(parents=True)
    for split in ("train", "test"):
        with tarfile.open(data / f"cifar10_{split}_jpg.tar.gz", "w:gz") as tar:
            tar.add(tree / split, arcname=split)
    monkeypatch.setenv("FEDFEW_CACHE_DIR", str(tmp_path / "cache"))
    unpacks, extractall = [], tarfile.TarFile.extractall

    def slow_extractall(self, *args, **kwargs):  # long enough for the other run to arrive meanwhile
        unpacks.append(self.name)
        time.sleep(0.3)
        return extractall(self, *args, **kwargs)

    monkeypatch.setattr(tarfile.TarFile, "extractall", slow_extractall)
    loaded, errors = [], []

    def run():
        try:
            loaded.append(DATASETS.get("cifar10")(_cfg(image_size=32, cache=False), data.parent))
        except Exception as err:  # noqa: BLE001 - reported by the assertion below
            errors.append(err)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(loaded) == 2
    assert len(unpacks) == 2  # the two tarballs, each once
    assert torch.equal(loaded[0].inputs, loaded[1].inputs) and len(loaded[0]) == 20
