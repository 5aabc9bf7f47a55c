"""CIFAR-100 (Krizhevsky 2009): 60,000 32x32 colour images, 100 fine classes, 50,000 train +
10,000 test.

Same sources and rules as :mod:`fedfew.data.datasets.cifar10`: an ImageFolder tree
``<data_dir>/cifar100/{train,test}/<class>/*``, or torchvision's python version
``cifar-100-python/{train,test,meta}`` in ``<data_dir>/`` or ``<data_dir>/cifar100/``, or a
torchvision download, else :class:`~fedfew.data.base.DataNotFoundError`. Labels are the 100
fine labels (official order = alphabetical order of the class names).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from fedfew.data.datasets import DATASETS
from fedfew.data.datasets.cifar10 import CifarSpec, load_cifar
from fedfew.data.images import ImageDataset

CIFAR100 = CifarSpec(
    name="cifar100",
    num_classes=100,
    pickle_dir="cifar-100-python",
    train_files=("train",),
    test_files=("test",),
    meta_file="meta",
    label_key=b"fine_labels",
    names_key=b"fine_label_names",
    url="https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz",
    torchvision_class="CIFAR100",
)


@DATASETS.register("cifar100")
def load(cfg: Any, data_dir: Path) -> ImageDataset:
    """CIFAR-100 as (60000, 3, S, S) uint8 pixels, fine labels 0..99, official train rows first.

    Raises:
        DataNotFoundError: no accepted layout and no download.
        ValueError: a tree with the wrong number of class folders, an undecodable image.
    """
    return load_cifar(CIFAR100, cfg, data_dir)
