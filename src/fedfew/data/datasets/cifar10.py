"""CIFAR-10 (Krizhevsky 2009): 60,000 32x32 colour images, 10 classes, 50,000 train + 10,000 test.

Source order (the first that exists is used; all give labels in the official order, which is
also the alphabetical order of the class names):

1. an ImageFolder tree ``<data_dir>/cifar10/train/<class>/*`` + ``<data_dir>/cifar10/test/<class>/*``
   (any image format), or its JPEG tarballs ``<data_dir>/cifar10/cifar10_{train,test}_jpg.tar.gz``,
   unpacked once into the cache directory (``$FEDFEW_CACHE_DIR``);
2. torchvision's format, the python pickles ``cifar-10-batches-py/{data_batch_1..5,test_batch,
   batches.meta}`` in ``<data_dir>/`` or ``<data_dir>/cifar10/``;
3. a download with ``torchvision.datasets.CIFAR10(<data_dir>/cifar10, download=True)`` when
   ``dataset.download`` is true and the host answers within 3 s;
4. otherwise :class:`~fedfew.data.base.DataNotFoundError` (within a few seconds), naming the
   layouts, the source and the data directory setting.

Rows: official train first, then official test (``official_test`` marks them). Pixels are
cached as uint8 (see :mod:`fedfew.data.images`); the shared helpers here also serve CIFAR-100.
"""
from __future__ import annotations

import logging
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedfew.data.cache import TensorCache, files_identity
from fedfew.data.datasets import DATASETS
from fedfew.data.images import (
    ImageDataset,
    setting,
    convert_images,
    find_folder_layout,
    folder_entry,
    list_class_folders,
    load_cached,
    not_found,
    reachable,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CifarSpec:
    """What differs between CIFAR-10 and CIFAR-100."""

    name: str
    num_classes: int
    pickle_dir: str
    train_files: tuple[str, ...]
    test_files: tuple[str, ...]
    meta_file: str
    label_key: bytes
    names_key: bytes
    url: str
    torchvision_class: str


CIFAR10 = CifarSpec(
    name="cifar10",
    num_classes=10,
    pickle_dir="cifar-10-batches-py",
    train_files=tuple(f"data_batch_{i}" for i in range(1, 6)),
    test_files=("test_batch",),
    meta_file="batches.meta",
    label_key=b"labels",
    names_key=b"label_names",
    url="https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz",
    torchvision_class="CIFAR10",
)


def _unpickle(path: Path) -> dict:
    with open(path, "rb") as fh:
        return pickle.load(fh, encoding="bytes")


def read_pickles(root: Path, spec: CifarSpec, cfg: Any) -> dict[str, Any]:
    """The python-pickle release (torchvision's format) as a cache entry.

    Each batch file is a dict with ``b"data"`` (n, 3072) uint8 rows (R, G, B planes of 32x32,
    row-major) and ``spec.label_key`` labels; the meta file names the classes.
    """
    xs, ys, test = [], [], []
    for files, is_test in ((spec.train_files, False), (spec.test_files, True)):
        for f in files:
            batch = _unpickle(root / f)
            data = np.asarray(batch[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32)
            labels = np.asarray(batch[spec.label_key], dtype=np.int64)
            if len(data) != len(labels):
                raise ValueError(f"{root / f}: {len(data)} images but {len(labels)} labels")
            xs.append(data)
            ys.append(labels)
            test.append(np.full(len(labels), is_test))
    names = [n.decode() if isinstance(n, bytes) else str(n) for n in _unpickle(root / spec.meta_file)[spec.names_key]]
    inputs = convert_images(torch.from_numpy(np.concatenate(xs)), setting(cfg, "image_size"), int(setting(cfg, "channels", 3)))
    return {
        "inputs": inputs,
        "targets": torch.from_numpy(np.concatenate(ys)),
        "official_test": torch.from_numpy(np.concatenate(test)),
        "groups": None,
        "group_names": None,
        "class_names": names,
    }


def _pickle_root(data_dir: Path, spec: CifarSpec) -> Path | None:
    for root in (data_dir / spec.pickle_dir, data_dir / spec.name / spec.pickle_dir):
        if all((root / f).is_file() for f in (*spec.train_files, *spec.test_files, spec.meta_file)):
            return root
    return None


def _archives(base: Path, spec: CifarSpec) -> list[Path] | None:
    """``<base>/<name>_train_jpg.tar.gz`` and ``<name>_test_jpg.tar.gz`` when both exist (the JPEG
    tarballs of a shared data folder), else ``None``."""
    tars = [base / f"{spec.name}_{split}_jpg.tar.gz" for split in ("train", "test")]
    return tars if all(t.is_file() for t in tars) else None


def _unpacked(tars: list[Path], spec: CifarSpec, data_dir: Path) -> Path | None:
    """The ImageFolder tree of the JPEG tarballs, unpacked once into the cache directory
    (``$FEDFEW_CACHE_DIR/<name>_jpg/<identity of the tarballs>/{train,test}/<class>/``), so a
    read-only data folder needs no manual ``tar xzf``. ``None`` when caching is off (the caller
    then asks the user to unpack). Unpacked into a temporary folder first and renamed, so an
    interrupted unpack leaves nothing half-written; members outside the folder are refused
    (tarfile's ``data`` filter)."""
    import shutil
    import tarfile
    import tempfile

    cache = TensorCache(data_dir=data_dir)
    if not cache.enabled:
        return None
    target = cache.root / f"{spec.name}_jpg" / files_identity(tars)[:16]
    if find_folder_layout(target) is not None:  # unpacked before (the rename below is atomic): no lock needed
        return target
    # one run unpacks, concurrent ones (make compare JOBS=2) wait and then read its tree: without the
    # lock the last to finish replaced the tree another was already reading
    with cache.lock(f"{spec.name}_jpg-{target.name}"):
        if find_folder_layout(target) is None:
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=".unpacking-", dir=target.parent))
            try:
                log.info("%s: unpacking %s into %s (once)", spec.name, ", ".join(t.name for t in tars), target)
                for tar_path in tars:
                    with tarfile.open(tar_path, mode="r:*") as tar:
                        tar.extractall(tmp, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
                shutil.rmtree(target, ignore_errors=True)  # an incomplete tree left by an older version
                tmp.rename(target)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return target


def load_cifar(spec: CifarSpec, cfg: Any, data_dir: Path) -> ImageDataset:
    """CIFAR-10/100 from an ImageFolder tree (or its JPEG tarballs), the pickles, or a download
    (see module doc)."""
    data_dir = Path(data_dir)
    base = data_dir / spec.name
    layout = find_folder_layout(base)
    tars = _archives(base, spec) if layout is None else None
    if tars is not None:
        unpacked = _unpacked(tars, spec, data_dir)
        layout = None if unpacked is None else find_folder_layout(unpacked)
    if layout is not None:
        classes = list_class_folders(layout[0][0])
        if len(classes) != spec.num_classes:
            raise ValueError(f"{spec.name}: {layout[0][0]} has {len(classes)} class folders, expected "
                             f"{spec.num_classes} ({', '.join(classes[:12])}{', ...' if len(classes) > 12 else ''})")
        files, build = folder_entry(layout, cfg, classes)
        return load_cached(spec.name, cfg, data_dir, files, build, {"layout": "imagefolder"})
    root = _pickle_root(data_dir, spec)
    if root is None and bool(setting(cfg, "download", True)):
        root = _download(spec, data_dir)
    if root is None:
        raise _missing(spec, data_dir, "No download was attempted (dataset.download=false).")
    files = [root / f for f in (*spec.train_files, *spec.test_files, spec.meta_file)]
    return load_cached(spec.name, cfg, data_dir, files, lambda: read_pickles(root, spec, cfg), {"layout": "pickle"})


def _missing(spec: CifarSpec, data_dir: Path, detail: str) -> Exception:
    base = data_dir / spec.name
    archives = sorted(p.name for p in base.iterdir() if p.name.endswith((".tar.gz", ".tgz", ".tar", ".zip"))) \
        if base.is_dir() else []
    if archives:
        detail = (f"{base} holds archive(s) {', '.join(archives)}: unpack them (e.g. `tar xzf <archive> -C "
                  f"<dir>/{spec.name}`) into a data directory, so that {spec.name}/train/<class>/ exists. " + detail)
    return not_found(
        spec.name, data_dir,
        [f"{spec.name}/train/<class>/*.jpg and {spec.name}/test/<class>/*.jpg (ImageFolder tree, any image format)",
         f"{spec.pickle_dir}/ or {spec.name}/{spec.pickle_dir}/ (torchvision's python version: "
         f"{', '.join((*spec.train_files, *spec.test_files, spec.meta_file))})"],
        f"{spec.url} (unpack it into the data directory), or let torchvision download it "
        f"(dataset.download=true, needs network access)",
        detail,
    )


def _download(spec: CifarSpec, data_dir: Path) -> Path | None:
    """torchvision download into ``<data_dir>/<name>/``; ``None`` when offline (checked in
    about 3 s instead of waiting for a download timeout)."""
    if not reachable(spec.url):
        raise _missing(spec, data_dir, f"A download from {spec.url} was not attempted: the host did not answer "
                                       f"within 3 s (offline?) or FEDFEW_OFFLINE=1 is set; dataset.download=false skips this check.")
    import torchvision

    target = data_dir / spec.name
    log.info("%s: downloading %s into %s", spec.name, spec.url, target)
    try:
        target.mkdir(parents=True, exist_ok=True)
        getattr(torchvision.datasets, spec.torchvision_class)(str(target), train=True, download=True)
    except Exception as err:  # noqa: BLE001 - a failed download is a missing dataset
        raise _missing(spec, data_dir, f"The download into {target} failed: {type(err).__name__}: {err}") from err
    return _pickle_root(data_dir, spec)


@DATASETS.register("cifar10")
def load(cfg: Any, data_dir: Path) -> ImageDataset:
    """CIFAR-10 as (60000, 3, S, S) uint8 pixels (S = ``image_size``, default 32), labels
    0..9 (airplane, automobile, bird, cat, deer, dog, frog, horse, ship, truck), official
    train rows first.

    Raises:
        DataNotFoundError: no accepted layout and no download (message: layouts, source, setting).
        ValueError: a tree with the wrong number of class folders, an undecodable image.
    """
    return load_cifar(CIFAR10, cfg, data_dir)
