"""FedBN (Li, Jiang, Zhang, Kamp and Dou, 2021, "FedBN: Federated Learning on Non-IID Features via
Local Batch Normalization", ICLR; reference code med-air/FedBN).

FedAvg in which every client keeps its BatchNorm layers local. Each round every participating
client loads the global model, puts its own BatchNorm part back (the server's the first time
it takes part), trains for E local epochs from there, keeps its BatchNorm part on the host and
sends the rest; the server sets every non-BatchNorm tensor to the sample-weighted mean of the
clients' ones,

    theta_shared <- sum_i n_i theta_shared,i / sum_i n_i        (BatchNorm layers never averaged)

(the reference code's ``communication`` skips every key containing ``bn``; there the server
averages uniformly over equal-sized clients, here by n_i as every averaging baseline). A client
is scored with the global model and its own BatchNorm layers.

The local BatchNorm part: every BatchNorm layer's running statistics (running_mean, running_var,
num_batches_tracked) and, with ``local_affine: true`` (the paper's: "local BN layers" keep their
weight and bias), its affine weight and bias; ``local_affine: false`` averages the affine
parameters with the rest and keeps only the statistics local. The part lives on the host per
client (:meth:`~fedfew.algorithms.base.Algorithm.save_client`, key ``bn``: one flat vector in
:func:`fedfew.core.model_set.state_tensors` order), across rounds and in checkpoints. The server
model's own BatchNorm layers are never trained: they seed the local layers of a client the
first time it takes part, and score a client that never took part (with partial
participation; such a client is scored with the initial statistics, mean 0 and variance 1).

Config (``conf/algorithm/fedbn.yaml``): ``local_affine`` (true, default, as the paper).
Needs a model with BatchNorm: ``model.norm=batch`` (mlp, cnn) or ``model=resnet18``.
"""
from __future__ import annotations

import torch
from omegaconf import DictConfig
from torch import nn

from fedfew.algorithms import ALGORITHMS
from fedfew.algorithms._client_training import loss_row
from fedfew.algorithms.base import Context
from fedfew.algorithms.fedavg import FedAvg
from fedfew.data.base import ClientSplit
from fedfew.core.model_set import assign_tensors_, flatten_tensors, has_batch_norm, state_tensors


def local_tensors(model: nn.Module, local_affine: bool = True) -> list[torch.Tensor]:
    """The BatchNorm part of ``model`` a FedBN client keeps: each BatchNorm layer's running
    statistics and counter, and (``local_affine``) its weight and bias, in
    :func:`fedfew.core.model_set.state_tensors` order."""
    local = set()
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            local.update(id(b) for b in m.buffers(recurse=False))
            if local_affine:
                local.update(id(p) for p in m.parameters(recurse=False))
    return [t for t in state_tensors(model) if id(t) in local]


def shared_tensors(model: nn.Module, local_affine: bool = True) -> list[torch.Tensor]:
    """Every state tensor of ``model`` outside :func:`local_tensors` (what FedBN averages)."""
    local = {id(t) for t in local_tensors(model, local_affine)}
    return [t for t in state_tensors(model) if id(t) not in local]


@ALGORITHMS.register("fedbn")
class FedBN(FedAvg):
    """FedAvg with client-local BatchNorm layers (host state ``bn``).

    Raises:
        ValueError: the model has no BatchNorm layer (FedBN would be FedAvg).
    """

    key_rules = {"local_affine": "true | false (keep the BatchNorm weight and bias local too)"}

    def __init__(self, cfg: DictConfig, ctx: Context) -> None:
        super().__init__(cfg, ctx)
        if not has_batch_norm(ctx.module.working):
            raise ValueError(f"algorithm=fedbn needs a model with BatchNorm layers; model {ctx.cfg.model.name} has "
                             "none: use model.norm=batch (mlp, cnn) or model=resnet18, or algorithm=fedavg")
        self.local_affine = bool(cfg.get("local_affine", True))

    @classmethod
    def communication(cls, cfg: DictConfig, model: nn.Module) -> tuple[int, int]:
        shared = sum(t.numel() for t in shared_tensors(model, bool(cfg.get("local_affine", True))))
        return shared, shared  # the BatchNorm part never leaves the client

    def averaged(self, model: nn.Module) -> list[torch.Tensor]:
        return shared_tensors(model, self.local_affine)

    def _load(self, client: ClientSplit) -> None:
        """The global model, with the client's own BatchNorm part when it has one, into the working copy."""
        self.ctx.module.load_working(0)
        own = self.load_client(client.id, "bn")
        if own is not None:
            assign_tensors_(local_tensors(self.ctx.module.working, self.local_affine), own)

    def client_update(self, client: ClientSplit, rnd: int) -> dict[str, torch.Tensor]:
        self._load(client)
        loss = self.local_train(client, rnd, None, stream=0)  # FedAvg's seed stream
        own = flatten_tensors(local_tensors(self.ctx.module.working, self.local_affine))
        # a client whose model is not finite is left out and keeps its previous BatchNorm part
        if self.contribute(0, client) and bool(torch.isfinite(own).all()):
            self.save_client(client.id, bn=own)
        return {"loss": loss_row(loss)}

    def candidates(self, client: ClientSplit) -> list[nn.Module]:
        self._load(client)
        return [self.ctx.module.working]
