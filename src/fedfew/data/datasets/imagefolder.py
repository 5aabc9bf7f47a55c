"""Any user tree of class folders ("bring your own data"), like torchvision's ``ImageFolder``.

Set ``dataset.root`` to the tree, absolute or relative to the data directory. Layouts:

* ``<root>/train/<class>/**`` and ``<root>/test/<class>/**`` (``val/`` accepted for ``test/``):
  the official split is kept as ``official_test`` (with ``partition.keep_official_test=true``
  a client's train samples come only from ``train/`` and its test samples only from
  ``test/``; otherwise both are pooled before partitioning);
* ``<root>/train/<class>/**`` alone, or ``<root>/<class>/**``: no official split.

Labels are the positions of the class folder names in sorted order (the ``train/`` folders
when split); files are read in sorted order (sub-folders included), any format torchvision
or PIL decodes (jpg, png, bmp, gif, webp, tiff, ppm/pgm). ``image_size`` null keeps the native
size (all images must match), else shorter side resize + centre crop; ``channels`` 3 or 1.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from fedfew.data.datasets import DATASETS
from fedfew.data.images import ImageDataset, setting, find_folder_layout, folder_entry, load_cached, not_found


@DATASETS.register("imagefolder")
def load(cfg: Any, data_dir: Path) -> ImageDataset:
    """The tree at ``dataset.root`` as (N, C, S, S) uint8 pixels.

    Raises:
        DataNotFoundError: ``dataset.root`` unset, missing, or without class folders.
        ValueError: undecodable image, images of different sizes with ``image_size: null``, a
            test class folder that train lacks.
    """
    data_dir = Path(data_dir)
    raw = setting(cfg, "root")
    layouts = ["<root>/<class>/*.jpg|png|...", "<root>/train/<class>/* and <root>/test/<class>/*"]
    if not raw:
        raise not_found("imagefolder", data_dir, layouts, "your own images",
                        "Set dataset.root=<folder> (absolute, or relative to the data directory).")
    root = Path(str(raw)).expanduser()
    root = root if root.is_absolute() else data_dir / root
    layout = find_folder_layout(root)
    if layout is None:
        raise not_found("imagefolder", data_dir, [x.replace("<root>", str(root)) for x in layouts], "your own images",
                        f"dataset.root={raw} resolves to {root}, which "
                        f"{'holds no class folder with images' if root.is_dir() else 'does not exist'}.")
    files, build = folder_entry(layout, cfg)
    return load_cached("imagefolder", cfg, data_dir, files, build, {"root": str(root.resolve())})
