"""Multi-layer perceptron for flat features (the embedded ``digits`` default)."""
from __future__ import annotations

import math

from torch import nn

from fedfew.models import MODELS, DataInfo
from fedfew.models.base import BodyHead, norm_setting


@MODELS.register("mlp")
def build(cfg, info: DataInfo) -> BodyHead:
    """MLP: flatten -> [Linear(hidden) -> (BatchNorm1d) -> ReLU] * len(hidden) -> Linear(num_classes).

    Args:
        cfg: model config with ``hidden`` (list of layer widths, default [128]) and ``norm``
            (``none``, default | ``batch``: a BatchNorm1d after each hidden Linear, so the
            BatchNorm policy of docs/models.md can be tried cheaply on digits).
        info: input shape (flattened) and number of classes.
    Returns:
        a :class:`BodyHead`; input (B, *input_shape) float32, output (B, num_classes).
    Raises:
        ValueError: an unknown ``norm``.
    """
    batch_norm = norm_setting(cfg, "mlp") == "batch"
    widths = [math.prod(info.input_shape), *list(cfg.get("hidden", [128]))]
    layers: list[nn.Module] = [nn.Flatten()]
    for a, b in zip(widths[:-1], widths[1:]):
        layers += [nn.Linear(a, b), *([nn.BatchNorm1d(b)] if batch_norm else []), nn.ReLU()]
    return BodyHead(nn.Sequential(*layers), nn.Linear(widths[-1], info.num_classes))
