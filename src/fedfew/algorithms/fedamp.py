"""FedAMP, federated attentive message passing (Huang, Chu, Zhou, Wang, Liu, Pei and Zhang,
2021, "Personalized Cross-Silo Federated Learning on Non-IID Data", AAAI).

Every client i keeps a personal model w_i (on the host). The paper's objective is

    G(W) = sum_i F_i(w_i) + lam * sum_{i<j} A(||w_i - w_j||^2),   A(x) = 1 - exp(-x / sigma),

optimised by alternating a server step on the attention term and a proximal client step. The
server builds for each client a personalised cloud model, a convex combination of the
personal models

    u_i = sum_j xi_ij w_j,   xi_ii = alphaK,
    xi_ij = (1 - alphaK) * A'(||w_i - w_j||^2) / sum_{h != i} A'(||w_i - w_h||^2)   (j != i),

with A'(x) = exp(-x / sigma) / sigma, so clients with similar models pass each other more
(:func:`attention_weights`, computed as a softmax of -||w_i - w_j||^2 / sigma, so no weight
underflows to 0/0).

Variant: the paper's first-order server step on the attention term gives xi_ij = alpha_k *
A'(||w_i - w_j||^2) and xi_ii = 1 - sum_{j != i} xi_ij; with A' = exp(-x / sigma) / sigma that
self weight becomes exactly 1 (no message passing) once the distances exceed a few sigma, and
negative when alpha_k * sum_j A' > 1. In the spirit of the paper's heuristic version
(HeurFedAMP, whose self weight is a hyperparameter) we keep the attention over the other
clients proportional to A' but normalised, and set the self weight xi_ii = alphaK; every u_i
is then a convex combination.

The client trains its personal model, from its current value, on the paper's proximal objective

    F_i(w) + (lam / (2 * alphaK)) * ||w - u_i||^2,   grad = grad F_i(w) + (lam / alphaK) * (w - u_i).

Round structure: a participant trains w_i against its cloud model u_i and sends w_i; after
gathering the round's personal models (rows of length d, see :mod:`fedfew.algorithms._updates`),
the server computes u_i over the round's participants and every participant keeps its u_i on
the host for its next round. Under full participation this is the paper's alternation exactly
(u^k from W^{k-1}); under partial participation u_i is built from the models of the round the
client last took part in (as PFLlib does, from the uploaded models only). Before its first
cloud model a client uses the initial global model (all personal models start equal, so
u_i^1 = w^0). Clients are scored with their personal model (the initial model if they never
took part).

BatchNorm: a personal model is a state vector (:func:`fedfew.core.model_set.flat_state`) and keeps its own
running statistics, which never leave the client: the server's distances and cloud models are
on the parameters only (the rows and u_i are parameter vectors), and the proximal term acts on
the parameters.

Memory: each client's w_i and u_i live on the host of the process that owns it (2 x d per
client); the server's P x d rows are transient.

Logged: ``mean_sq_distance`` (mean ||w_i - w_j||^2 over pairs of participants: the scale sigma
is compared with) and per participant ``neighbour_weight`` (its largest xi_ij / (1 - alphaK),
j != i: 1/(P-1) is uniform attention, 1 a single neighbour).

Config (``conf/algorithm/fedamp.yaml``): ``alphaK`` (self weight xi_ii and the proximal
denominator, in (0, 1]; 1 = no message passing), ``lam`` (lambda >= 0; 0 = local training),
``sigma`` (> 0, in units of squared parameter distance: large = uniform attention, small = the
nearest model only).
"""
from __future__ import annotations

from typing import Any

import torch
from omegaconf import DictConfig
from torch import nn

from fedfew.algorithms import ALGORITHMS
from fedfew.algorithms._client_training import ClientTraining, loss_row, proximal_term
from fedfew.algorithms._updates import vector_row, vector_rows
from fedfew.algorithms.round_log import Kind
from fedfew.data.base import ClientSplit
from fedfew.core.model_set import flat_parameters, flat_state, unflatten_like


def squared_distances(models: torch.Tensor) -> torch.Tensor:
    """(P, P) ||w_i - w_j||^2 of the rows of ``models`` ((P, d)), exact zeros on the diagonal."""
    gram = models @ models.T
    sq = gram.diagonal()
    dist = (sq[:, None] + sq[None, :] - 2.0 * gram).clamp_min(0.0)
    dist.fill_diagonal_(0.0)
    return dist


def attention_weights(sq_dist: torch.Tensor, alphaK: float, sigma: float) -> torch.Tensor:
    """FedAMP's message-passing weights xi.

    Args:
        sq_dist: (P, P) squared distances ||w_i - w_j||^2.
        alphaK: self weight xi_ii in (0, 1].
        sigma: scale of A(x) = 1 - exp(-x / sigma), > 0.
    Returns:
        (P, P) float64, rows summing to 1: xi_ii = alphaK and, for j != i,
        xi_ij = (1 - alphaK) * softmax_{j != i}(-sq_dist_ij / sigma) (proportional to A').
        A single participant gets xi = [[1]].
    Raises:
        ValueError: alphaK or sigma out of range.
    """
    if not 0.0 < alphaK <= 1.0:
        raise ValueError(f"algorithm.alphaK={alphaK} must be in (0, 1]")
    if not sigma > 0.0:
        raise ValueError(f"algorithm.sigma={sigma} must be > 0")
    P = sq_dist.shape[0]
    if P == 1:
        return torch.ones((1, 1), dtype=torch.float64, device=sq_dist.device)
    logits = -sq_dist.double() / sigma
    eye = torch.eye(P, dtype=torch.bool, device=sq_dist.device)
    others = torch.softmax(logits.masked_fill(eye, float("-inf")), dim=1)
    return (1.0 - alphaK) * others + alphaK * eye.double()


@ALGORITHMS.register("fedamp")
class FedAMP(ClientTraining):
    """Personal models (host state ``personal``) pulled towards attentive cloud models (``cloud``)."""

    key_rules = {"alphaK": "number in (0, 1]",
                 "lam": "number >= 0",
                 "sigma": "number > 0 (attention scale)"}

    #: the mean squared distance between the participants' models, and each one's largest neighbour weight
    log_keys = {"loss": Kind.PER_CLIENT, "mean_sq_distance": Kind.SCALAR, "neighbour_weight": Kind.PER_CLIENT}

    def __init__(self, cfg: DictConfig, ctx) -> None:
        super().__init__(cfg, ctx)
        self.alphaK = float(cfg.alphaK)
        self.lam = float(cfg.lam)
        self.sigma = float(cfg.sigma)
        d = flat_parameters(ctx.module.models[0]).numel()
        self.row_shapes = {"loss": lambda K: (1,), **vector_rows(d)}
        self._mine: list[int] = []

    @classmethod
    def communication(cls, cfg: DictConfig, model: nn.Module) -> tuple[int, int]:
        d = sum(p.numel() for p in model.parameters())
        return d, d  # w_i's parameters up, u_i down (BatchNorm statistics stay on the client)

    def begin_round(self, rnd: int, participants: list[int]) -> None:
        self._mine = []

    def cloud_model(self, client_id: int) -> torch.Tensor:
        """u_i on the device: the saved one, or the initial global model before the first."""
        saved = self.load_client(client_id, "cloud")
        return flat_parameters(self.ctx.module.models[0]) if saved is None else saved

    def client_update(self, client: ClientSplit, rnd: int) -> dict[str, torch.Tensor]:
        working = self.ctx.module.working
        self.load_personal(client, "personal")
        cloud = self.cloud_model(client.id)
        penalty = proximal_term(unflatten_like(cloud, working), self.lam / self.alphaK) if self.lam > 0 else None
        loss = self.local_train(client, rnd, None, penalty=penalty, stream=0)
        personal = flat_state(working)  # parameters and the client's own BatchNorm statistics
        valid = self.ctx.finite_or_reported(client.id, personal, "local model")
        if valid:
            self.save_client(client.id, personal=personal)
            self._mine.append(client.id)
        return {"loss": loss_row(loss), **vector_row(flat_parameters(working), valid)}

    def end_round(self, rnd: int, participants: list[int], rows: dict[str, torch.Tensor]) -> dict[str, Any]:
        models, valid = rows["vector"], rows["valid"][:, 0] > 0
        keep = torch.nonzero(valid).flatten().tolist()
        neighbour = torch.zeros(len(participants), dtype=torch.float64)
        mean_sq = 0.0
        if keep:
            W = models[keep]
            dist = squared_distances(W)
            xi = attention_weights(dist, self.alphaK, self.sigma)
            clouds = xi @ W  # (P', d): u_i = sum_j xi_ij w_j
            dtype = next(self.ctx.module.models[0].parameters()).dtype
            mine = set(self._mine)
            for row, j in enumerate(keep):
                if participants[j] in mine:
                    self.save_client(participants[j], cloud=clouds[row].to(dtype))
            if len(keep) > 1:
                P = len(keep)
                mean_sq = float(dist.sum() / (P * (P - 1)))
                off = xi.masked_fill(torch.eye(P, dtype=torch.bool, device=xi.device), 0.0)
                if self.alphaK < 1.0:
                    neighbour[keep] = (off.max(dim=1).values / (1.0 - self.alphaK)).cpu()
        self._mine = []
        return {"loss": rows["loss"], "mean_sq_distance": mean_sq, "neighbour_weight": neighbour}

    def candidates(self, client: ClientSplit) -> list[nn.Module]:
        self.load_personal(client, "personal")
        return [self.ctx.module.working]
