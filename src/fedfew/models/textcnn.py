"""TextCNN (Kim 2014) as used for AG News by the reference code (PFLlib's ``TextCNN``)."""
from __future__ import annotations

import torch
from torch import nn

from fedfew.models import MODELS, DataInfo
from fedfew.models.base import BodyHead


class TextCNNBody(nn.Module):
    """Embedding -> parallel Conv1d (one per kernel size) -> ReLU -> max over time -> dropout.

    Input (B, L) int64 token ids (0 = padding); output (B, channels * len(kernels)).
    Sequences shorter than the largest kernel are right-padded with 0 inside forward.
    """

    def __init__(self, vocab_size: int, embed_dim: int, kernels: list[int], channels: int, dropout: float):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, embed_dim, padding_idx=0)
        self.convs = nn.ModuleList(nn.Conv1d(embed_dim, channels, k) for k in kernels)
        self.dropout = nn.Dropout(dropout)
        self.min_length = max(kernels)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.shape[1] < self.min_length:
            tokens = nn.functional.pad(tokens, (0, self.min_length - tokens.shape[1]))
        x = self.embedding(tokens).transpose(1, 2)  # (B, E, L)
        feats = [torch.relu(conv(x)).amax(dim=2) for conv in self.convs]
        return self.dropout(torch.cat(feats, dim=1))


@MODELS.register("textcnn")
def build(cfg, info: DataInfo) -> BodyHead:
    """TextCNN with kernels ``cfg.kernels`` (default 3/4/5), ``cfg.channels`` (100) each.

    Args:
        cfg: ``embed_dim`` (default 128; the reference uses 512), ``kernels``, ``channels``,
            ``dropout`` (0.5).
        info: needs ``vocab_size``.
    Raises:
        ValueError: no vocabulary size (not a text dataset).
    """
    if not info.vocab_size:
        raise ValueError("model textcnn needs a text dataset (vocab_size); pick another model for this dataset")
    kernels = list(cfg.get("kernels", [3, 4, 5]))
    channels = int(cfg.get("channels", 100))
    body = TextCNNBody(info.vocab_size, int(cfg.get("embed_dim", 128)), kernels, channels, float(cfg.get("dropout", 0.5)))
    return BodyHead(body, nn.Linear(channels * len(kernels), info.num_classes))
