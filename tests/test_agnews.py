"""AG News loader: original CSV format, strict reading of damaged files, HF fallback failure,
real-data counts."""
from __future__ import annotations

import collections
import logging
import time
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from fedfew.data.base import DataFormatError, DataNotFoundError, PooledDataset
from fedfew.data.datasets import DATASETS
from fedfew.data.datasets import agnews

AGNEWS_FILES = ("ag_news_csv/train.csv", "ag_news_csv/test.csv")
CONF = Path(__file__).resolve().parents[1] / "conf" / "dataset" / "agnews.yaml"


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text.encode("utf-8"))


@pytest.fixture
def tiny_dir(tmp_path: Path) -> Path:
    """A data dir with a 3-row train.csv and a 2-row test.csv in the release's exact format."""
    train = (
        '"3","Wall St. Bears Claw Back (Reuters)","Reuters - Short-sellers, Wall Street\'s dwindling\\band of ultra-cynics."\n'
        '"1","Title with ""quotes"", and commas","Price rose to \\$55.8bn,\\Analysts said ""wow""."\n'
        '"4","Multi\nline title","Ends with backslashes\\\\"\n'
    )
    test = (
        '"2","Sports, now","a rose by any other\\name"\n'
        '"4","Sci","Tech\\\\Java developers"\n'
    )
    _write(tmp_path / "ag_news_csv" / "train.csv", train)
    _write(tmp_path / "ag_news_csv" / "test.csv", test)
    return tmp_path


def test_registered() -> None:
    assert DATASETS.get("agnews") is agnews.load
    assert "agnews" in DATASETS.names()


def test_parse_original_format(tiny_dir: Path) -> None:
    ds = agnews.load(OmegaConf.create({"name": "agnews"}), tiny_dir)
    assert isinstance(ds, PooledDataset)
    assert len(ds) == 5 and ds.inputs is None and ds.num_classes == 4 and ds.name == "agnews"
    assert ds.class_names == ["World", "Sports", "Business", "Sci/Tech"]
    assert ds.targets.dtype == torch.int64 and ds.targets.tolist() == [2, 0, 3, 1, 3]
    assert ds.official_test.dtype == torch.bool
    assert ds.official_test.tolist() == [False, False, False, True, True]
    assert ds.texts == [
        "Wall St. Bears Claw Back (Reuters) Reuters - Short-sellers, Wall Street's dwindling band of ultra-cynics.",
        'Title with "quotes", and commas Price rose to $55.8bn, Analysts said "wow".',
        "Multi\nline title Ends with backslashes",
        "Sports, now a rose by any other name",
        "Sci Tech Java developers",
    ]


def test_clean_text() -> None:
    assert agnews.clean_text("dwindling\\band") == "dwindling band"
    assert agnews.clean_text("any other\\name") == "any other name"  # the "n" is not an escape
    assert agnews.clean_text("record \\$55.8bn") == "record $55.8bn"
    assert agnews.clean_text("said.\\\\For example") == "said. For example"
    assert agnews.clean_text("\\\\Today") == "Today"
    assert agnews.clean_text("no backslash #39;here") == "no backslash #39;here"


@pytest.mark.parametrize(
    ("row", "match"),
    [
        ('"5","t","d"\n', "class '5' is not in 1..4"),
        ('"x","t","d"\n', "class 'x' is not in 1..4"),
        ('"1","t"\n', "expected 3 fields (class, title, description), got 2"),
        ('"1","t","d","e"\n', "expected 3 fields (class, title, description), got 4"),
        ('"2","",""\n', "empty text"),
        ('"2","a "quoted" word","d"\n', "malformed CSV"),
        ('"2","Title","a description cut off in the mid', "ends inside a quoted field (an unterminated quote)"),
        ('"2","Title","a description"', "the last row does not end with a line break"),
        ('2,Title,a descr', "the last row does not end with a line break"),
    ],
)
@pytest.mark.parametrize("split", ["train.csv", "test.csv"])
def test_malformed_rows(tmp_path: Path, row: str, match: str, split: str) -> None:
    """A damaged file (a bad row, or cut off as by an interrupted download) is an error naming
    the file, the line and the fix, never a dataset of the rows that survived."""
    for name in ("train.csv", "test.csv"):
        _write(tmp_path / "ag_news_csv" / name, '"1","ok","fine"\n' + (row if name == split else ""))
    with pytest.raises(DataFormatError) as info:
        agnews.load({}, tmp_path)
    msg = str(info.value)
    assert msg.startswith(f"{tmp_path / 'ag_news_csv' / split}:2: ") and match in msg
    assert f"download the original release again from {agnews.SOURCE_URL}" in msg
    assert f"put train.csv and test.csv in {tmp_path / 'ag_news_csv'}" in msg
    assert isinstance(info.value, ValueError)  # `python -m fedfew.train` prints it and exits 2


@pytest.mark.parametrize(("content", "match"), [(b"", "no rows"), ('"1","t","caf\u00e9"\n'.encode()[:-3], "not UTF-8")])
def test_empty_or_not_text(tmp_path: Path, content: bytes, match: str) -> None:
    path = tmp_path / "test.csv"
    path.write_bytes(content)
    with pytest.raises(DataFormatError, match=match) as info:
        agnews.read_split(path)
    assert str(info.value).startswith(f"{path}")


@pytest.mark.realdata("ag_news_csv/test.csv")
def test_real_test_csv_cut_off_anywhere_is_an_error(tmp_path: Path, real_data_dir: Path) -> None:
    """The real test.csv cut as an interrupted download cuts it: inside a text, just after a
    field's closing quote, after a comma, before the final line break (the file is ASCII: the
    cut inside a multi-byte character is test_empty_or_not_text's)."""
    full = (real_data_dir / "ag_news_csv" / "test.csv").read_bytes()
    middle = len(full) // 2
    cuts = {
        "inside a quoted field": middle,
        "after a closing quote": full.index(b'",', middle) + 1,
        "after a comma": full.index(b'",', middle) + 2,
        "before the last line break": len(full) - 1,
    }
    for where, cut in cuts.items():
        path = tmp_path / "test.csv"
        path.write_bytes(full[:cut])
        with pytest.raises(DataFormatError) as info:
            agnews.read_split(path)
        assert str(info.value).startswith(str(path)), where
    path.write_bytes(full)
    assert len(agnews.read_split(path)[0]) == agnews.TEST_ROWS


def test_short_test_csv_is_a_warning(tiny_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="fedfew.data.datasets.agnews"):
        agnews.load({}, tiny_dir)
    assert f"{tiny_dir / 'ag_news_csv' / 'test.csv'} has 2 rows, the original release 7600" in caplog.text


def _isolate_hf_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Offline mode and empty HF caches, so a developer's cached copy cannot answer."""
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_datasets")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf_hub"))


@pytest.mark.parametrize("present", [(), ("train.csv",)])
def test_missing_data_raises_fast(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, present: tuple[str, ...]) -> None:
    _isolate_hf_cache(monkeypatch, tmp_path)
    data_dir = tmp_path / "data"
    for name in present:  # one file alone is not enough
        _write(data_dir / "ag_news_csv" / name, '"1","t","d"\n')
    start = time.monotonic()
    with pytest.raises(DataNotFoundError) as info:
        agnews.load({}, data_dir)
    assert time.monotonic() - start < 30
    msg = str(info.value)
    assert f"{data_dir / 'ag_news_csv'}/{{train,test}}.csv" in msg
    assert "FEDFEW_DATA_DIR" in msg and "data_dir=" in msg
    assert "CharCnn_Keras" in msg and "ag_news" in msg
    assert isinstance(info.value, FileNotFoundError)


def test_missing_data_hub_unreachable(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Without offline env vars: the hub probe says unreachable -> cache only -> fast failure."""
    import datasets.config
    import huggingface_hub.constants

    from fedfew.data import text

    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(text, "hub_reachable", lambda timeout=3.0: False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_datasets")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf_hub"))
    offline_before = (datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE)
    start = time.monotonic()
    with pytest.raises(DataNotFoundError, match="FEDFEW_DATA_DIR"):
        agnews.load({}, tmp_path / "nowhere")
    assert time.monotonic() - start < 30
    # the temporary offline switch is undone
    assert (datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE) == offline_before


def test_config_file() -> None:
    cfg = OmegaConf.load(CONF)
    assert dict(cfg) == {
        "name": "agnews",
        "batch_size": 100,
        "tokenizer": "basic_english",
        "max_vocab": 32000,
        "max_length": 200,
        "group_by_length": True,
        "num_classes": 4,
        "kind": "text",
        "lr": 0.2,
        "clip_norm": 5.0,
        "rounds": 60,
    }


@pytest.mark.realdata(*AGNEWS_FILES)
def test_real_agnews(real_data_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    cfg = OmegaConf.load(CONF)
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="fedfew.data.datasets.agnews"):
        ds = DATASETS.get("agnews")(cfg, real_data_dir)
    assert not caplog.records  # the full test.csv, and a train.csv subset is no warning
    assert time.monotonic() - start < 2.0  # 9,600 rows; about 0.06 s in practice
    assert len(ds) == 2000 + 7600 and len(ds.texts) == 9600
    assert int(ds.official_test.sum()) == 7600
    assert not ds.official_test[:2000].any() and ds.official_test[2000:].all()
    train_counts = collections.Counter(ds.targets[:2000].tolist())
    test_counts = collections.Counter(ds.targets[2000:].tolist())
    assert train_counts == {0: 477, 1: 338, 2: 408, 3: 777}
    assert test_counts == {0: 1900, 1: 1900, 2: 1900, 3: 1900}
    assert int(ds.targets[0]) == 2  # "3" (Business) in the file
    assert ds.texts[0] == (
        "Wall St. Bears Claw Back Into the Black (Reuters) Reuters - Short-sellers, "
        "Wall Street's dwindling band of ultra-cynics, are seeing green again."
    )
    assert ds.texts[2000].startswith("Fears for T N pension after talks Unions representing workers")
    assert int(ds.targets[2000]) == 2
    assert not any("\\" in t for t in ds.texts)
    assert all(t and t == t.strip() for t in ds.texts)
