"""FedProx (Li et al., 2020, "Federated Optimization in Heterogeneous Networks").

FedAvg whose local objective carries a proximal term towards the broadcast global model:

    h_i(w) = F_i(w) + (mu_prox / 2) * ||w - w_global||^2,   grad = grad F_i(w) + mu_prox * (w - w_global)

so local models drift less from the global one on heterogeneous clients. With mu_prox = 0 it
is FedAvg exactly. Aggregation (sample-weighted mean) and scoring (global model) as FedAvg.
The paper's variable amount of local work per device (gamma-inexact solutions, stragglers) is
not simulated: every client runs the shared ``local_epochs``.

Config (``conf/algorithm/fedprox.yaml``): ``mu_prox`` (default 0.01; the paper tunes it over
{0.001, 0.01, 0.1, 1}).
"""
from __future__ import annotations

from fedfew.algorithms import ALGORITHMS
from fedfew.algorithms._client_training import proximal_term
from fedfew.algorithms.fedavg import FedAvg


@ALGORITHMS.register("fedprox")
class FedProx(FedAvg):
    """FedAvg with the proximal term (mu_prox / 2) * ||w - w_global||^2 in the local loss."""

    key_rules = {"mu_prox": "number >= 0"}

    def __init__(self, cfg, ctx) -> None:
        super().__init__(cfg, ctx)
        self.mu_prox = float(cfg.mu_prox)

    def begin_round(self, rnd: int, participants: list[int]) -> None:
        super().begin_round(rnd, participants)
        # the server model is not touched before end_round: it is the broadcast w_global itself
        reference = [p.detach() for p in self.ctx.module.models[0].parameters()]
        self.penalty = proximal_term(reference, self.mu_prox) if self.mu_prox > 0 else None
