"""FedMGDA+ (Hu, Wang, Yu, Xu and Yin, 2022, "Federated Learning Meets Multi-Objective
Optimization", IEEE TNSE), server-side multiple-gradient descent on the clients' updates.

One global model w. Every participant runs E local epochs of SGD from the broadcast w and
sends its update; the server treats each client's update as a (pseudo-)gradient of that
client's objective, g_i = w - w_i, normalises it (g_i / ||g_i||, FedMGDA+'s gradient
normalisation), and moves along the minimum-norm convex combination of the normalised
updates with the client weights kept within epsilon of the prior lambda^0:

    lambda* = argmin_lambda ||sum_i lambda_i g_i||^2
              s.t. lambda in the simplex, |lambda_i - lambda^0_i| <= epsilon for every i
    w <- w - eta * sum_i lambda*_i g_i

lambda^0 is uniform, 1/P over the P participants (``prior: uniform``), or n_i / sum_j n_j
(``prior: samples``, as in the easyFL implementation). epsilon = 0 gives FedAvg with
normalised updates (and the prior's weights); epsilon >= 1 gives MGDA's unconstrained min-norm
direction, a common descent direction of all clients. The min-norm problem is a P x P
quadratic programme over the simplex intersected with a box, solved by :func:`min_norm_weights`
(accelerated projected gradient with an exact projection, :func:`project_simplex_box`).
Every client is scored with the global model.

BatchNorm: the min-norm problem and the step above are on the parameters; running statistics
are not gradients, so the server sets them to the lambda*-weighted mean of the participants'
statistics (the same client weights, without the normalisation and eta; the counters too,
rounded). Each row is the client's state-vector update (:func:`fedfew.core.model_set.flat_state`).

Rows: every participant's update (length d) is gathered, so the server can form the P x P Gram
matrix (see :mod:`fedfew.algorithms._updates` for the cost). Logged: ``alpha`` (the weights
lambda*, in the slot FedFew uses for its client weights; 0 for a client left out), the step
norm ``step_norm`` = eta * ||sum_i lambda*_i g_i|| and ``mean_update_norm`` (mean ||g_i|| before
normalisation).

Config (``conf/algorithm/fedmgda.yaml``): ``epsilon`` (>= 0, the box half-width; default 0.1,
easyFL's), ``server_lr`` (eta > 0, the global learning rate), ``normalize`` (normalise the
updates, the paper's default; false: min-norm combination of the raw updates), ``prior``
(uniform | samples).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig
from torch import nn

from fedfew.algorithms import ALGORITHMS
from fedfew.algorithms._averaging import server_states
from fedfew.algorithms._client_training import ClientTraining, loss_row
from fedfew.algorithms._updates import vector_row, vector_rows
from fedfew.algorithms.round_log import Kind
from fedfew.data.base import ClientSplit
from fedfew.core.model_set import assign_state_, flat_state, state_numel



def project_simplex_box(v: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Euclidean projection of ``v`` onto {x : sum(x) = 1, lo <= x <= hi}.

    The projection is x_i = clip(v_i - tau, lo_i, hi_i) for the tau where the sum is 1; the sum
    is piecewise linear and non-increasing in tau with breakpoints v_i - lo_i and v_i - hi_i,
    so tau is found exactly between two sorted breakpoints (O(P^2), no iteration).

    Args:
        v: (P,) point to project.
        lo, hi: (P,) bounds with lo <= hi, sum(lo) <= 1 <= sum(hi).
    Returns:
        (P,) float64 projection.
    Raises:
        ValueError: the set is empty (sum(lo) > 1, sum(hi) < 1 or lo > hi somewhere).
    """
    v, lo, hi = (np.asarray(a, dtype=np.float64) for a in (v, lo, hi))
    if np.any(lo > hi) or lo.sum() > 1 + 1e-12 or hi.sum() < 1 - 1e-12:
        raise ValueError(f"empty set: sum(lo)={lo.sum():.6g}, sum(hi)={hi.sum():.6g} (need sum(lo) <= 1 <= sum(hi))")
    taus = np.sort(np.concatenate([v - lo, v - hi]))
    sums = np.clip(v[None, :] - taus[:, None], lo, hi).sum(axis=1)  # non-increasing in tau
    j = int(np.argmax(sums <= 1.0))  # first breakpoint with sum <= 1 (exists: the last one has sum(lo))
    if j == 0:
        tau = taus[0]
    else:
        s0, s1, t0, t1 = sums[j - 1], sums[j], taus[j - 1], taus[j]
        tau = t1 if s0 == s1 else t0 + (s0 - 1.0) * (t1 - t0) / (s0 - s1)
    return np.clip(v - tau, lo, hi)


def min_norm_weights(gram: np.ndarray, lo: np.ndarray, hi: np.ndarray, *, max_iter: int = 5000,
                     tol: float = 1e-12) -> np.ndarray:
    """argmin_lambda lambda^T G lambda over {sum(lambda) = 1, lo <= lambda <= hi}.

    The squared norm of sum_i lambda_i g_i is lambda^T G lambda with G the Gram matrix of the g_i.
    Solved by accelerated projected gradient (FISTA with adaptive restart) with step 1 / L,
    L = 2 * largest eigenvalue of G, from the projection of the uniform point; stops when an
    iteration moves lambda by less than ``tol`` (max norm).

    Args:
        gram: (P, P) symmetric positive semi-definite matrix.
        lo, hi: (P,) bounds (see :func:`project_simplex_box`).
    Returns:
        (P,) float64 weights, on the simplex and inside the bounds.
    Raises:
        ValueError: ``gram`` is not square or not finite, or the feasible set is empty.
    """
    G = np.asarray(gram, dtype=np.float64)
    if G.ndim != 2 or G.shape[0] != G.shape[1] or not np.isfinite(G).all():
        raise ValueError(f"gram must be a finite square matrix, got shape {G.shape}")
    P = G.shape[0]
    G = 0.5 * (G + G.T)
    x = project_simplex_box(np.full(P, 1.0 / P), lo, hi)
    L = 2.0 * float(np.linalg.eigvalsh(G)[-1]) if P else 0.0
    if P <= 1 or L <= 0.0:
        return x  # every feasible point has norm 0 (or only one point)
    y, t = x.copy(), 1.0
    f_prev = float(x @ G @ x)
    for _ in range(max_iter):
        x_new = project_simplex_box(y - (2.0 * G @ y) / L, lo, hi)
        f_new = float(x_new @ G @ x_new)
        if f_new > f_prev:  # adaptive restart: drop the momentum
            y, t = x.copy(), 1.0
            x_new = project_simplex_box(x - (2.0 * G @ x) / L, lo, hi)
            f_new = float(x_new @ G @ x_new)
        t_new = 0.5 * (1.0 + np.sqrt(1.0 + 4.0 * t * t))
        y = x_new + ((t - 1.0) / t_new) * (x_new - x)
        moved = float(np.max(np.abs(x_new - x)))
        x, t, f_prev = x_new, t_new, f_new
        if moved < tol:
            break
    return x


def weight_bounds(prior: np.ndarray, epsilon: float) -> tuple[np.ndarray, np.ndarray]:
    """(lo, hi) = (max(0, lambda^0 - epsilon), min(1, lambda^0 + epsilon)), the paper's box."""
    prior = np.asarray(prior, dtype=np.float64)
    return np.maximum(0.0, prior - epsilon), np.minimum(1.0, prior + epsilon)


@ALGORITHMS.register("fedmgda")
class FedMGDA(ClientTraining):
    """One global model moved along the min-norm combination of normalised client updates."""

    key_rules = {"epsilon": "number >= 0",
                 "server_lr": "number > 0",
                 "normalize": "true | false",
                 "prior": "uniform | samples"}

    #: alpha: the min-norm weights lambda_i of the participants; the server step's norm; the mean update norm
    log_keys = {"loss": Kind.PER_CLIENT, "alpha": Kind.PER_CLIENT, "step_norm": Kind.SCALAR,
                "mean_update_norm": Kind.SCALAR}

    def __init__(self, cfg: DictConfig, ctx) -> None:
        super().__init__(cfg, ctx)
        self.epsilon = float(cfg.epsilon)
        self.server_lr = float(cfg.server_lr)
        self.normalize = bool(cfg.get("normalize", True))
        self.prior = str(cfg.get("prior", "uniform"))
        #: d, the parameter part of each (D,) state-vector update (the min-norm problem's)
        self.num_params = sum(p.numel() for p in ctx.module.models[0].parameters())
        self.row_shapes = {"loss": lambda K: (1,), **vector_rows(state_numel(ctx.module.models[0]))}

    def begin_round(self, rnd: int, participants: list[int]) -> None:
        #: [(D,)]: the global model's state vector at the start of the round (updates are taken against it)
        self.broadcast = server_states(self.ctx.module.models)

    def client_update(self, client: ClientSplit, rnd: int) -> dict[str, torch.Tensor]:
        loss = self.local_train(client, rnd, 0)
        update = flat_state(self.ctx.module.working) - self.broadcast[0]  # w_i - w = -g_i (then statistics)
        valid = self.ctx.finite_or_reported(client.id, update, "local model")
        return {"loss": loss_row(loss), **vector_row(update, valid)}

    def end_round(self, rnd: int, participants: list[int], rows: dict[str, torch.Tensor]) -> dict[str, Any]:
        rows_all, valid = rows["vector"], rows["valid"][:, 0] > 0
        d = self.num_params
        updates, statistics = rows_all[:, :d], rows_all[:, d:]  # parameter updates; BN statistics' changes
        weights = torch.zeros(len(participants), dtype=torch.float64)
        norms = updates.norm(dim=1)
        logs: dict[str, Any] = {"loss": rows["loss"]}
        keep = torch.nonzero(valid).flatten().tolist()  # positions of the clients kept (host list)
        step = torch.zeros((), dtype=torch.float64)
        if keep:
            U = updates[keep]
            if self.normalize:
                U = U / norms[keep].clamp_min(1e-12)[:, None]  # a zero update stays zero
            if self.prior == "uniform":
                prior = np.full(len(keep), 1.0 / len(keep))
            else:
                n = self.ctx.num_train[[participants[j] for j in keep]].double().numpy()
                prior = n / n.sum()
            lo, hi = weight_bounds(prior, self.epsilon)
            lam = min_norm_weights((U @ U.T).cpu().numpy(), lo, hi)
            lam_t = torch.as_tensor(lam, dtype=U.dtype, device=U.device)
            direction = lam_t @ U  # sum_i lambda_i (w_i - w) / ||w_i - w|| = -sum_i lambda_i g_i
            moved = lam_t @ statistics[keep]  # lambda*-weighted mean change of the statistics
            step_all = torch.cat([self.server_lr * direction, moved]).to(self.broadcast[0].dtype)
            assign_state_(self.ctx.module.models[0], self.broadcast[0] + step_all)
            weights[keep] = torch.as_tensor(lam, dtype=torch.float64)
            step = self.server_lr * direction.norm().cpu()
        self.broadcast = []
        logs.update(alpha=weights, step_norm=float(step),
                    mean_update_norm=float(norms[keep].mean()) if keep else 0.0)
        return logs

    def candidates(self, client: ClientSplit) -> list[nn.Module]:
        return [self.ctx.module.models[0]]
