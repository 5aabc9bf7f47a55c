"""Ditto (Li et al., 2021, "Ditto: Fair and Robust Federated Learning Through
Personalization").

Two models per client: the global model w, trained by FedAvg (E local epochs from the
broadcast w^t, sample-weighted averaging), and a personal model v_i kept on the host, trained
in the same round from its previous value on the regularised objective

    h_i(v; w^t) = F_i(v) + (lam / 2) * ||v - w^t||^2,   grad = grad F_i(v) + lam * (v - w^t)

with w^t the broadcast global model of the round (not the client's locally updated copy).
v_i starts as the global model the first time client i takes part (the paper's v_i^0 = w^0
under full participation). Clients are scored with their personal model (the global one if
they never took part). lam -> 0 gives local training, lam -> inf the global model.

Config (``conf/algorithm/ditto.yaml``): ``lam`` (the paper tunes lambda per dataset over a grid
such as {0.05, 0.1, 0.2, 0.5, 1, 2}), ``personal_epochs`` (local epochs on v per round; null =
``local_epochs``).
"""
from __future__ import annotations

import torch
from torch import nn

from fedfew.algorithms import ALGORITHMS
from fedfew.algorithms._averaging import Averaging
from fedfew.algorithms._client_training import loss_row, proximal_term
from fedfew.algorithms.round_log import Kind
from fedfew.data.base import ClientSplit
from fedfew.core.model_set import flat_state


@ALGORITHMS.register("ditto")
class Ditto(Averaging):
    """FedAvg global model + personal models regularised towards it (host state ``personal``)."""

    key_rules = {"lam": "number >= 0",
                 "personal_epochs": "null or integer >= 1 (null: local_epochs)"}

    row_shapes = {"loss": lambda K: (1,), "personal_loss": lambda K: (1,)}
    log_keys = {**Averaging.log_keys, "loss": Kind.PER_CLIENT, "personal_loss": Kind.PER_CLIENT}

    def __init__(self, cfg, ctx) -> None:
        super().__init__(cfg, ctx)
        self.lam = float(cfg.lam)
        epochs = cfg.get("personal_epochs", None)
        self.personal_epochs = int(ctx.cfg.local_epochs if epochs is None else epochs)

    def begin_round(self, rnd: int, participants: list[int]) -> None:
        super().begin_round(rnd, participants)
        # the broadcast w^t (the server model is not modified before end_round)
        reference = [p.detach() for p in self.ctx.module.models[0].parameters()]
        self._penalty = proximal_term(reference, self.lam) if self.lam > 0 else None

    def client_update(self, client: ClientSplit, rnd: int) -> dict[str, torch.Tensor]:
        # global model: a FedAvg client update from w^t
        loss = self.local_train(client, rnd, 0)
        self.contribute(0, client)
        # personal model: from v_i (or w^t), with the lam * (v - w^t) term
        self.load_personal(client, "personal")
        personal_loss = self.local_train(client, rnd, None, epochs=self.personal_epochs,
                                         penalty=self._penalty, stream="personal")
        self.save_client(client.id, personal=flat_state(self.ctx.module.working))  # with its own BN statistics
        return {"loss": loss_row(loss), "personal_loss": loss_row(personal_loss)}

    def end_round(self, rnd, participants, rows):
        logs = super().end_round(rnd, participants, rows)
        logs["personal_loss"] = rows["personal_loss"]
        return logs

    def candidates(self, client: ClientSplit) -> list[nn.Module]:
        self.load_personal(client, "personal")
        return [self.ctx.module.working]
