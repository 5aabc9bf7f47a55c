"""The two-conv CNN of McMahan et al. 2017 as used by PFLlib/the reference (``FedAvgCNN``)."""
from __future__ import annotations

import torch
from torch import nn

from fedfew.models import MODELS, DataInfo
from fedfew.models.base import BodyHead


@MODELS.register("cnn")
def build(cfg, info: DataInfo) -> BodyHead:
    """conv5x5(32) -> ReLU -> maxpool2 -> conv5x5(64) -> ReLU -> maxpool2 -> FC(hidden) -> ReLU -> FC.

    Args:
        cfg: ``hidden`` (default 512).
        info: ``input_shape`` (C, H, W), e.g. (3, 32, 32) for CIFAR-10, (1, 28, 28) for FEMNIST.
    Raises:
        ValueError: input is not (C, H, W) or too small for two 5x5 conv + pool stages.
    """
    if len(info.input_shape) != 3:
        raise ValueError(f"model cnn needs image inputs (C, H, W), got shape {info.input_shape}")
    c, h, w = info.input_shape
    conv = nn.Sequential(
        nn.Conv2d(c, 32, 5), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
    )
    with torch.no_grad():
        features = conv(torch.zeros(1, c, h, w)).shape[1]
    hidden = int(cfg.get("hidden", 512))
    body = nn.Sequential(conv, nn.Linear(features, hidden), nn.ReLU())
    return BodyHead(body, nn.Linear(hidden, info.num_classes))
