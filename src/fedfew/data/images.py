"""Shared machinery of the image datasets: find, decode, resize, cache, normalise.

Every image loader (``cifar10``, ``cifar100``, ``tinyimagenet``, ``femnist``, ``kvasir``,
``fedisic``, ``imagefolder``) returns an :class:`ImageDataset`: a
:class:`~fedfew.data.base.PooledDataset` whose ``inputs`` are **uint8** (N, C, S, S) pixels,
plus the per-channel ``mean``/``std`` that :func:`normalize` applies to give the float32
model inputs. The float32 tensor is made once per run by :mod:`fedfew.data.federated` (or per
batch when the dataset does not fit in memory); the uint8 tensor is what the on-disk cache
(:mod:`fedfew.data.cache`) stores, 4x smaller than float32.

Preprocessing keys of a dataset config (all part of the cache key except mean/std):

``image_size``
    side S of the square images. ``null`` keeps the native size (every image must then have
    the same size; it may be non-square). Otherwise every image whose size is not S x S is resized so that its
    shorter side is S (bilinear, antialiased) and centre-cropped to S x S.
``channels``
    3 (RGB) or 1 (grayscale); images are converted on decoding.
``mean``, ``std``
    per-channel normalisation ``(x / 255 - mean) / std`` (a single number applies to every
    channel). Not part of the cache key: they are applied when the cache is read.
``cache``
    false skips the on-disk cache (default true).

Decoding uses ``torchvision.io.decode_image`` on the raw file bytes (libjpeg-turbo / libpng;
~30 us per 32x32 JPEG, CIFAR-10's 60,000 images in ~2 s on one core), with PIL as the
fallback for formats torchvision does not read.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import torch

from fedfew.data.base import DataNotFoundError, PooledDataset
from fedfew.data.cache import TensorCache, cache_key, files_identity

__all__ = [
    "IMAGE_EXTENSIONS",
    "setting",
    "ImageDataset",
    "decode_images",
    "image_dataset",
    "list_class_folders",
    "load_cached",
    "normalize",
    "not_found",
    "reachable",
    "read_image_folder",
]

log = logging.getLogger(__name__)

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm")
"""File suffixes (any case) taken as images in class folders."""
LOADER_VERSION = 1
"""Bumped when decoding/resizing changes the cached pixels (part of every cache key)."""
DATA_SETTING = "`data_dir=...` or the FEDFEW_DATA_DIR environment variable"


# --------------------------------------------------------------------------- the container
@dataclass
class ImageDataset(PooledDataset):
    """A :class:`PooledDataset` of images kept as uint8 pixels.

    Attributes (beyond :class:`PooledDataset`'s):
        inputs: (N, C, H, W) uint8 pixels, H = W = ``image_size`` when set (not normalised;
            see :meth:`normalized`).
        mean, std: per-channel normalisation, length C.
        group_names: name of each natural group id (writer, centre), when ``groups`` is set.
        cache_hit: whether the pixels came from the on-disk cache.
    """

    mean: tuple[float, ...] = (0.5,)
    std: tuple[float, ...] = (0.5,)
    group_names: list[str] | None = None
    cache_hit: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.inputs is None or self.inputs.dtype != torch.uint8 or self.inputs.dim() != 4:
            raise ValueError("ImageDataset needs uint8 inputs of shape (N, C, H, W)")
        c = self.inputs.shape[1]
        self.mean, self.std = _per_channel(self.mean, c, "mean"), _per_channel(self.std, c, "std")

    def normalized(self, index: torch.Tensor | None = None) -> torch.Tensor:
        """float32 ``(x / 255 - mean) / std`` of all samples (or of ``index``)."""
        x = self.inputs if index is None else self.inputs[index]
        return normalize(x, self.mean, self.std)


def _per_channel(value: Any, channels: int, what: str) -> tuple[float, ...]:
    many = isinstance(value, Sequence) and not isinstance(value, str)
    vals = [float(v) for v in (value if many else [value])]
    if len(vals) == 1:
        vals = vals * channels
    if len(vals) != channels:
        raise ValueError(f"dataset.{what} has {len(vals)} values but the images have {channels} channel(s)")
    if what == "std" and any(v <= 0 for v in vals):
        raise ValueError(f"dataset.std must be > 0, got {vals}")
    return tuple(vals)


def normalize(x: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """(B, C, H, W) uint8 -> float32 ``(x / 255 - mean) / std`` (on ``x``'s device).

    Computed in place on the float copy as ``x * (1 / (255 std)) - mean / std`` (one
    allocation; CIFAR-10's 60,000 images in well under a second).
    """
    c = x.shape[1]
    scale = torch.tensor([1.0 / (255.0 * s) for s in std], dtype=torch.float32, device=x.device).view(1, c, 1, 1)
    shift = torch.tensor([m / s for m, s in zip(mean, std)], dtype=torch.float32, device=x.device).view(1, c, 1, 1)
    return x.to(torch.float32).mul_(scale).sub_(shift)


# --------------------------------------------------------------------------- errors / network
def not_found(dataset: str, data_dir: Path, layouts: Sequence[str], source: str, detail: str = "") -> DataNotFoundError:
    """The standard "files missing" error: what was looked for, where to get it, what to set.

    Args:
        dataset: config value (``cifar10``...).
        layouts: the accepted layouts, each a path pattern under ``data_dir``.
        source: where to download the files (URL and what to take from there).
        detail: an extra sentence (why the download was not attempted, ...).
    """
    lines = "\n".join(f"  - {layout if layout.startswith('/') else f'{data_dir}/{layout}'}" for layout in layouts)
    return DataNotFoundError(
        f"{dataset}: dataset files not found under the data directory {data_dir}. Expected one of:\n"
        f"{lines}\n{detail + chr(10) if detail else ''}"
        f"Get them from {source}, then point the data directory at the folder holding them: "
        f"{DATA_SETTING}."
    )


def reachable(url: str, timeout: float = 3.0) -> bool:
    """Whether ``url``'s host (or the HTTPS proxy in front of it) accepts a TCP connection
    within ``timeout`` seconds; name resolution runs in a daemon thread so a hanging DNS does
    not block. ``FEDFEW_OFFLINE=1`` answers False at once."""
    if os.environ.get("FEDFEW_OFFLINE", "").strip().lower() in {"1", "true", "yes", "on"}:
        return False
    proxy = os.environ.get("HTTPS_PROXY") or os.environ.get("https_proxy")
    target = urlsplit(proxy or url)
    if not target.hostname:
        return False
    port = target.port or (443 if target.scheme == "https" else 80)
    result: list[bool] = []

    def probe() -> None:
        try:
            with socket.create_connection((target.hostname, port), timeout=timeout):
                result.append(True)
        except OSError:
            result.append(False)

    thread = threading.Thread(target=probe, name="fedfew-download-probe", daemon=True)
    thread.start()
    thread.join(timeout)
    return bool(result and result[0])


# --------------------------------------------------------------------------- finding files
def _is_image(name: str) -> bool:
    return name.lower().endswith(IMAGE_EXTENSIONS) and not name.startswith(".")


def list_class_folders(root: Path) -> list[str]:
    """Sorted names of the sub-folders of ``root`` that hold at least one image (recursively)."""
    if not root.is_dir():
        return []
    names = []
    for d in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        if any(_is_image(f) for _, _, fs in os.walk(d) for f in fs):
            names.append(d.name)
    return names


def read_image_folder(root: Path, classes: Sequence[str]) -> tuple[list[str], list[int]]:
    """Image files of ``root/<class>/**`` in a fixed order: classes in the given order, files
    sorted by relative path inside each class (sub-folders included).

    Args:
        root: folder holding one sub-folder per class.
        classes: class folder names; label = position in this list. Folders of ``root`` not in
            ``classes`` are an error (they would silently lose samples).
    Returns:
        ``(files, labels)``.
    Raises:
        ValueError: a class folder of ``root`` is not in ``classes``.
    """
    present = list_class_folders(root)
    unknown = sorted(set(present) - set(classes))
    if unknown:
        raise ValueError(f"{root}: class folders {unknown} are not among the training classes "
                         f"({len(classes)} classes from the train split)")
    files: list[str] = []
    labels: list[int] = []
    for label, name in enumerate(classes):
        d = root / name
        if not d.is_dir():
            continue
        found = []
        for dirpath, dirnames, filenames in os.walk(d):
            dirnames.sort()
            found += [os.path.join(dirpath, f) for f in filenames if _is_image(f)]
        found.sort()
        files += found
        labels += [label] * len(found)
    return files, labels


# --------------------------------------------------------------------------- decoding
def _pil_decode(data: bytes, channels: int, path: str, min_side: int | None = None) -> torch.Tensor:
    """(C, H, W) uint8 with PIL; for a JPEG at least twice ``min_side`` on its shorter side,
    libjpeg's DCT scaling (``Image.draft``) decodes at 1/2, 1/4 or 1/8 size, never below
    ``min_side`` (a large speed-up for big photos resized to small inputs)."""
    import io

    from PIL import Image

    mode = "RGB" if channels == 3 else "L"
    try:
        with Image.open(io.BytesIO(data)) as img:
            if min_side is not None and img.format == "JPEG":
                img.draft(mode, (min_side, min_side))
            arr = np.asarray(img.convert(mode))
    except Exception as err:  # noqa: BLE001 - any decoder failure names the file
        raise ValueError(f"cannot decode image {path}: {type(err).__name__}: {err}") from err
    arr = arr[:, :, None] if arr.ndim == 2 else arr
    return torch.from_numpy(arr.copy()).permute(2, 0, 1).contiguous()


def _jpeg_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) from a JPEG's start-of-frame header (a few segment hops, no decoding);
    ``None`` for other formats or an unreadable header."""
    if data[:2] != b"\xff\xd8":
        return None
    i, n = 2, len(data)
    while i + 9 < n:
        if data[i] != 0xFF:
            return None
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
            return int.from_bytes(data[i + 7 : i + 9], "big"), int.from_bytes(data[i + 5 : i + 7], "big")
        if marker in (0xD8, 0x01) or 0xD0 <= marker <= 0xD7:  # markers without a length
            i += 2
            continue
        i += 2 + int.from_bytes(data[i + 2 : i + 4], "big")
    return None


def _decode_one(data: bytes, channels: int, path: str, image_size: int | None = None) -> torch.Tensor:
    """(C, H, W) uint8 from encoded bytes: torchvision (libjpeg-turbo/libpng) first; PIL for
    formats torchvision does not read and for JPEGs much larger than ``image_size``."""
    if image_size is not None:
        size = _jpeg_size(data)
        if size is not None and min(size) >= 2 * image_size:
            return _pil_decode(data, channels, path, image_size)
    from torchvision.io import ImageReadMode, decode_image

    mode = ImageReadMode.RGB if channels == 3 else ImageReadMode.GRAY
    try:
        return decode_image(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=mode)
    except (RuntimeError, ValueError):
        return _pil_decode(data, channels, path)


def resize_square(img: torch.Tensor, size: int) -> torch.Tensor:
    """(C, H, W) uint8 -> (C, size, size): shorter side to ``size`` (bilinear, antialiased),
    then a centre crop. Unchanged when already ``size`` x ``size``."""
    if img.shape[1] == size and img.shape[2] == size:
        return img
    from torchvision.transforms.v2 import functional as TF

    img = TF.resize(img, [size], antialias=True)
    return TF.center_crop(img, [size, size])


def decode_images(files: Sequence[str], image_size: int | None, channels: int = 3) -> torch.Tensor:
    """Decode, convert and (if needed) resize image files into one uint8 tensor.

    Args:
        files: N image paths.
        image_size: side S of the output; ``None`` keeps the native size, which every image
            must then share.
        channels: 3 (RGB) or 1 (grayscale).
    Returns:
        (N, C, S, S) uint8 ((N, C, H, W), the common native size, with ``image_size=None``).
    Raises:
        ValueError: an undecodable file, or different native sizes with ``image_size=None``
            (the message names both files and asks for ``dataset.image_size``).
    """
    if channels not in (1, 3):
        raise ValueError(f"dataset.channels must be 1 or 3, got {channels}")
    n = len(files)
    start = time.perf_counter()
    out: torch.Tensor | None = None
    first = ""
    for i, path in enumerate(files):
        with open(path, "rb") as fh:
            img = _decode_one(fh.read(), channels, path, None if image_size is None else int(image_size))
        if image_size is not None:
            img = resize_square(img, int(image_size))
        if out is None:
            first = path
            out = torch.empty((n, *img.shape), dtype=torch.uint8)
        elif img.shape != out.shape[1:]:
            raise ValueError(
                f"images differ in size: {first} is {out.shape[3]}x{out.shape[2]} but {path} is "
                f"{img.shape[2]}x{img.shape[1]}; set dataset.image_size=<side> to resize and centre-crop them"
            )
        out[i] = img
    if out is None:
        raise ValueError("no image to decode")
    log.info("decoded %d images in %.1f s", n, time.perf_counter() - start)
    return out


# --------------------------------------------------------------------------- caching
def setting(cfg: Any, key: str, default: Any = None) -> Any:
    """``cfg[key]`` of a dataset config (DictConfig, dict or object), ``default`` when absent or null."""
    if cfg is None:
        return default
    value = cfg.get(key, default) if hasattr(cfg, "get") else getattr(cfg, key, default)
    return default if value is None else value


def load_cached(
    name: str,
    cfg: Any,
    data_dir: Path,
    sources: Sequence[str | Path],
    build: Callable[[], dict[str, Any]],
    extra_key: dict[str, Any] | None = None,
    default_channels: int = 3,
) -> ImageDataset:
    """The dataset from the on-disk cache, or ``build()`` then cached.

    Args:
        name: dataset name (cache file prefix and key part).
        cfg: dataset config: ``image_size``, ``channels`` (key parts), ``mean``, ``std``,
            ``cache`` (false: no cache).
        sources: every file ``build`` reads (path, size and mtime enter the key).
        build: returns ``{"inputs": (N,C,S,S) uint8, "targets": (N,) int64, "class_names":
            [...], "official_test": (N,) bool | None, "groups": (N,) int64 | None,
            "group_names": [...] | None}``.
        extra_key: loader-specific settings that change the tensors.
        default_channels: the channel count ``build`` uses when ``cfg`` has none.
    Returns:
        :class:`ImageDataset` with ``cache_hit`` set.
    """
    start = time.perf_counter()
    use = bool(setting(cfg, "cache", True))
    cache = TensorCache(data_dir=data_dir) if use else TensorCache(None, use_default=False)
    if cache.enabled:
        preprocessing = {"image_size": setting(cfg, "image_size"),
                         "channels": int(setting(cfg, "channels", default_channels)),
                         "loader": LOADER_VERSION, **(extra_key or {})}
        key = cache_key(name, files_identity(sources), preprocessing)
        entry, hit = cache.get(name, key, build)
    else:
        entry, hit = build(), False
    ds = image_dataset(name, entry, cfg, hit)
    log.info("%s: %d images %s ready in %.1f s (%s)", name, len(ds), tuple(ds.inputs.shape[1:]),
             time.perf_counter() - start, "cache hit" if hit else ("decoded, cached" if cache.enabled else "decoded"))
    return ds


def image_dataset(name: str, entry: dict[str, Any], cfg: Any, cache_hit: bool = False) -> ImageDataset:
    """:class:`ImageDataset` from a built/cached entry and the normalisation of ``cfg``."""
    return ImageDataset(
        inputs=entry["inputs"],
        targets=entry["targets"].long(),
        num_classes=len(entry["class_names"]),
        official_test=entry.get("official_test"),
        groups=entry.get("groups"),
        class_names=list(entry["class_names"]),
        name=name,
        mean=setting(cfg, "mean", 0.5),
        std=setting(cfg, "std", 0.5),
        group_names=None if entry.get("group_names") is None else list(entry["group_names"]),
        cache_hit=cache_hit,
    )


def folder_entry(
    splits: Sequence[tuple[Path, bool]], cfg: Any, classes: Sequence[str] | None = None
) -> tuple[list[str], Callable[[], dict[str, Any]]]:
    """Files and build function for ImageFolder trees.

    Args:
        splits: ``(root, is_official_test)`` pairs, each ``root/<class>/**`` (train first).
        classes: class folder names; default: the folders of the first split.
    Returns:
        ``(files, build)`` for :func:`load_cached`; the class list is the first split's, and a
        later split with an unknown class folder is an error.
    """
    classes = list(classes) if classes is not None else list_class_folders(splits[0][0])
    files: list[str] = []
    labels: list[int] = []
    is_test: list[bool] = []
    for root, test in splits:
        f, y = read_image_folder(root, classes)
        files += f
        labels += y
        is_test += [test] * len(f)
    has_test = any(test for _, test in splits)

    def build() -> dict[str, Any]:
        return {
            "inputs": decode_images(files, setting(cfg, "image_size"), int(setting(cfg, "channels", 3))),
            "targets": torch.tensor(labels, dtype=torch.int64),
            "official_test": torch.tensor(is_test, dtype=torch.bool) if has_test else None,
            "groups": None,
            "group_names": None,
            "class_names": list(classes),
        }

    return files, build


def find_folder_layout(base: Path) -> list[tuple[Path, bool]] | None:
    """The ImageFolder splits under ``base``.

    Returns:
        ``[(base/train, False), (base/test, True)]`` when ``train/`` holds class folders and
        ``test/`` (or ``val/``) does too; ``[(base/train, False)]`` with ``train/`` alone;
        ``[(base, False)]`` when ``base`` itself holds the class folders; else ``None``.
    """
    if not base.is_dir():
        return None
    train = base / "train"
    if list_class_folders(train):
        for test_name in ("test", "val"):
            if list_class_folders(base / test_name):
                return [(train, False), (base / test_name, True)]
        return [(train, False)]
    if list_class_folders(base):
        return [(base, False)]
    return None


def convert_images(x: torch.Tensor, image_size: int | None, channels: int, chunk: int = 4096) -> torch.Tensor:
    """Bring already decoded (N, C0, H, W) uint8 images to ``channels`` and ``image_size``
    (same rules as :func:`decode_images`: ITU-R 601 luma for RGB -> gray, gray repeated
    for gray -> RGB, shorter side resize + centre crop), in chunks to bound memory."""
    if channels not in (1, 3):
        raise ValueError(f"dataset.channels must be 1 or 3, got {channels}")
    from torchvision.transforms.v2 import functional as TF

    if x.shape[1] != channels:
        if channels == 1:
            x = torch.cat([TF.rgb_to_grayscale(x[i : i + chunk]) for i in range(0, len(x), chunk)])
        else:
            x = x.expand(-1, 3, -1, -1).contiguous()
    if image_size is None or (x.shape[2] == image_size and x.shape[3] == image_size):
        return x
    s = int(image_size)
    parts = [TF.center_crop(TF.resize(x[i : i + chunk], [s], antialias=True), [s, s]) for i in range(0, len(x), chunk)]
    return torch.cat(parts)
