"""Tiny ImageNet (Stanford CS231n): 200 classes of 64x64 colour images, 100,000 train (500 a
class) + 10,000 validation (50 a class). The validation set, whose labels are public, is the
official test split here (the release's ``test/`` images have no labels and are not read).

Layout of the standard release (``tiny-imagenet-200.zip``), found at
``<data_dir>/tiny-imagenet-200/``, ``<data_dir>/tinyimagenet/tiny-imagenet-200/`` or
``<data_dir>/tinyimagenet/``::

    wnids.txt                            200 WordNet ids, one a line (optional here)
    words.txt                            "<wnid>\\t<names>" (optional: class names)
    train/<wnid>/images/<wnid>_<k>.JPEG
    val/images/val_<k>.JPEG
    val/val_annotations.txt              "<file>\\t<wnid>\\t<x0>\\t<y0>\\t<x1>\\t<y1>"

Labels: position of the wnid in the sorted list of ``train/`` folders (the ImageFolder
convention). Some images are grayscale JPEGs; they are converted to RGB (``channels: 3``).
No download: the files must be fetched by hand (the error names the URL).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from fedfew.data.datasets import DATASETS
from fedfew.data.images import ImageDataset, setting, decode_images, load_cached, not_found

URL = "http://cs231n.stanford.edu/tiny-imagenet-200.zip"
LAYOUT = ("train/<wnid>/images/*.JPEG, val/images/*.JPEG and val/val_annotations.txt "
          "(the standard release, tiny-imagenet-200.zip, unzipped)")


def _root(data_dir: Path) -> Path | None:
    for root in (data_dir / "tiny-imagenet-200", data_dir / "tinyimagenet" / "tiny-imagenet-200",
                 data_dir / "tinyimagenet"):
        if (root / "train").is_dir() and (root / "val" / "val_annotations.txt").is_file():
            return root
    return None


def _class_names(root: Path, wnids: list[str]) -> list[str]:
    words = root / "words.txt"
    if not words.is_file():
        return list(wnids)
    names: dict[str, str] = {}
    with open(words, encoding="utf-8") as fh:
        for line in fh:
            wnid, _, text = line.rstrip("\n").partition("\t")
            names[wnid] = text.split(",")[0].strip() or wnid
    return [names.get(w, w) for w in wnids]


def scan(root: Path) -> tuple[list[str], list[int], list[bool], list[str]]:
    """Files, labels, official-test flags and wnids (sorted) of a release folder.

    Raises:
        ValueError: a validation annotation naming an unknown wnid or a missing image; a
            ``wnids.txt`` that disagrees with the ``train/`` folders.
    """
    wnids = sorted(p.name for p in (root / "train").iterdir() if (p / "images").is_dir())
    if not wnids:
        raise ValueError(f"{root / 'train'} holds no <wnid>/images/ folders")
    listed = root / "wnids.txt"
    if listed.is_file():
        expected = sorted(w.strip() for w in listed.read_text().split() if w.strip())
        if expected != wnids:
            missing = sorted(set(expected) - set(wnids))[:5]
            raise ValueError(f"{root / 'train'}: class folders differ from wnids.txt "
                             f"({len(wnids)} folders vs {len(expected)} ids; missing e.g. {missing})")
    label = {w: i for i, w in enumerate(wnids)}
    files: list[str] = []
    labels: list[int] = []
    for w in wnids:
        imgs = sorted(p for p in (root / "train" / w / "images").iterdir() if p.suffix.lower() in (".jpeg", ".jpg", ".png"))
        files += [str(p) for p in imgs]
        labels += [label[w]] * len(imgs)
    n_train = len(files)
    ann = root / "val" / "val_annotations.txt"
    rows = []
    with open(ann, encoding="utf-8") as fh:
        for num, line in enumerate(fh, 1):
            parts = line.rstrip("\n").split("\t")
            if len(parts) < 2 or not parts[0]:
                continue
            if parts[1] not in label:
                raise ValueError(f"{ann}:{num}: wnid {parts[1]!r} has no train/ folder")
            path = root / "val" / "images" / parts[0]
            if not path.is_file():
                raise ValueError(f"{ann}:{num}: image {path} does not exist")
            rows.append((parts[0], str(path), label[parts[1]]))
    rows.sort()
    files += [r[1] for r in rows]
    labels += [r[2] for r in rows]
    return files, labels, [False] * n_train + [True] * len(rows), wnids


@DATASETS.register("tinyimagenet")
def load(cfg: Any, data_dir: Path) -> ImageDataset:
    """Tiny ImageNet as (110000, 3, S, S) uint8 pixels (S = ``image_size``, default 64), 200
    classes, train rows first then the validation rows (official test).

    Raises:
        DataNotFoundError: no release folder (message: layouts, URL, data directory setting).
        ValueError: an inconsistent release folder (see :func:`scan`).
    """
    data_dir = Path(data_dir)
    root = _root(data_dir)
    if root is None:
        raise not_found("tinyimagenet", data_dir,
                        [f"tiny-imagenet-200/{LAYOUT}", "tinyimagenet/tiny-imagenet-200/...", "tinyimagenet/..."],
                        f"{URL} (manual download: unzip it into the data directory)")
    files, labels, test, wnids = scan(root)

    def build() -> dict[str, Any]:
        return {
            "inputs": decode_images(files, setting(cfg, "image_size"), int(setting(cfg, "channels", 3))),
            "targets": torch.tensor(labels, dtype=torch.int64),
            "official_test": torch.tensor(test, dtype=torch.bool),
            "groups": None,
            "group_names": None,
            "class_names": _class_names(root, wnids),
        }

    sources = files + [str(root / "val" / "val_annotations.txt")]
    return load_cached("tinyimagenet", cfg, data_dir, sources, build)
