"""Shared shape of every model: a body (representation) followed by a linear head."""
from __future__ import annotations

import torch
from torch import nn

#: ``model.norm`` values of the MLP and the CNN: no normalisation, or BatchNorm after each hidden layer
NORMS = ("none", "batch")


class BodyHead(nn.Module):
    """``forward(x) = head(body(x))``.

    Args:
        body: maps a batch (B, ...) to features (B, F).
        head: ``nn.Linear(F, num_classes)``.
    """

    def __init__(self, body: nn.Module, head: nn.Linear) -> None:
        super().__init__()
        self.body = body
        self.head = head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, ...) inputs -> (B, num_classes) logits."""
        return self.head(self.body(x))


def norm_setting(cfg, model: str) -> str:
    """``cfg.norm`` (default ``none``) checked against :data:`NORMS`.

    Raises:
        ValueError: another value, naming ``model.norm``, the model and the allowed values.
    """
    norm = str(cfg.get("norm", "none"))
    if norm not in NORMS:
        raise ValueError(f"model.norm={norm!r} for model {model}; allowed: {', '.join(NORMS)}")
    return norm
