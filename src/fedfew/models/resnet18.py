"""ResNet-18 (He et al. 2016, "Deep Residual Learning for Image Recognition"), torchvision's
implementation trained from scratch: the model the FedFew reference (pgg3/FedFew on PFLlib,
``torchvision.models.resnet18(pretrained=False, num_classes=...)``) uses for Kvasir (64x64) and
Fed-ISIC2019 (224x224), and the default model of ``dataset=kvasir`` and ``dataset=fedisic``
(``model=cnn`` on the command line gives the two-conv CNN instead).
"""
from __future__ import annotations

from torch import nn

from fedfew.models import MODELS, DataInfo
from fedfew.models.base import BodyHead


@MODELS.register("resnet18")
def build(cfg, info: DataInfo) -> BodyHead:
    """torchvision's ``resnet18(weights=None, num_classes=C)`` split into body and head.

    body: conv7x7/2 (64) -> BatchNorm -> ReLU -> maxpool3x3/2 -> layer1 .. layer4 (2 basic blocks
    each, 64/128/256/512 channels, strides 1/2/2/2) -> adaptive average pool -> flatten, giving
    (B, 512) features; head: ``fc``, ``nn.Linear(512, C)``. ``forward`` equals torchvision's
    ``ResNet.forward`` (same modules, same order), and the weights are torchvision's random
    initialisation (Kaiming-normal convolutions, BatchNorm weight 1 / bias 0); nothing is
    downloaded. With ``C_in != 3`` input channels (grayscale) the stem convolution takes C_in
    channels, initialised like torchvision's. Any (C, H, W) input works (adaptive pooling); at
    32x32 the last stage is 1x1, so a train-mode batch of one sample would fail in BatchNorm:
    local training merges a final one-sample batch into the previous one
    (:func:`fedfew.core.local_training.batch_bounds`). 20 BatchNorm layers (9,600 running statistics)
    travel with the 11.2 M parameters under the BatchNorm policy of docs/models.md.

    Args:
        cfg: the ``model`` config (``conf/model/resnet18.yaml``; no keys besides ``name``).
        info: ``input_shape`` (C, H, W), ``num_classes``.
    Returns:
        a :class:`BodyHead`: input (B, C, H, W) float32, output (B, num_classes) logits.
    Raises:
        ValueError: the input is not an image (C, H, W).
    """
    from torchvision.models import resnet18

    if len(info.input_shape) != 3:
        raise ValueError(f"model resnet18 needs image inputs (C, H, W), got shape {info.input_shape}; "
                         "pick another model for this dataset (e.g. model=mlp)")
    channels = int(info.input_shape[0])
    net = resnet18(weights=None, num_classes=info.num_classes)
    if channels != 3:
        net.conv1 = nn.Conv2d(channels, 64, kernel_size=7, stride=2, padding=3, bias=False)
        nn.init.kaiming_normal_(net.conv1.weight, mode="fan_out", nonlinearity="relu")  # torchvision's init
    body = nn.Sequential(net.conv1, net.bn1, net.relu, net.maxpool, net.layer1, net.layer2, net.layer3,
                         net.layer4, net.avgpool, nn.Flatten(1))
    return BodyHead(body, net.fc)
