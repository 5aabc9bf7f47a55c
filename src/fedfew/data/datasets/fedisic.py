"""Fed-ISIC2019 (FLamby, Ogier du Terrail et al., NeurIPS 2022 Datasets & Benchmarks):
23,247 dermoscopy images of the ISIC 2019 challenge, 8 classes, **one client per centre**
(6 centres: natural partition, ``partition=natural``) with FLamby's per-centre train/test split.

Manual download (licences to accept): follow FLamby's ``flamby/datasets/fed_isic2019/README.md``
(https://github.com/owkin/FLamby): ``download_isic.py`` then ``resize_images.py`` give the
preprocessed images (shorter side 224 px, colour constancy). Expected layout, in
``<data_dir>/fedisic/`` or ``<data_dir>/fed_isic2019/``::

    ISIC_2019_Training_Input_preprocessed/<image>.jpg
    train_test_split            FLamby's metadata CSV (``train_test_split.csv`` also accepted),
                                copied from flamby/datasets/fed_isic2019/dataset_creation_scripts/

The CSV has a header with at least ``image,target,center,fold``: ``target`` in 0..7 (MEL, NV,
BCC, AK, BKL, DF, VASC, SCC), ``center`` in 0..5 (BCN, HAM_vidir_molemax, HAM_vidir_modern,
HAM_rosendahl, MSK, HAM_vienna_dias), ``fold`` ``train`` or ``test``. Rows: the ``train``
rows then the ``test`` rows, each sorted by image name; ``official_test`` marks the test
rows and ``groups`` the centre. Images are resized (shorter side to ``image_size``, 224 in
conf/dataset/fedisic.yaml as in the reference, then centre crop) while decoding.
"""
from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import torch

from fedfew.data.datasets import DATASETS
from fedfew.data.images import ImageDataset, setting, decode_images, load_cached, not_found

CLASS_NAMES = ["MEL", "NV", "BCC", "AK", "BKL", "DF", "VASC", "SCC"]
CENTER_NAMES = ["BCN", "HAM_vidir_molemax", "HAM_vidir_modern", "HAM_rosendahl", "MSK", "HAM_vienna_dias"]
IMAGES = "ISIC_2019_Training_Input_preprocessed"
SPLIT_FILES = ("train_test_split", "train_test_split.csv")
SOURCE = ("FLamby's Fed-ISIC2019 instructions, https://github.com/owkin/FLamby/tree/main/flamby/datasets/"
          "fed_isic2019 (download_isic.py + resize_images.py; copy dataset_creation_scripts/train_test_split; "
          "manual download, licences CC-BY-NC 4.0)")


def _root(data_dir: Path) -> tuple[Path, Path] | None:
    for base in (data_dir / "fedisic", data_dir / "fed_isic2019"):
        if (base / IMAGES).is_dir():
            for name in SPLIT_FILES:
                if (base / name).is_file():
                    return base, base / name
    return None


def read_split(path: Path, images: Path) -> list[tuple[str, int, int, bool]]:
    """``(image path, target, center, is_test)`` rows of FLamby's metadata CSV, train rows
    first, each part sorted by image name.

    Raises:
        ValueError: a missing column, a target outside 0..7, a negative centre, a fold other
            than train/test, or an image file that does not exist (line number and path given).
    """
    rows = []
    with open(path, encoding="utf-8", newline="") as fh:
        reader = csv.DictReader(fh)
        missing = {"image", "target", "center", "fold"} - set(reader.fieldnames or [])
        if missing:
            raise ValueError(f"{path}: missing column(s) {sorted(missing)}; expected FLamby's train_test_split "
                             f"(image,...,target,center,fold)")
        for row in reader:
            line = reader.line_num
            try:
                target, center = int(float(row["target"])), int(float(row["center"]))
            except ValueError as err:
                raise ValueError(f"{path}:{line}: target/center not integers: {row['target']!r}, {row['center']!r}") from err
            fold = row["fold"].strip()
            if not 0 <= target < len(CLASS_NAMES):
                raise ValueError(f"{path}:{line}: target {target} is not in 0..{len(CLASS_NAMES) - 1}")
            if center < 0 or fold not in ("train", "test"):
                raise ValueError(f"{path}:{line}: center {center} / fold {fold!r} (expected >= 0 / train|test)")
            image = images / f"{row['image'].strip()}.jpg"
            if not image.is_file():
                raise ValueError(f"{path}:{line}: image {image} does not exist")
            rows.append((fold == "test", row["image"].strip(), str(image), target, center))
    rows.sort()
    return [(p, t, c, test) for test, _, p, t, c in rows]


@DATASETS.register("fedisic")
def load(cfg: Any, data_dir: Path) -> ImageDataset:
    """Fed-ISIC2019 as (23247, 3, S, S) uint8 pixels, centre groups, FLamby's train/test split.

    Raises:
        DataNotFoundError: images folder or metadata CSV missing (message: layout, FLamby
            source, data directory setting).
        ValueError: malformed CSV or missing image (see :func:`read_split`).
    """
    data_dir = Path(data_dir)
    found = _root(data_dir)
    if found is None:
        raise not_found("fedisic", data_dir,
                        [f"fedisic/{IMAGES}/<image>.jpg and fedisic/train_test_split (FLamby metadata CSV: "
                         f"image,...,target,center,fold)", f"fed_isic2019/{IMAGES}/... and fed_isic2019/train_test_split"],
                        SOURCE)
    base, split = found
    rows = read_split(split, base / IMAGES)
    files = [r[0] for r in rows]
    centers = sorted({r[2] for r in rows})

    def build() -> dict[str, Any]:
        return {
            "inputs": decode_images(files, setting(cfg, "image_size"), int(setting(cfg, "channels", 3))),
            "targets": torch.tensor([r[1] for r in rows], dtype=torch.int64),
            "official_test": torch.tensor([r[3] for r in rows], dtype=torch.bool),
            "groups": torch.tensor([r[2] for r in rows], dtype=torch.int64),
            "group_names": [CENTER_NAMES[c] if c < len(CENTER_NAMES) else str(c) for c in range(max(centers) + 1)],
            "class_names": list(CLASS_NAMES),
        }

    return load_cached("fedisic", cfg, data_dir, [*files, split], build)
