"""Multi-layer perceptron for flat features (the embedded ``digits`` default)."""
from __future__ import annotations

import math

from torch import nn

from fedfew.models import MODELS, DataInfo
from fedfew.models.base import BodyHead


@MODELS.register("mlp")
def build(cfg, info: DataInfo) -> BodyHead:
    """MLP: flatten -> [Linear(hidden) -> ReLU] * len(hidden) -> Linear(num_classes).

    Args:
        cfg: model config with ``hidden`` (list of layer widths, default [128]).
        info: input shape (flattened) and number of classes.
    Returns:
        a :class:`BodyHead`; input (B, *input_shape) float32, output (B, num_classes).
    """
    widths = [math.prod(info.input_shape), *list(cfg.get("hidden", [128]))]
    layers: list[nn.Module] = [nn.Flatten()]
    for a, b in zip(widths[:-1], widths[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return BodyHead(nn.Sequential(*layers), nn.Linear(widths[-1], info.num_classes))
