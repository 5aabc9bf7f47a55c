"""scikit-learn's ``load_digits`` (1,797 8x8 handwritten digits, 10 classes), shipped inside
scikit-learn: the embedded default dataset that needs no download and no data directory."""
from __future__ import annotations

from pathlib import Path

import torch

from fedfew.data.base import PooledDataset
from fedfew.data.datasets import DATASETS


def find_files(cfg, data_dir: Path) -> list[Path]:
    """No files: the data ships with scikit-learn (so ``python -m fedfew.check`` asks for none)."""
    return []


@DATASETS.register("digits")
def load(cfg, data_dir: Path) -> PooledDataset:
    """All 1,797 digits as (N, 64) float32 in [0, 1] (pixel / 16, row-major 8x8 images) with
    int64 labels 0..9.

    ``data_dir`` is unused (the data ships with scikit-learn).
    """
    from sklearn.datasets import load_digits

    bunch = load_digits()
    inputs = torch.as_tensor(bunch.data, dtype=torch.float32) / 16.0
    return PooledDataset(
        inputs=inputs,
        targets=torch.as_tensor(bunch.target, dtype=torch.int64),
        num_classes=10,
        class_names=[str(c) for c in range(10)],
        name="digits",
        image_shape=(8, 8),
    )
