"""AG's News topic classification (Zhang, Zhao & LeCun 2015): 4 classes, raw texts.

Source order:

1. ``<data_dir>/ag_news_csv/train.csv`` and ``test.csv`` in the original release format
   (https://github.com/mhjabreel/CharCnn_Keras/tree/master/data/ag_news_csv): headerless CSV,
   ``"class","title","description"``, class 1-based (1 World, 2 Sports, 3 Business,
   4 Sci/Tech), RFC 4180 quoting (``""`` inside a quoted field).
2. Otherwise ``datasets.load_dataset("ag_news")`` (the Hugging Face hub, or the local HF cache
   when the hub does not answer within a few seconds); its train and test splits are merged.
3. Otherwise :class:`~fedfew.data.base.DataNotFoundError`, raised within a few seconds.

The CSV files are read strictly (:func:`read_split`): a damaged file (cut off inside a quoted
field or a row, a row with a wrong field count, a class outside 1..4, an empty text) stops the
run with a :class:`~fedfew.data.base.DataFormatError` naming the file and line, before any
training; it is never read in part. A test.csv without the release's 7,600 rows is a warning.

Text = ``title + " " + description``, with the release's line-break marks removed
(:func:`clean_text`). Rows are ordered train first, then test; ``official_test`` marks the
test rows. The HTML remnants of the release (``#39;`` for an apostrophe, ``&lt;``...) are kept
as they are, as torchtext and HF ``datasets`` keep them.
"""
from __future__ import annotations

import csv
import logging
import re
from pathlib import Path
from typing import Any

import torch

from fedfew.data.base import DataFormatError, DataNotFoundError, PooledDataset
from fedfew.data.datasets import DATASETS

log = logging.getLogger(__name__)

CLASS_NAMES = ["World", "Sports", "Business", "Sci/Tech"]
SUBDIR = "ag_news_csv"
SOURCE_URL = "https://github.com/mhjabreel/CharCnn_Keras/tree/master/data/ag_news_csv"
HF_NAME = "ag_news"
SPLIT_FILES = ("train.csv", "test.csv")
TEST_ROWS = 7_600
"""Rows of the release's test.csv (1,900 a class); its train.csv has 120,000, but a subset of the
train rows is a normal setup (the shared data holds the first 2,000), so only test.csv's count
is compared (a warning: a smaller test.csv may be deliberate too)."""

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


def _bad_row(path: Path, line: int | None, problem: str) -> DataFormatError:
    """The error for a malformed CSV: where, what, and how to get good files."""
    where = f"{path}:{line}" if line is not None else str(path)
    return DataFormatError(
        f"{where}: {problem}. The file is damaged or cut off (an interrupted download?): download the "
        f"original release again from {SOURCE_URL} and put train.csv and test.csv in {path.parent}."
    )


def _ends_with_line_break(path: Path) -> bool:
    with open(path, "rb") as fh:
        fh.seek(-1, 2)
        return fh.read(1) == b"\n"


def read_split(path: Path) -> tuple[list[str], list[int]]:
    """Parse one file of the original release, strictly: a damaged file is an error, never a
    silently shorter dataset.

    Args:
        path: a headerless CSV with rows ``"class","title","description"`` (class 1..4), its
            last row ending with a line break as in the release; blank lines are skipped.
    Returns:
        ``(texts, labels)``: cleaned ``title + " " + description`` strings and 0-based labels.
    Raises:
        DataFormatError: (a ValueError) the message gives the file and line and how to get a good
            copy: no rows; not UTF-8 text; malformed CSV, e.g. a quoted field still open at the
            end of the file (cut off) or a stray quote; a row without exactly 3 fields, with a
            class outside 1..4 or with an empty title and description; a last row without its
            line break (the file is cut off; a complete hand-made file needs one added).
    """
    texts: list[str] = []
    labels: list[int] = []
    with open(path, encoding="utf-8", newline="") as fh:
        reader = csv.reader(fh, strict=True)
        try:
            for row in reader:
                if not row:
                    continue
                if len(row) != 3:
                    raise _bad_row(path, reader.line_num,
                                   f"expected 3 fields (class, title, description), got {len(row)}")
                label, title, description = row
                try:
                    y = int(label) - 1
                except ValueError:
                    y = -1
                if not 0 <= y < len(CLASS_NAMES):
                    raise _bad_row(path, reader.line_num, f"class {label!r} is not in 1..{len(CLASS_NAMES)}")
                text = clean_text(f"{title} {description}")
                if not text:
                    raise _bad_row(path, reader.line_num, "empty text (title and description are both empty)")
                texts.append(text)
                labels.append(y)
        except csv.Error as err:
            problem = ("the file ends inside a quoted field (an unterminated quote)" if "end of data" in str(err)
                       else f"malformed CSV ({err}; a quote inside a field is written as two)")
            raise _bad_row(path, reader.line_num, problem) from err
        except UnicodeDecodeError as err:
            raise _bad_row(path, None, f"not UTF-8 text after line {reader.line_num} ({err.reason})") from err
    if not texts:
        raise _bad_row(path, None, "no rows")
    if not _ends_with_line_break(path):
        raise _bad_row(path, reader.line_num, "the last row does not end with a line break, so the file is "
                       "probably cut off (if it is complete, add a line break at its end)")
    return texts, labels


def _not_found(data_dir: Path, reason: str | None) -> DataNotFoundError:
    """The error for missing files; ``reason``: why the HF hub dataset could not be loaded
    (``None``: it was not tried)."""
    base = data_dir / SUBDIR
    hub = "" if reason is None else (
        f", and the Hugging Face hub dataset `{HF_NAME}` could not be loaded ({reason})")
    return DataNotFoundError(
        f"AG News not found: expected {base}/{{train,test}}.csv ({base / 'train.csv'} and "
        f"{base / 'test.csv'}){hub}. Download the original release from {SOURCE_URL} (or let "
        f"`datasets.load_dataset('{HF_NAME}')` fetch it on a machine with network access), then "
        f"point the data directory at the folder that contains `{SUBDIR}/`: `data_dir=...` or the "
        f"FEDFEW_DATA_DIR environment variable."
    )


def _csv_files(data_dir: Path) -> list[Path] | None:
    """``[train.csv, test.csv]`` under ``data_dir/ag_news_csv``, or ``None`` unless both exist."""
    files = [data_dir / SUBDIR / name for name in SPLIT_FILES]
    return files if all(f.is_file() for f in files) else None


def find_files(cfg: Any, data_dir: Path) -> list[Path]:
    """The release's CSV files, checked without reading them (``python -m fedfew.check``: a
    Slurm job's files must be in place when it is queued; the HF hub fallback is not tried).

    Raises:
        DataNotFoundError: train.csv or test.csv is missing (the message names both paths).
    """
    files = _csv_files(Path(data_dir))
    if files is None:
        raise _not_found(Path(data_dir), None)
    return files


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
        DataFormatError: (a ValueError) a malformed or cut-off CSV file (see :func:`read_split`);
            the message names the file and line.
    """
    data_dir = Path(data_dir)
    files = _csv_files(data_dir)
    if files is not None:
        train_csv, test_csv = files
        train_texts, train_labels = read_split(train_csv)
        test_texts, test_labels = read_split(test_csv)
        if len(test_texts) != TEST_ROWS:
            log.warning("%s has %d rows, the original release %d: a partial or edited copy? If not "
                        "deliberate, download it again from %s", test_csv, len(test_texts), TEST_ROWS, SOURCE_URL)
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
