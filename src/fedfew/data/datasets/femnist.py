"""FEMNIST from the LEAF benchmark (Caldas et al., 2018): 28x28 grayscale handwritten digits
and letters, 62 classes, **one client per writer** (natural partition, ``partition=natural``).

Files: LEAF's JSON output, ``train/*.json`` and ``test/*.json``, each
``{"users": [...], "num_samples": [...], "user_data": {writer: {"x": [[784 floats]], "y": [...]}}}``
with ``x`` row-major 28x28 pixel values ``k/255`` (1.0 = white background) and ``y`` in
0..61 (0-9 digits, 10-35 ``A``-``Z``, 36-61 ``a``-``z``). LEAF splits each writer's samples
into train and test (``-t sample``), so every writer appears in both folders.

Where: ``dataset.root`` (relative to the data directory) when set; else the first of
``<data_dir>/femnist/{train,test}``, ``<data_dir>/femnist/data/{train,test}`` (the LEAF
repository layout) and ``<data_dir>/femnist/<one sub-folder>/{train,test}`` (e.g.
``femnist/leaf_niid_05``; several such folders is an error asking for ``dataset.root``).

The pooled dataset keeps LEAF's split: ``official_test`` marks the test-file samples and
``groups`` the writer (``group_names`` holds the writer ids; group ``g`` is the ``g``-th writer
in sorted order, which the natural partition maps to client ``g``). Pixels are stored exactly
as uint8 (``round(255 x)``; LEAF's values are multiples of 1/255).

Every file is checked as it is read (:func:`read_leaf`): a truncated file, ``users`` that disagree
with ``user_data`` or ``num_samples``, x and y of different lengths stop the run with a
:class:`~fedfew.data.base.DataFormatError` naming the file and the user, before any training.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedfew.data.base import DataFormatError
from fedfew.data.datasets import DATASETS
from fedfew.data.images import ImageDataset, setting, convert_images, load_cached, not_found

SOURCE = ("the LEAF benchmark, https://github.com/TalwalkarLab/leaf (data/femnist: "
          "`./preprocess.sh -s niid --sf 0.05 -k 0 -t sample` writes data/train and data/test)")
CLASS_NAMES = [str(d) for d in range(10)] + [chr(c) for c in range(ord("A"), ord("Z") + 1)] + \
              [chr(c) for c in range(ord("a"), ord("z") + 1)]


def _has_split(root: Path) -> bool:
    return any((root / "train").glob("*.json")) and any((root / "test").glob("*.json"))


def find_root(data_dir: Path, cfg: Any) -> Path:
    """The folder holding ``train/*.json`` and ``test/*.json`` (see module doc).

    Raises:
        DataNotFoundError: none found (or ``dataset.root`` lacks the files).
        ValueError: several candidate folders and no ``dataset.root``.
    """
    explicit = setting(cfg, "root")
    if explicit:
        root = data_dir / str(explicit)
        if _has_split(root):
            return root
        raise not_found("femnist", data_dir, [f"{explicit}/train/*.json and {explicit}/test/*.json (dataset.root)"],
                        SOURCE)
    base = data_dir / "femnist"
    for root in (base, base / "data"):
        if _has_split(root):
            return root
    found = sorted(p for p in base.iterdir() if p.is_dir() and _has_split(p)) if base.is_dir() else []
    if len(found) == 1:
        return found[0]
    if len(found) > 1:
        raise ValueError(f"femnist: several LEAF folders under {base}: {', '.join(p.name for p in found)}; "
                         f"choose one with dataset.root=femnist/<folder>")
    raise not_found("femnist", data_dir,
                    ["femnist/train/*.json and femnist/test/*.json (LEAF JSON)",
                     "femnist/data/{train,test}/*.json (LEAF repository layout)",
                     "femnist/<folder>/{train,test}/*.json (e.g. femnist/leaf_niid_05)"],
                    SOURCE)


def _bad(path: Path, problem: str, user: Any = None) -> DataFormatError:
    """The error for a malformed LEAF file: file (and user), what is wrong, how to get a good one."""
    where = f"{path}: user {user!r}" if user is not None else str(path)
    return DataFormatError(f"{where}: {problem}. The file is damaged, cut off (an interrupted copy?) or not "
                           f"LEAF's output: write it again with {SOURCE} and put it in {path.parent}.")


def _read_json(path: Path) -> Any:
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except json.JSONDecodeError as err:  # a truncated file ends in the middle of a value
        raise _bad(path, f"not valid JSON at line {err.lineno} column {err.colno} ({err.msg}); a file "
                         f"that stops early is cut off") from err
    except UnicodeDecodeError as err:
        raise _bad(path, f"not UTF-8 text ({err.reason})") from err


def _check_users(path: Path, blob: Any) -> list[Any] | None:
    """``users`` and the keys of ``user_data`` name the same users, each once, and
    ``num_samples`` (optional) has one entry per user; returns ``num_samples``."""
    if not isinstance(blob, dict) or not isinstance(blob.get("users"), list) \
            or not isinstance(blob.get("user_data"), dict):
        raise _bad(path, "not a LEAF file (needs a `users` list and a `user_data` object)")
    users, user_data = blob["users"], blob["user_data"]
    listed = set(users)
    if len(listed) != len(users):
        raise _bad(path, "listed twice in `users`", next(u for i, u in enumerate(users) if u in users[:i]))
    for user in users:
        if user not in user_data:
            raise _bad(path, "listed in `users` but has no entry in `user_data`", user)
    for user in user_data:
        if user not in listed:
            raise _bad(path, "has an entry in `user_data` but is not listed in `users`", user)
    counts = blob.get("num_samples")
    if counts is not None and (not isinstance(counts, list) or len(counts) != len(users)):
        raise _bad(path, f"`num_samples` should hold one count per user ({len(users)} users), got "
                         f"{str(counts)[:80]}")
    return counts


def _samples(path: Path, user: Any, data: Any) -> tuple[np.ndarray, np.ndarray]:
    """One user's ``(x (n, 784) float32, y (n,) int64)``, checked."""
    if not isinstance(data, dict) or "x" not in data or "y" not in data:
        raise _bad(path, "its `user_data` entry has no `x` and `y`", user)
    try:
        x = np.asarray(data["x"], dtype=np.float32)
        y = np.asarray(data["y"], dtype=np.int64)
    except (TypeError, ValueError) as err:  # ragged or non-numeric samples
        raise _bad(path, f"x or y is not a list of numbers of one shape ({err})", user) from err
    if x.ndim != 2 or x.shape[1] != 784 or y.ndim != 1:
        raise _bad(path, f"x has shape {x.shape} and y {y.shape}; expected (n, 784) and (n,)", user)
    if len(x) != len(y):
        raise _bad(path, f"x has {len(x)} samples but y has {len(y)} labels", user)
    if len(y) and (y.min() < 0 or y.max() >= len(CLASS_NAMES)):
        raise _bad(path, f"labels outside 0..{len(CLASS_NAMES) - 1}", user)
    return x, y


def read_leaf(files: list[Path]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Writer -> ((n, 784) float32 pixels, (n,) int64 labels) over LEAF JSON files.

    Raises:
        DataFormatError: (a ValueError) the message names the file and the user (writer) and
            says how to get a good copy: not valid JSON (e.g. a truncated file); no ``users``
            list or ``user_data`` object; a user listed twice, listed without data, or with
            data but not listed; ``num_samples`` (optional) not one count per user, or not the
            length of the user's ``x`` and ``y``; ``x`` and ``y`` of different lengths; a
            sample that is not 784 values; a label outside 0..61; a user present in two files
            of the same split.
    """
    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for path in files:
        blob = _read_json(path)
        counts = _check_users(path, blob)
        for i, writer in enumerate(blob["users"]):
            if writer in out:
                raise _bad(path, "appears in two files of the same split", writer)
            x, y = _samples(path, writer, blob["user_data"][writer])
            if counts is not None and counts[i] != len(y):
                raise _bad(path, f"`num_samples` says {counts[i]} samples but x and y have {len(y)}", writer)
            out[writer] = (x, y)
    return out


def _split_files(cfg: Any, data_dir: Path) -> tuple[list[Path], list[Path]]:
    """``(train, test)`` LEAF JSON files, each list sorted."""
    root = find_root(Path(data_dir), cfg)
    return sorted((root / "train").glob("*.json")), sorted((root / "test").glob("*.json"))


def find_files(cfg: Any, data_dir: Path) -> list[Path]:
    """Every LEAF JSON file, train then test, found without reading them (``python -m
    fedfew.check``: a Slurm job's files must be in place when it is queued).

    Raises:
        DataNotFoundError, ValueError: as :func:`find_root`.
    """
    train, test = _split_files(cfg, data_dir)
    return train + test


def build_entry(train_files: list[Path], test_files: list[Path], cfg: Any) -> dict[str, Any]:
    """Cache entry: writers in sorted order, each writer's train samples then its test samples
    (file order kept inside a writer)."""
    train, test = read_leaf(train_files), read_leaf(test_files)
    writers = sorted(set(train) | set(test))
    xs, ys, is_test, groups = [], [], [], []
    for g, w in enumerate(writers):
        for split, flag in ((train, False), (test, True)):
            if w in split:
                x, y = split[w]
                xs.append(x)
                ys.append(y)
                is_test.append(np.full(len(y), flag))
                groups.append(np.full(len(y), g, dtype=np.int64))
    pixels = np.rint(np.concatenate(xs) * 255.0).clip(0, 255).astype(np.uint8).reshape(-1, 1, 28, 28)
    inputs = convert_images(torch.from_numpy(pixels), setting(cfg, "image_size"), int(setting(cfg, "channels", 1)))
    return {
        "inputs": inputs,
        "targets": torch.from_numpy(np.concatenate(ys)),
        "official_test": torch.from_numpy(np.concatenate(is_test)),
        "groups": torch.from_numpy(np.concatenate(groups)),
        "group_names": writers,
        "class_names": list(CLASS_NAMES),
    }


@DATASETS.register("femnist")
def load(cfg: Any, data_dir: Path) -> ImageDataset:
    """FEMNIST (LEAF) as (N, 1, 28, 28) uint8 pixels with writer groups and LEAF's split.

    With the 5% non-IID sample (26 writers): N = 3,877 train + 443 test.

    Raises:
        DataNotFoundError: no LEAF folder (message: layouts, LEAF source, data directory setting).
        DataFormatError: (a ValueError) a malformed or truncated file (see :func:`read_leaf`);
            the message names the file and the user.
        ValueError: ambiguous folders.
    """
    data_dir = Path(data_dir)
    train, test = _split_files(cfg, data_dir)
    return load_cached("femnist", cfg, data_dir, train + test, lambda: build_entry(train, test, cfg),
                       default_channels=1)
