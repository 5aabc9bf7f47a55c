"""AG's News topic classification (Zhang, Zhao & LeCun 2015): 4 classes, raw texts.

Source order:

1. ``<data_dir>/ag_news_csv/train.csv`` and ``test.csv`` in the original release format
   (https://github.com/mhjabreel/CharCnn_Keras/tree/master/data/ag_news_csv): headerless CSV,
   ``"class","title","description"``, class 1-based (1 World, 2 Sports, 3 Business,
   4 Sci/Tech), RFC 4180 quoting (``""`` inside a quoted field).
2. Otherwise ``datasets.load_dataset("ag_news")`` (the Hugging Face hub, or the local HF cache
   when the hub does not answer within a few seconds); its train and test splits are merged.
3. Otherwise :class:`~fedfew.data.base.DataNotFoundError`, raised within a few seconds.

Text = ``title + " " + description``, with the release's line-break marks removed
(:func:`clean_text`). Rows are ordered train first, then test; ``official_test`` marks the
test rows. The HTML remnants of the release (``#39;`` for an apostrophe, ``&lt;``...) are kept
as they are, as torchtext and HF ``datasets`` keep them.
"""
from __future__ import annotations

import csv
import re
from pathlib import Path
from typing import Any

import torch

from fedfew.data.base import DataNotFoundError, PooledDataset
from fedfew.data.datasets import DATASETS

CLASS_NAMES = ["World", "Sports", "Business", "Sci/Tech"]
SUBDIR = "ag_news_csv"
SOURCE_URL = "https://github.com/mhjabreel/CharCnn_Keras/tree/master/data/ag_news_csv"
HF_NAME = "ag_news"

# The release marks a line break of the source article with a lone backslash glued to the next
# word ("dwindling\band", "any other\name"), and escapes a few characters the same way
# ("\$55.8bn", "\\Java"). Its readme speaks of "\n", but the "n" after a backslash always
# belongs to the next word ("DNS\names", "might\not"), so treating "\n" as an escape would eat
# letters. Rule: every run of backslashes, with the spaces around it, becomes one space.
_BACKSLASH_RUN = re.compile(r"\s*\\+\s*")


def clean_text(text: str) -> str:
    """Replace each run of backslashes (a line-break mark or an escape) with a single space.

    ``"Wall Street's dwindling\\band of"`` -> ``"Wall Street's dwindling band of"``;
    ``"record \\$55.8bn"`` -> ``"record $55.8bn"``. Leading/trailing spaces are stripped.
    """
    return _BACKSLASH_RUN.sub(" ", text).strip()


def read_split(path: Path) -> tuple[list[str], list[int]]:
    """Parse one file of the original release.

    Args:
        path: a headerless CSV with rows ``"class","title","description"`` (class 1..4).
    Returns:
        ``(texts, labels)``: cleaned ``title + " " + description`` strings and 0-based labels.
    Raises:
        ValueError: a row without exactly 3 fields or with a class outside 1..4 (the message
            gives the file and line).
    """
    texts: list[str] = []
    labels: list[int] = []
    with open(path, encoding="utf-8", newline="") as fh:
        reader = csv.reader(fh)
        for row in reader:
            if not row:
                continue
            if len(row) != 3:
                raise ValueError(f"{path}:{reader.line_num}: expected 3 fields (class, title, description), got {len(row)}")
            label, title, description = row
            try:
                y = int(label) - 1
            except ValueError:
                y = -1
            if not 0 <= y < len(CLASS_NAMES):
                raise ValueError(f"{path}:{reader.line_num}: class {label!r} is not in 1..{len(CLASS_NAMES)}")
            texts.append(clean_text(f"{title} {description}"))
            labels.append(y)
    return texts, labels


def _not_found(data_dir: Path, reason: str) -> DataNotFoundError:
    base = data_dir / SUBDIR
    return DataNotFoundError(
        f"AG News not found: expected {base}/{{train,test}}.csv ({base / 'train.csv'} and "
        f"{base / 'test.csv'}), and the Hugging Face hub dataset `{HF_NAME}` could not be loaded "
        f"({reason}). Download the original release from {SOURCE_URL} (or let "
        f"`datasets.load_dataset('{HF_NAME}')` fetch it on a machine with network access), then "
        f"point the data directory at the folder that contains `{SUBDIR}/`: `data_dir=...` or the "
        f"FEDFEW_DATA_DIR environment variable."
    )


def _load_hf(data_dir: Path) -> tuple[list[str], list[int], list[bool]]:
    """Train + test splits of the HF hub dataset (cache only when the hub is unreachable)."""
    try:
        import datasets
    except ImportError as exc:
        raise _not_found(data_dir, "the `datasets` package is not installed") from exc
    from fedfew.data.text import hub_offline, hub_reachable

    online = hub_reachable()
    try:
        if online:
            ds = datasets.load_dataset(HF_NAME)
        else:
            with hub_offline():
                ds = datasets.load_dataset(HF_NAME)
    except Exception as exc:  # noqa: BLE001 - any failure of the optional source means "not found"
        first_line = str(exc).splitlines()[0] if str(exc) else ""
        where = "hub" if online else "hub unreachable or offline mode set, so local HF cache only"
        raise _not_found(data_dir, f"{where}: {type(exc).__name__}: {first_line}") from exc
    texts: list[str] = []
    labels: list[int] = []
    is_test: list[bool] = []
    for split, test in (("train", False), ("test", True)):
        part = ds[split]
        texts += [clean_text(t) for t in part["text"]]
        labels += [int(y) for y in part["label"]]
        is_test += [test] * len(part)
    return texts, labels, is_test


@DATASETS.register("agnews")
def load(cfg: Any, data_dir: Path) -> PooledDataset:
    """Load AG News as raw texts (tokenised later, on the clients' training texts only).

    Args:
        cfg: dataset config (unused: the loader has no options).
        data_dir: data directory holding ``ag_news_csv/{train,test}.csv``.
    Returns:
        :class:`PooledDataset` with ``texts`` (N strings), ``targets`` (N,) int64 in 0..3,
        ``official_test`` (N,) bool (True for rows of test.csv), ``num_classes`` 4, train rows
        first. With the original files N = 120,000 + 7,600.
    Raises:
        DataNotFoundError: neither the CSV files nor the HF hub/cache dataset are available;
            the message names the expected path, the download source and ``FEDFEW_DATA_DIR``.
        ValueError: a malformed CSV row.
    """
    data_dir = Path(data_dir)
    train_csv, test_csv = data_dir / SUBDIR / "train.csv", data_dir / SUBDIR / "test.csv"
    if train_csv.is_file() and test_csv.is_file():
        train_texts, train_labels = read_split(train_csv)
        test_texts, test_labels = read_split(test_csv)
        texts = train_texts + test_texts
        labels = train_labels + test_labels
        is_test = [False] * len(train_texts) + [True] * len(test_texts)
    else:
        texts, labels, is_test = _load_hf(data_dir)
    return PooledDataset(
        texts=texts,
        targets=torch.tensor(labels, dtype=torch.int64),
        num_classes=len(CLASS_NAMES),
        official_test=torch.tensor(is_test, dtype=torch.bool),
        class_names=list(CLASS_NAMES),
        name="agnews",
    )
