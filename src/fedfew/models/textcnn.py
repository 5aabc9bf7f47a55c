"""TextCNN (Kim 2014) as used for AG News by the reference code (PFLlib's ``TextCNN``)."""
from __future__ import annotations

import torch
from torch import nn

from fedfew.models import MODELS, DataInfo
from fedfew.models.base import BodyHead


class TextCNNBody(nn.Module):
    """Embedding -> parallel Conv1d (one per kernel size) -> ReLU -> max over time -> dropout.

    Input (B, L) int64 token ids (0 = padding, right-padded); output (B, channels * len(kernels)).
    Sequences shorter than the largest kernel are right-padded with 0 inside forward.

    ``mask_padding=True`` (default) takes the max over the windows that start inside the text
    only (a text shorter than the kernel keeps its first window). Batches are padded to their
    longest text, so without the mask a text's features (and its prediction) would depend on
    which other texts share its batch: windows over padding still add the conv bias. The
    reference pads every text to 200 and maxes over all windows (``mask_padding=False``).

    ``embed_init_std`` scales the initial word vectors, N(0, embed_init_std^2) (1, the default,
    is PyTorch's ``nn.Embedding`` and the reference's; Kim's 2014 code draws U[-0.25, 0.25]).

    ``embed_lr_scale=m`` stores the embedding table divided by sqrt(m) and multiplies its rows
    by sqrt(m) in forward: the same function and the same initial vectors, but a plain SGD step
    moves the word vectors m times as far as the other weights (Adam, being invariant to the
    gradient's scale: sqrt(m) times). Each word vector only gets gradient from the few windows
    that win the max over time, so at a shared lr it barely leaves its random start. Being a
    reparametrisation, it works unchanged in every engine and algorithm (deltas and averages are
    taken on the stored table). 1 (default) is the plain layer. It is exact for the loss
    gradient only: weight decay and parameter-space distances (proximal terms, FedAMP's or
    CFL's similarities) act on the stored table, i.e. on word vectors / sqrt(m). A state dict
    records m in its metadata, and loading one saved under another m (a checkpoint from before a
    preset change) fails instead of silently rescaling every word vector.

    Raises:
        ValueError: ``embed_lr_scale`` or ``embed_init_std`` is not > 0.
        RuntimeError: ``load_state_dict`` of a state dict saved under another ``embed_lr_scale``.
    """

    def __init__(self, vocab_size: int, embed_dim: int, kernels: list[int], channels: int, dropout: float,
                 mask_padding: bool = True, embed_lr_scale: float = 1.0, embed_init_std: float = 1.0):
        super().__init__()
        for key, value in (("embed_lr_scale", embed_lr_scale), ("embed_init_std", embed_init_std)):
            if not value > 0:
                raise ValueError(f"model.{key} must be > 0, got {value}")
        self.mask_padding = mask_padding
        self.embedding = nn.Embedding(vocab_size, embed_dim, padding_idx=0)
        self.embed_lr_scale = float(embed_lr_scale)  # recorded in state dicts (see the load check)
        self.embed_multiplier = self.embed_lr_scale ** 0.5
        if embed_init_std != 1.0 or self.embed_multiplier != 1.0:
            with torch.no_grad():  # rescales the N(0, 1) draw: same random stream as the plain layer
                self.embedding.weight.mul_(embed_init_std / self.embed_multiplier)
        self.convs = nn.ModuleList(nn.Conv1d(embed_dim, channels, k) for k in kernels)
        self.dropout = nn.Dropout(dropout)
        self.min_length = max(kernels)
        self.register_state_dict_post_hook(_record_embed_lr_scale)
        self.register_load_state_dict_pre_hook(_check_embed_lr_scale)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.shape[1] < self.min_length:
            tokens = nn.functional.pad(tokens, (0, self.min_length - tokens.shape[1]))
        x = self.embedding(tokens)
        if self.embed_multiplier != 1.0:
            x = x * self.embed_multiplier
        x = x.transpose(1, 2)  # (B, E, L)
        lengths = (tokens != 0).sum(dim=1, keepdim=True)  # (B, 1)
        feats = []
        for conv in self.convs:
            h = torch.relu(conv(x))  # (B, C, L - k + 1), >= 0
            if self.mask_padding:
                # window t covers tokens t..t+k-1; it is inside the text when t <= length - k
                last = (lengths - conv.kernel_size[0]).clamp(min=0)  # (B, 1)
                outside = torch.arange(h.shape[2], device=h.device) > last  # (B, L - k + 1)
                h = h.masked_fill(outside.unsqueeze(1), 0.0)  # 0 never beats a ReLU output
            feats.append(h.amax(dim=2))
        return self.dropout(torch.cat(feats, dim=1))


def _record_embed_lr_scale(module: TextCNNBody, state_dict, prefix: str, local_metadata: dict) -> None:
    local_metadata["embed_lr_scale"] = module.embed_lr_scale


def _check_embed_lr_scale(module: TextCNNBody, state_dict, prefix: str, local_metadata: dict, strict: bool,
                          missing_keys: list, unexpected_keys: list, error_msgs: list) -> None:
    saved = float(local_metadata.get("embed_lr_scale", 1.0))  # state dicts from before the option: 1
    current = module.embed_lr_scale
    if saved != current:
        error_msgs.append(f"{prefix}embedding: saved with model.embed_lr_scale={saved:g}, this model has "
                          f"{current:g} (the stored table is word vectors / sqrt(embed_lr_scale)); "
                          f"rebuild with model.embed_lr_scale={saved:g} to load it")


@MODELS.register("textcnn")
def build(cfg, info: DataInfo) -> BodyHead:
    """TextCNN with kernels ``cfg.kernels`` (default 3/4/5), ``cfg.channels`` (100) each.

    Args:
        cfg: ``embed_dim`` (default 128; the reference uses 512), ``kernels``, ``channels``,
            ``dropout`` (0.5), ``mask_padding`` (True), ``embed_init_std`` (1.0),
            ``embed_lr_scale`` (1.0); see :class:`TextCNNBody`.
        info: needs ``vocab_size``.
    Raises:
        ValueError: no vocabulary size (not a text dataset), or ``embed_lr_scale`` /
            ``embed_init_std`` not > 0.
    """
    if not info.vocab_size:
        raise ValueError("model textcnn needs a text dataset (vocab_size); pick another model for this dataset")
    kernels = list(cfg.get("kernels", [3, 4, 5]))
    channels = int(cfg.get("channels", 100))
    body = TextCNNBody(info.vocab_size, int(cfg.get("embed_dim", 128)), kernels, channels, float(cfg.get("dropout", 0.5)),
                       bool(cfg.get("mask_padding", True)), float(cfg.get("embed_lr_scale", 1.0)),
                       float(cfg.get("embed_init_std", 1.0)))
    return BodyHead(body, nn.Linear(channels * len(kernels), info.num_classes))
