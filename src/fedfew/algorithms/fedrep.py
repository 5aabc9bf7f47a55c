"""FedRep (Collins et al., 2021, "Exploiting Shared Representations for Personalized
Federated Learning").

Every model is ``head(body(x))`` (:class:`fedfew.models.base.BodyHead`): the body is a
representation shared by all clients, the linear head is personal. Each participating client
loads the global body and its own head (the server's initial head the first time), trains
the head for ``head_epochs`` epochs with the body frozen, then the body for ``local_epochs``
epochs with its new head frozen, keeps the head on the host and sends the body. (When the
body has no dropout or batch norm, the frozen body's features are computed once per head
phase and the head epochs run on them: the same steps, at a fraction of the cost.) The server
sets the body to the sample-weighted mean of the clients' bodies (their whole state: a body's
BatchNorm running statistics are averaged with the same weights); the server's head is never
averaged (it only seeds new clients' heads). A client is scored with the global body and its
own head.

Config (``conf/algorithm/fedrep.yaml``): ``head_epochs`` (paper: 10 local epochs for the head
and 1 for the representation). The body epochs are the shared budget ``local_epochs``.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import nn

from fedfew.algorithms import ALGORITHMS
from fedfew.algorithms._averaging import Averaging
from fedfew.algorithms._client_training import loss_row
from fedfew.data.base import ClientSplit
from fedfew.core.local_training import batch_bounds
from fedfew.core.model_set import assign_state_, flat_state, has_batch_norm, state_numel
from fedfew.core.seeding import derive_seed


@contextmanager
def train_only(model: nn.Module, part: nn.Module) -> Iterator[None]:
    """Freeze every parameter of ``model`` outside ``part`` (their gradients stay None, so
    SGD leaves them alone); restores the flags afterwards."""
    keep = {id(p) for p in part.parameters()}
    flags = [(p, p.requires_grad) for p in model.parameters()]
    try:
        for p, _ in flags:
            p.requires_grad_(id(p) in keep)
        yield
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)


#: layers whose train-mode output is random or batch-dependent: a body holding one cannot have
#: its features computed once per head phase
STOCHASTIC = (nn.modules.dropout._DropoutNd, nn.modules.batchnorm._NormBase)


def deterministic(module: nn.Module) -> bool:
    """True when ``module``'s train-mode forward is a fixed function of each sample alone."""
    return not any(isinstance(m, STOCHASTIC) for m in module.modules())


def _check_body_head(model: nn.Module) -> None:
    if not (hasattr(model, "body") and hasattr(model, "head")):
        raise ValueError(f"algorithm=fedrep needs a model with .body and .head (BodyHead); got {type(model).__name__}")


@ALGORITHMS.register("fedrep")
class FedRep(Averaging):
    """Shared body averaged by the server, personal heads kept on the host (``head``)."""

    key_rules = {"head_epochs": "integer >= 0 (local epochs on the personal head)"}

    def __init__(self, cfg, ctx) -> None:
        super().__init__(cfg, ctx)
        _check_body_head(ctx.module.working)
        self.head_epochs = int(cfg.head_epochs)
        # with a frozen, deterministic body the head phase is a linear model on fixed features
        self._cache_features = deterministic(ctx.module.working.body)

    def _train_head_on_features(self, client: ClientSplit, seed: int) -> float:
        """The head phase with the body's features computed once: the same SGD steps, sample
        order (seed) and result as ``train_local`` with the body frozen, without running the
        body head_epochs times. Only for a :func:`deterministic` body (so no BatchNorm there;
        the batches follow :func:`fedfew.core.local_training.batch_bounds` like every local loop)."""
        ctx, module = self.ctx, self.ctx.module
        working, index = module.working, ctx.train_index[client.id]
        batch_size = int(ctx.cfg.dataset.batch_size)
        working.train()
        with torch.no_grad():
            parts = [working.body(ctx.data.batch(index[i : i + 1024])[0]) for i in range(0, index.numel(), 1024)]
        features, targets = torch.cat(parts), ctx.data.targets[index]
        optimizer = module.make_optimizer(working.head.parameters())
        torch.manual_seed(seed)
        n = index.numel()
        bounds = batch_bounds(n, batch_size, merge_single=has_batch_norm(working.head))
        running = torch.zeros((), device=index.device)
        for _ in range(self.head_epochs):
            order = torch.randperm(n, device=index.device)
            running = torch.zeros((), device=index.device)
            for start, end in bounds:
                b = order[start:end]
                if ctx.autocast is None:
                    loss = F.cross_entropy(working.head(features[b]), targets[b])
                else:
                    with ctx.autocast():
                        loss = F.cross_entropy(working.head(features[b]), targets[b])
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                running += loss.detach().float() * b.numel()
        return float(running) / max(n, 1)

    def shared(self, model: nn.Module) -> nn.Module:
        return model.body

    @classmethod
    def communication(cls, cfg: DictConfig, model: nn.Module) -> tuple[int, int]:
        body = state_numel(model.body)  # the body's parameters and BatchNorm statistics
        return body, body

    def _load(self, client: ClientSplit) -> None:
        """Global body (and buffers) plus the client's head, when it has one, into the working copy."""
        working = self.ctx.module.working
        self.ctx.module.load_working(0)
        head = self.load_client(client.id, "head")
        if head is not None:
            assign_state_(working.head, head)

    def client_update(self, client: ClientSplit, rnd: int) -> dict[str, torch.Tensor]:
        working = self.ctx.module.working
        self._load(client)
        if self.head_epochs > 0:
            seed = derive_seed(self.ctx.cfg.seed, "local", rnd, client.id, "head")
            if self._cache_features:
                self._train_head_on_features(client, seed)
            else:
                with train_only(working, working.head):
                    self.local_train(client, rnd, None, epochs=self.head_epochs, stream="head")
        with train_only(working, working.body):
            loss = self.local_train(client, rnd, None, stream="body")
        self.save_client(client.id, head=flat_state(working.head))
        self.contribute(0, client)
        return {"loss": loss_row(loss)}

    def candidates(self, client: ClientSplit) -> list[nn.Module]:
        self._load(client)
        return [self.ctx.module.working]
