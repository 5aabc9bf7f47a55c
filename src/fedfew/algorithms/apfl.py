"""APFL, Adaptive Personalized Federated Learning (Deng, Kamani and Mahdavi, 2020).

Each client keeps a personal model v_i and a mixing weight alpha_i on the host. Its
personalized model is the parameter mixture

    v_bar_i = alpha_i * v_i + (1 - alpha_i) * w

with w the global model. In a round, from the broadcast w, every local SGD step on a
minibatch xi does (all gradients at the state before the step, as in the paper's Algorithm 1)

    w       <- w - lr * grad f_i(w; xi)                         (the FedAvg part)
    v_i     <- v_i - lr * alpha_i * grad f_i(v_bar_i; xi)        (d f(v_bar) / d v = alpha * grad)
    alpha_i <- clip(alpha_i - alpha_lr * <v_i - w, grad f_i(v_bar_i; xi)>, 0, 1)   (adaptive only)

and the server sets w to the sample-weighted mean of the clients' w. A client is scored with
v_bar_i built from its v_i, alpha_i and the current global w (the global model if it never took
part). v_i starts as the broadcast w the first time client i takes part.

Two extra model copies (v and v_bar) are kept on the device for the client being trained,
whatever the number of clients; every client's v_i and alpha_i live on the host.

BatchNorm: the mixture mixes parameters only. Running statistics are not parameters and v_i is
never run on its own (only through v_bar_i), so the personal statistics are v_bar_i's: they
start as the broadcast w's the first time, are updated by v_bar_i's train-mode forwards, and are
kept on the host with v_i (in the buffers of v_i's saved state vector); the scored mixture uses
them. The global w's statistics are averaged with the parameters (FedAvg part). A final batch of
one sample is merged into the previous one (:func:`fedfew.core.local_training.batch_bounds`).

Config (``conf/algorithm/apfl.yaml``): ``alpha`` (the fixed mixing weight, or its initial value
when adaptive; the paper reports 0.25, 0.5, 0.75 and adaptive), ``adaptive`` (learn alpha_i by
the gradient step above), ``alpha_lr`` (step size of alpha; null = ``optim.lr``, the paper's
single step size).
"""
from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from torch import nn

from fedfew.algorithms import ALGORITHMS
from fedfew.algorithms._averaging import Averaging
from fedfew.algorithms._client_training import loss_row
from fedfew.algorithms.round_log import Kind
from fedfew.data.base import ClientSplit
from fedfew.core.local_training import batch_bounds
from fedfew.core.model_set import assign_state_, flat_state, has_batch_norm
from fedfew.core.seeding import derive_seed


def mix_(target: nn.Module, personal: nn.Module, shared: nn.Module, alpha: float) -> None:
    """target <- alpha * personal + (1 - alpha) * shared, parameter by parameter, in place
    (buffers are left alone)."""
    with torch.no_grad():
        for t, v, w in zip(target.parameters(), personal.parameters(), shared.parameters()):
            torch.add(v * alpha, w, alpha=1.0 - alpha, out=t)


def alpha_step(alpha: float, alpha_lr: float, grad_alpha: float) -> float:
    """One adaptive step of the mixing weight: clip(alpha - alpha_lr * grad_alpha, 0, 1) (APFL,
    Deng et al. 2020, Algorithm 1; ``grad_alpha`` = <v - w, grad f(v_bar)>, a scalar).

    A NaN gradient (the personal model diverged) leaves alpha as it was: Python's ``max(0.0, nan)``
    is 0.0, so clipping it would log alpha = 0 as if the client had chosen the global model. The
    client's divergence is reported where it is scored (fedfew.core.run_folders.diverged_clients). An infinite
    gradient is a step past a bound and is clipped to it.
    """
    if math.isnan(grad_alpha):
        return alpha
    return min(1.0, max(0.0, alpha - alpha_lr * grad_alpha))


def copy_buffers_(dst: nn.Module, src: nn.Module) -> None:
    """Copy ``src``'s buffers (BatchNorm statistics) into ``dst`` in place (same architecture)."""
    with torch.no_grad():
        for a, b in zip(dst.buffers(), src.buffers()):
            a.copy_(b)


@ALGORITHMS.register("apfl")
class APFL(Averaging):
    """Global model by FedAvg; personal v_i and alpha_i on the host (``personal``, ``alpha``)."""

    key_rules = {"alpha": "number in [0, 1] (mixing weight; its start when adaptive)",
                 "adaptive": "true | false",
                 "alpha_lr": "null or number > 0 (null: optim.lr)"}

    row_shapes = {"loss": lambda K: (1,), "alpha": lambda K: (1,)}
    #: client_alpha: each participant's mixing weight alpha_i after the round
    log_keys = {**Averaging.log_keys, "loss": Kind.PER_CLIENT, "client_alpha": Kind.PER_CLIENT}

    def __init__(self, cfg, ctx) -> None:
        super().__init__(cfg, ctx)
        self.alpha0 = float(cfg.alpha)
        self.adaptive = bool(cfg.adaptive)
        lr = cfg.get("alpha_lr", None)
        self.alpha_lr = float(ctx.cfg.optim.lr if lr is None else lr)
        # device scratch for the client being trained: v and v_bar
        self._personal = copy.deepcopy(ctx.module.working)
        self._mix = copy.deepcopy(ctx.module.working)

    def client_alpha(self, client_id: int) -> float:
        """alpha_i (the initial ``alpha`` for a client that never took part)."""
        saved = self.ctx.host_state.get(int(client_id), {}).get("alpha")
        return self.alpha0 if saved is None else float(saved)

    def _load_personal(self, client: ClientSplit) -> None:
        """v_i (with the personal BatchNorm statistics in its buffers) into the personal scratch
        model (the server model's state when it has none)."""
        saved = self.load_client(client.id, "personal")
        assign_state_(self._personal, flat_state(self.ctx.module.models[0]) if saved is None else saved)

    def _forward_loss(self, model: nn.Module, batch) -> torch.Tensor:
        x, y = batch
        if self.ctx.autocast is None:
            return F.cross_entropy(model(x), y)
        with self.ctx.autocast():
            return F.cross_entropy(model(x), y)

    def client_update(self, client: ClientSplit, rnd: int) -> dict[str, torch.Tensor]:
        ctx, run, module = self.ctx, self.ctx.cfg, self.ctx.module
        module.load_working(0)  # w
        self._load_personal(client)  # v
        w, v, v_bar = module.working, self._personal, self._mix
        copy_buffers_(v_bar, v)  # the personal statistics (v_bar's, kept in v's buffers)
        for m in (w, v, v_bar):
            m.train()
        opt_w = module.configure_optimizers()
        opt_v = module.make_optimizer(v.parameters())
        alpha = self.client_alpha(client.id)
        index, batch_size = ctx.train_index[client.id], int(run.dataset.batch_size)
        torch.manual_seed(derive_seed(run.seed, "local", rnd, client.id, 0))
        n = index.numel()
        bounds = batch_bounds(n, batch_size, merge_single=has_batch_norm(w))
        running = torch.zeros((), device=index.device)
        for _ in range(int(run.local_epochs)):
            order = index[torch.randperm(n, device=index.device)]
            running = torch.zeros((), device=index.device)
            for start, end in bounds:
                batch = ctx.data.batch(order[start:end])
                # gradient of f at v_bar = alpha v + (1 - alpha) w, all at the pre-step state
                mix_(v_bar, v, w, alpha)
                loss_bar = self._forward_loss(v_bar, batch)
                grad_bar = torch.autograd.grad(loss_bar, list(v_bar.parameters()))
                loss_w = self._forward_loss(w, batch)
                opt_w.zero_grad(set_to_none=True)
                loss_w.backward()
                if self.adaptive:
                    with torch.no_grad():
                        grad_alpha = float(sum(((pv - pw) * g).sum() for pv, pw, g in zip(v.parameters(), w.parameters(), grad_bar)))
                opt_w.step()
                for p, g in zip(v.parameters(), grad_bar):
                    p.grad = alpha * g
                opt_v.step()
                if self.adaptive:
                    alpha = alpha_step(alpha, self.alpha_lr, grad_alpha)
                running += loss_bar.detach().float() * batch[1].numel()
        self.contribute(0, client)
        copy_buffers_(v, v_bar)
        self.save_client(client.id, personal=flat_state(v), alpha=torch.tensor(alpha, dtype=torch.float64))
        return {"loss": loss_row(float(running) / max(n, 1)), "alpha": loss_row(alpha)}

    def end_round(self, rnd, participants, rows):
        logs = super().end_round(rnd, participants, rows)
        logs["client_alpha"] = rows["alpha"][:, 0]
        return logs

    def candidates(self, client: ClientSplit) -> list[nn.Module]:
        """The mixture alpha_i v_i + (1 - alpha_i) w with the current global w."""
        module = self.ctx.module
        module.load_working(0)
        saved = self.load_client(client.id, "personal")
        if saved is not None:
            assign_state_(self._personal, saved)
            mix_(module.working, self._personal, module.models[0], self.client_alpha(client.id))
            copy_buffers_(module.working, self._personal)  # its own BatchNorm statistics
        return [module.working]
