"""FedAvg (McMahan et al., 2017, "Communication-Efficient Learning of Deep Networks from
Decentralized Data").

Every participating client trains the global model for E local epochs of SGD from the
broadcast weights; the server replaces it by the sample-weighted mean of the clients' models,
theta <- sum_i n_i theta_i / sum_i n_i (over the round's participants). Every client is scored
with the global model.

Config (``conf/algorithm/fedavg.yaml``): no method hyperparameters; ``optim.lr``,
``local_epochs``, ``dataset.batch_size`` and ``rounds`` are the shared budget.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from fedfew.algorithms import ALGORITHMS
from fedfew.algorithms._averaging import Averaging
from fedfew.algorithms._client_training import loss_row
from fedfew.data.base import ClientSplit


@ALGORITHMS.register("fedavg")
class FedAvg(Averaging):
    """One global model, sample-weighted averaging of the clients' locally trained copies."""

    key_rules: dict[str, str] = {}  # no keys of its own

    #: extra local loss term (FedProx sets a proximal term each round)
    penalty: Callable[[nn.Module], torch.Tensor] | None = None

    def client_update(self, client: ClientSplit, rnd: int) -> dict[str, torch.Tensor]:
        loss = self.local_train(client, rnd, 0, penalty=self.penalty)
        self.contribute(0, client)
        return {"loss": loss_row(loss)}

    def candidates(self, client: ClientSplit) -> list[nn.Module]:
        return [self.ctx.module.models[0]]
