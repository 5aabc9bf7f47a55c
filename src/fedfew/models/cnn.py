"""The two-conv CNN of McMahan et al. 2017 as used by PFLlib/the reference (``FedAvgCNN``)."""
from __future__ import annotations

import torch
from torch import nn

from fedfew.models import MODELS, DataInfo
from fedfew.models.base import BodyHead, norm_setting


@MODELS.register("cnn")
def build(cfg, info: DataInfo) -> BodyHead:
    """conv5x5(32) -> ReLU -> maxpool2 -> conv5x5(64) -> ReLU -> maxpool2 -> FC(hidden) -> ReLU -> FC.

    Args:
        cfg: ``hidden`` (default 512), ``norm`` (``none``, default | ``batch``: a BatchNorm2d
            after each conv, before its ReLU; see docs/models.md for the BatchNorm policy).
        info: ``input_shape`` (C, H, W), e.g. (3, 32, 32) for CIFAR-10, (1, 28, 28) for FEMNIST.
    Raises:
        ValueError: input is not (C, H, W), too small for two 5x5 conv + pool stages, or an
            unknown ``norm``.
    """
    if len(info.input_shape) != 3:
        raise ValueError(f"model cnn needs image inputs (C, H, W), got shape {info.input_shape}")
    c, h, w = info.input_shape
    batch_norm = norm_setting(cfg, "cnn") == "batch"

    def norm(channels: int) -> list[nn.Module]:
        return [nn.BatchNorm2d(channels)] if batch_norm else []

    conv = nn.Sequential(
        nn.Conv2d(c, 32, 5), *norm(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 5), *norm(64), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
    )
    with torch.no_grad():
        conv.eval()  # eval mode: the shape probe must not touch BatchNorm running statistics
        features = conv(torch.zeros(1, c, h, w)).shape[1]
        conv.train()
    hidden = int(cfg.get("hidden", 512))
    body = nn.Sequential(conv, nn.Linear(features, hidden), nn.ReLU())
    return BodyHead(body, nn.Linear(hidden, info.num_classes))
