"""Local training only: each client trains its own model on its own data, no communication.

All clients start from the same initial model (server model 0, which never changes); each
client's model lives on the host between rounds and is trained for ``local_epochs`` every
round it participates in, so after T rounds a client has run T x E epochs, the same budget as
the federated methods. Clients are scored with their own model (the initial one if they never
took part). The usual lower reference for personalization: what a client gets without
federation.

Config (``conf/algorithm/local.yaml``): no method hyperparameters.
"""
from __future__ import annotations

from typing import Any

import torch
from omegaconf import DictConfig
from torch import nn

from fedfew.algorithms import ALGORITHMS
from fedfew.algorithms._client_training import ClientTraining, loss_row
from fedfew.algorithms.round_log import Kind
from fedfew.data.base import ClientSplit
from fedfew.core.model_set import flat_state


@ALGORITHMS.register("local")
class Local(ClientTraining):
    """Per-client models trained in isolation (host state ``model``)."""

    key_rules: dict[str, str] = {}  # no keys of its own
    log_keys = {"loss": Kind.PER_CLIENT}  # each client trains its own model; nothing is averaged

    row_shapes = {"loss": lambda K: (1,)}

    @classmethod
    def communication(cls, cfg: DictConfig, model: nn.Module) -> tuple[int, int]:
        return 0, 0

    def client_update(self, client: ClientSplit, rnd: int) -> dict[str, torch.Tensor]:
        self.load_personal(client, "model")
        loss = self.local_train(client, rnd, None, stream=0)
        self.save_client(client.id, model=flat_state(self.ctx.module.working))  # with its own BN statistics
        return {"loss": loss_row(loss)}

    def end_round(self, rnd: int, participants: list[int], rows: dict[str, torch.Tensor]) -> dict[str, Any]:
        return {"loss": rows["loss"]}

    def candidates(self, client: ClientSplit) -> list[nn.Module]:
        self.load_personal(client, "model")
        return [self.ctx.module.working]
