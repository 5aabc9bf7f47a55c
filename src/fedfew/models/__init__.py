"""Model architectures, one module per model; the module name is the config value
(``model.name=textcnn`` -> ``textcnn.py``). Each registers a builder
``build(cfg, info: DataInfo) -> nn.Module`` with :data:`MODELS`.

Every model exposes ``body`` (the shared representation) and ``head`` (the final linear
classifier) with ``forward(x) == head(body(x))``, so that methods that split the network
(FedRep, ...) need no surgery.
"""
from __future__ import annotations

from dataclasses import dataclass

from fedfew.core.registry import Registry

MODELS = Registry("model", __name__)


@dataclass(frozen=True)
class DataInfo:
    """What a model needs to know about the data.

    Attributes:
        input_shape: shape of one sample, e.g. (64,) for digits, (3, 32, 32) for CIFAR-10;
            for text (L_max,).
        num_classes: number of output classes.
        vocab_size: vocabulary size for text models, else None.
    """

    input_shape: tuple[int, ...]
    num_classes: int
    vocab_size: int | None = None
