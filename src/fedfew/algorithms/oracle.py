"""Oracle for the clustered benchmark: one model per true client group, trained by FedAvg inside
the group (``algorithm=oracle``; needs ``partition=clustered``).

The server keeps G models, one per group; every participating client trains its own group's
model for E local epochs from the broadcast weights, and the server sets each model to the
sample-weighted mean of its group's clients' models (McMahan et al. 2017, within each group).
Clients are scored with their group's model. It knows what the few-for-many methods must
discover (which clients belong together), so it is the ceiling they are measured against on
``partition=clustered``: a method that recovers the groups (``assignment_ari`` = 1) and trains
one model per group should come close to it.

Config (``conf/algorithm/oracle.yaml``): ``K`` follows ``partition.groups``; no other keys.
"""
from __future__ import annotations

import torch
from omegaconf import DictConfig
from torch import nn

from fedfew.algorithms import ALGORITHMS
from fedfew.algorithms._averaging import Averaging
from fedfew.algorithms._client_training import loss_row
from fedfew.algorithms.round_log import Kind
from fedfew.data.base import ClientSplit
from fedfew.core.model_set import state_numel


@ALGORITHMS.register("oracle")
class Oracle(Averaging):
    """FedAvg inside each true group (see module docstring).

    Raises:
        ValueError: a client without a known group (the partition is not ``clustered``), or K
            different from the number of groups.
    """

    key_rules = {"K": "integer >= 1 (= partition.groups)"}

    row_shapes = {"loss": lambda K: (1,)}
    #: assignment: each participant's true group; effective_step: 1 for the groups with a participant
    log_keys = {**Averaging.log_keys, "loss": Kind.PER_CLIENT, "assignment": Kind.PER_CLIENT,
                "effective_step": Kind.PER_MODEL}

    def __init__(self, cfg: DictConfig, ctx) -> None:
        super().__init__(cfg, ctx)
        groups = [c.group for c in ctx.data.clients]
        if any(g is None for g in groups):
            raise ValueError("algorithm=oracle needs clients with known groups: use partition=clustered")
        if max(groups) + 1 != ctx.module.K:
            raise ValueError(f"algorithm=oracle: algorithm.K={ctx.module.K} but the partition has "
                             f"{max(groups) + 1} groups; leave algorithm.K at its default (partition.groups)")

    @staticmethod
    def num_models(cfg: DictConfig) -> int:
        return int(cfg.K)

    @classmethod
    def communication(cls, cfg: DictConfig, model: nn.Module) -> tuple[int, int]:
        D = state_numel(model)
        return D, D  # its group's model down, the trained copy up

    def client_update(self, client: ClientSplit, rnd: int) -> dict[str, torch.Tensor]:
        k = int(client.group)
        loss = self.local_train(client, rnd, k)
        self.contribute(k, client)
        return {"loss": loss_row(loss)}

    def end_round(self, rnd, participants, rows):
        logs = super().end_round(rnd, participants, rows)
        logs["assignment"] = torch.tensor([self.ctx.data.clients[c].group for c in participants])
        logs["effective_step"] = (logs["weight_per_model"] > 0).double()
        return logs

    def candidates(self, client: ClientSplit) -> list[nn.Module]:
        return [self.ctx.module.models[int(client.group)]]

    def model_assignment(self, client: ClientSplit, chosen: int) -> int:
        return int(client.group)
