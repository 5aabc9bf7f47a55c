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
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

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


def read_leaf(files: list[Path]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Writer -> ((n, 784) float32 pixels, (n,) int64 labels) over LEAF JSON files.

    Raises:
        ValueError: a file without ``users``/``user_data``, a sample that is not 784 values, a
            label outside 0..61, a writer present in two files of the same split.
    """
    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for path in files:
        with open(path, encoding="utf-8") as fh:
            blob = json.load(fh)
        if "users" not in blob or "user_data" not in blob:
            raise ValueError(f"{path}: not a LEAF file (needs `users` and `user_data`)")
        for writer in blob["users"]:
            if writer in out:
                raise ValueError(f"{path}: writer {writer!r} appears in two files of the same split")
            data = blob["user_data"][writer]
            x = np.asarray(data["x"], dtype=np.float32).reshape(len(data["x"]), -1)
            y = np.asarray(data["y"], dtype=np.int64)
            if x.shape[1] != 784 or len(x) != len(y):
                raise ValueError(f"{path}: writer {writer!r} has x of shape {x.shape} and {len(y)} labels; "
                                 f"expected (n, 784) and n labels")
            if len(y) and (y.min() < 0 or y.max() >= len(CLASS_NAMES)):
                raise ValueError(f"{path}: writer {writer!r} has labels outside 0..61")
            out[writer] = (x, y)
    return out


def build_entry(root: Path, cfg: Any) -> dict[str, Any]:
    """Cache entry: writers in sorted order, each writer's train samples then its test samples
    (file order kept inside a writer)."""
    train = read_leaf(sorted((root / "train").glob("*.json")))
    test = read_leaf(sorted((root / "test").glob("*.json")))
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
        ValueError: malformed JSON content (see :func:`read_leaf`), ambiguous folders.
    """
    data_dir = Path(data_dir)
    root = find_root(data_dir, cfg)
    sources = sorted((root / "train").glob("*.json")) + sorted((root / "test").glob("*.json"))
    return load_cached("femnist", cfg, data_dir, sources, lambda: build_entry(root, cfg),
                       default_channels=1)
