"""Shared shape of every model: a body (representation) followed by a linear head."""
from __future__ import annotations

import torch
from torch import nn


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
