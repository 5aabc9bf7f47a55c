"""Kvasir v2 (Pogorelov et al., MMSys 2017): 8,000 endoscopic images of the GI tract, 8 classes
of 1,000 (dyed-lifted-polyps, dyed-resection-margins, esophagitis, normal-cecum,
normal-pylorus, normal-z-line, polyps, ulcerative-colitis), JPEGs of 720x576 up to 1920x1072.

Manual download (licence acceptance on the site): ``kvasir-dataset-v2.zip`` from
https://datasets.simula.no/kvasir/ , unzipped. Accepted layouts (ImageFolder), the first found:
``<data_dir>/kvasir/kvasir-dataset-v2/<class>/*.jpg``, ``<data_dir>/kvasir-dataset-v2/<class>/*.jpg``,
``<data_dir>/kvasir/<class>/*.jpg``; each may instead hold ``train/<class>/*`` + ``test/<class>/*``
(then kept as the official split). Labels: sorted class folder names. The release has no
official test split: the partition's ``test_fraction`` holds out each client's test samples.

Images are resized (shorter side to ``image_size``, default 64, then centre crop) while
decoding, using libjpeg's DCT scaling for the large JPEGs.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from fedfew.data.datasets import DATASETS
from fedfew.data.images import ImageDataset, find_folder_layout, folder_entry, load_cached, not_found

URL = "https://datasets.simula.no/kvasir/ (kvasir-dataset-v2.zip, manual download)"
CANDIDATES = ("kvasir/kvasir-dataset-v2", "kvasir-dataset-v2", "kvasir")


@DATASETS.register("kvasir")
def load(cfg: Any, data_dir: Path) -> ImageDataset:
    """Kvasir as (N, 3, S, S) uint8 pixels, labels = sorted class folder names (8 in v2).

    Raises:
        DataNotFoundError: no accepted layout (message: layouts, source, data directory setting).
        ValueError: an undecodable image; a test class folder unknown to train.
    """
    data_dir = Path(data_dir)
    for rel in CANDIDATES:
        layout = find_folder_layout(data_dir / rel)
        if layout is not None:
            files, build = folder_entry(layout, cfg)
            return load_cached("kvasir", cfg, data_dir, files, build)
    raise not_found("kvasir", data_dir, [f"{rel}/<class>/*.jpg (or {rel}/train/<class>/* + {rel}/test/<class>/*)"
                                         for rel in CANDIDATES], URL)
