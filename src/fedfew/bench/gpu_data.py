"""The GPU check's CIFAR-10: the tarballs unpacked into the ImageFolder tree the loader reads, and the
data process (``--gpu-check-data``) that unpacks and decodes them while the first sections run."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from fedfew.bench.common import _log
from fedfew.bench.gpu_sizes import CHECK_SIZES, PAPER_OVERRIDES, _emit, _set_threads, resolve_device
from fedfew.config.compose import compose


def unpack_cifar(src: Path, dest: Path, per_class: tuple[int, int] | None) -> dict:
    """CIFAR-10 as the ImageFolder tree ``dest/{train,test}/<class>/*.jpg`` that the loader reads.

    Args:
        src: a folder holding ``cifar10_train_jpg.tar.gz`` and ``cifar10_test_jpg.tar.gz``
            (the shared data's layout), or an unpacked ``train/`` + ``test/`` tree.
        dest: the ``cifar10`` folder of a fresh data directory.
        per_class: None: everything. (a, b): a small subset for the smoke mode, read from the
            official test images alone (the small tarball; the train tarball, grouped by class,
            would have to be read whole): per class, the first ``a`` become ``train/``, the
            next ``b`` ``test/``.
    Returns:
        {"train": n, "test": n} images written.
    Raises:
        FileNotFoundError: neither layout in ``src``.
    """
    import shutil
    import tarfile

    counts = {"train": 0, "test": 0}
    seen: dict[str, int] = {}

    def target(split: str, cls: str) -> str | None:
        """Where a ``split``/``cls`` image goes (train/test), or None to skip it."""
        if per_class is None:
            return split if split in ("train", "test") else None
        if split != "test":
            return None
        n = seen.get(cls, 0)
        seen[cls] = n + 1
        return "train" if n < per_class[0] else "test" if n < per_class[0] + per_class[1] else None

    tars = {split: src / f"cifar10_{split}_jpg.tar.gz" for split in ("train", "test")}
    if all(t.is_file() for t in tars.values()):
        dest.mkdir(parents=True, exist_ok=True)
        kwargs = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        for split in (("test",) if per_class else ("train", "test")):
            with tarfile.open(tars[split], mode="r|gz") as tar:  # one sequential pass
                for member in tar:
                    parts = member.name.split("/")
                    where = target(parts[-3], parts[-2]) if member.isfile() and len(parts) >= 3 else None
                    if where is None:
                        continue
                    member.name = f"{where}/{parts[-2]}/{parts[-1]}"
                    tar.extract(member, dest, **kwargs)
                    counts[where] += 1
        return counts
    if (src / "train").is_dir() and (src / "test").is_dir():
        for split in (("test",) if per_class else ("train", "test")):
            for folder in sorted(p for p in (src / split).iterdir() if p.is_dir()):
                for f in sorted(folder.iterdir()):
                    where = target(split, folder.name) if f.is_file() else None
                    if where is not None:
                        out = dest / where / folder.name / f.name
                        out.parent.mkdir(parents=True, exist_ok=True)
                        shutil.copyfile(f, out)
                        counts[where] += 1
        return counts
    raise FileNotFoundError(f"{src}: neither cifar10_train_jpg.tar.gz + cifar10_test_jpg.tar.gz nor train/ + test/ "
                            "folders; run `make gpu-data` or pass --cifar-dir <folder with the tarballs>")


def _cifar_overrides(data_dir: Path, M: int) -> list[str]:
    return ["dataset=cifar10", f"data_dir={data_dir}", "dataset.download=false", f"num_clients={M}", *PAPER_OVERRIDES]


def gpu_check_data(spec: dict) -> int:
    """The data process: unpack ``spec["cifar_dir"]`` into ``<work>/data/cifar10`` (all of it
    on a GPU, the smoke mode's subset on the CPU), decode it once into the tensor cache
    ($FEDFEW_CACHE_DIR, set by the driver), then write ``<work>/data_status.json`` (``ok``,
    counts, seconds, or ``error``) for the runner."""
    from fedfew.core.io import atomic_write_json

    work = Path(spec["work"])
    start = time.perf_counter()
    sizes = CHECK_SIZES[resolve_device(spec["device"])]
    _set_threads(sizes)
    status: dict[str, Any] = {"source": spec["cifar_dir"], "per_class": sizes.cifar_per_class}
    try:
        counts = unpack_cifar(Path(spec["cifar_dir"]), work / "data" / "cifar10", sizes.cifar_per_class)
        status["unpack_s"] = time.perf_counter() - start
        _log(f"data: unpacked {counts['train']:,} train + {counts['test']:,} test images in {status['unpack_s']:.1f} s")
        from fedfew.data.federated import build_federated_data

        decode = time.perf_counter()
        data = build_federated_data(compose(_cifar_overrides(work / "data", sizes.paper_M)))
        status.update(ok=True, images=int(len(data.targets)), decode_s=time.perf_counter() - decode, **counts)
        _log(f"data: decoded {status['images']:,} images in {status['decode_s']:.1f} s")
    except Exception as err:  # noqa: BLE001 - reported; the sections fall back to synthetic data
        status.update(ok=False, error=f"{type(err).__name__}: {err}")
    status["seconds"] = time.perf_counter() - start
    atomic_write_json(work / "data_status.json", status)
    _emit("data", "done" if status["ok"] else "error", result=status)
    return 0 if status["ok"] else 1
