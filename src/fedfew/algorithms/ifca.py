"""IFCA, the Iterative Federated Clustering Algorithm (Ghosh et al., 2020, "An Efficient
Framework for Clustered Federated Learning"), model-averaging variant.

The server keeps K cluster models and broadcasts all of them. Each participating client
evaluates every model on its own train split (eval mode) and takes the one with the lowest
loss, k_i = argmin_k L_i(theta_k); it trains only that model for E local epochs and sends it
back (with its cluster identity). The server sets each cluster model to the sample-weighted
mean of the models of the clients that took it (the paper averages uniformly, on equal-sized
clients); a model that no client took keeps its weights. At evaluation a client picks the
model with the lowest loss on its selection split, the same rule.

The K models are initialised independently (``init: independent``): with identical initial
models every client's argmin is model 0 and IFCA collapses to FedAvg.

Config (``conf/algorithm/ifca.yaml``): ``K`` (number of clusters, default 3 like FedFew's K),
``init`` (independent | identical).
"""
from __future__ import annotations

from typing import Any

import torch
from omegaconf import DictConfig
from torch import nn

from fedfew.algorithms import ALGORITHMS
from fedfew.algorithms._averaging import Averaging
from fedfew.data.base import ClientSplit
from fedfew.algorithms.base import Hint
from fedfew.algorithms.round_log import Kind
from fedfew.core.local_training import evaluate_model
from fedfew.core.model_set import state_numel


def assign(losses: torch.Tensor) -> torch.Tensor:
    """argmin over the last dimension, NaN counting as +inf (ties: lowest index)."""
    return torch.nan_to_num(losses, nan=float("inf")).argmin(dim=-1)


@ALGORITHMS.register("ifca")
class IFCA(Averaging):
    """K cluster models; each client trains the one with the lowest train loss."""

    key_rules = {"K": "integer >= 1",
                 "init": "independent | identical"}
    #: assignment: the model each participant trained (its lowest train loss); effective_step: 1 for the
    #: models some participant trained
    log_keys = {**Averaging.log_keys, "assignment": Kind.PER_CLIENT, "effective_step": Kind.PER_MODEL}

    watch_collapse = True
    collapse_keys = (Hint("algorithm.init", "independent", "identical models send every client to model 0"),
                     Hint("algorithm.K", change="a smaller"))
    # measured, not assumed: with K equal to the known groups IFCA still collapsed (docs/cifar10.md)
    collapse_hint = ("A smaller K helps only where K exceeds the number of groups: the hard argmin gives every "
                     "client to the first model that pulls ahead, also at K = the number of groups (CIFAR-10, "
                     "1,000 clients in 4 groups, K = 4: docs/cifar10.md).")

    @staticmethod
    def num_models(cfg: DictConfig) -> int:
        return int(cfg.K)

    @classmethod
    def communication(cls, cfg: DictConfig, model: nn.Module) -> tuple[int, int]:
        D = state_numel(model)
        return D, cls.num_models(cfg) * D  # up: the one trained model; down: all K

    def client_update(self, client: ClientSplit, rnd: int) -> dict[str, torch.Tensor]:
        ctx = self.ctx
        index = ctx.train_index[client.id]
        losses = torch.tensor([evaluate_model(m, ctx.data, index)[0] for m in ctx.module.models], dtype=torch.float64)
        k = int(assign(losses))
        self.local_train(client, rnd, k)
        self.contribute(k, client)
        return {"loss": losses}

    def end_round(self, rnd: int, participants: list[int], rows: dict[str, torch.Tensor]) -> dict[str, Any]:
        logs = super().end_round(rnd, participants, rows)
        # the same float64 losses and argmin as each client's: the assignment it trained with
        logs["assignment"] = assign(rows["loss"].cpu())
        # each taken model moves all the way to its members' mean; an untaken one does not move
        logs["effective_step"] = (logs["weight_per_model"] > 0).double()
        return logs
