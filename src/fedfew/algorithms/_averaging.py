"""FedAvg-style aggregation, shared by FedAvg, FedProx, IFCA, FedRep, Ditto, APFL, FedEM, FedSoft,
the oracle and FedBN.

- :class:`WeightedSum`: per server model k, the running sums sum_i c_i * delta_i and sum_i c_i
  over the clients that trained model k (c_i = n_i), combined across ranks by one all-reduce;
  the server then moves model k to the weighted mean of those clients' models, and a model
  that no client trained keeps its weights exactly. The deltas are state-vector deltas
  (:func:`fedfew.core.model_set.flat_state`): BatchNorm running statistics are averaged with the same
  weights as the parameters, the counters too (rounded back to integers).
- :func:`server_states`: the flat states the round's deltas are taken against.
- :class:`Averaging`: the "clients train from the broadcast model, the server averages" round
  that those methods share; a subclass writes :meth:`~Averaging.client_update` (from the client
  helpers of :class:`~fedfew.algorithms._client_training.ClientTraining`) and, when it keeps
  personal models, :meth:`~fedfew.algorithms.base.Algorithm.candidates`.

The module name starts with ``_`` so the algorithm registry does not treat it as a method.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from fedfew.algorithms._client_training import ClientTraining
from fedfew.algorithms.round_log import Kind
from fedfew.core.distributed import all_reduce_
from fedfew.core.model_set import assign_state_, assign_tensors_, flatten_tensors, state_tensors
from fedfew.data.base import ClientSplit


class WeightedSum:
    """Sample-weighted sums of client deltas for K slots (float64, on ``device``).

    Args:
        K: number of slots (server models).
        dim: length D of each delta (a state vector's, :func:`fedfew.core.model_set.flat_state`).
        device: where the sums live (the training device, so all-reduce works under NCCL).
    """

    def __init__(self, K: int, dim: int, device: torch.device | str = "cpu") -> None:
        self.acc = torch.zeros((K, dim), dtype=torch.float64, device=device)
        self.total = torch.zeros(K, dtype=torch.float64, device=device)

    def add(self, k: int, weight: float, delta: torch.Tensor) -> None:
        """Add ``weight * delta`` ((D,)) to slot k and ``weight`` to its total."""
        self.acc[k].add_(delta.to(self.acc.dtype), alpha=float(weight))
        self.total[k] += float(weight)

    def all_reduce_(self) -> "WeightedSum":
        """Sum the partial sums of every rank (identity on one process)."""
        all_reduce_(self.acc, "sum")
        all_reduce_(self.total, "sum")
        return self

    def apply_(self, targets: list[nn.Module | list[torch.Tensor]], base: list[torch.Tensor]) -> torch.Tensor:
        """Set ``targets[k]`` to ``base[k] + acc_k / total_k`` (the weighted mean of the clients'
        models) for every slot with a positive total; other slots are left untouched.

        Args:
            targets: per slot, a module (its whole state vector, :func:`fedfew.core.model_set.assign_state_`)
                or the list of tensors that were flattened into the deltas.
            base: per slot, the (D,) vector the deltas were taken against.
        Returns:
            (K,) float64 totals on the host (0 where no client contributed).
        """
        for k, target in enumerate(targets):
            if float(self.total[k]) > 0:
                mean_delta = (self.acc[k] / self.total[k]).to(base[k].dtype)
                if isinstance(target, nn.Module):
                    assign_state_(target, base[k] + mean_delta)
                else:
                    assign_tensors_(target, base[k] + mean_delta)
        return self.total.cpu()


def server_states(models: list[nn.Module], tensors_of: Callable[[nn.Module], list[torch.Tensor]] = state_tensors
                  ) -> list[torch.Tensor]:
    """Per server model, the flat vector of ``tensors_of(model)`` (default: its whole state vector,
    :func:`fedfew.core.model_set.state_tensors`): what the round's client deltas are taken against."""
    return [flatten_tensors(tensors_of(m)) for m in models]


class Averaging(ClientTraining):
    """Clients train from broadcast server models; the server moves each model to the
    n_i-weighted mean of the models of the clients that trained it (McMahan et al. 2017).

    Subclasses call :meth:`~fedfew.algorithms._client_training.ClientTraining.local_train` and
    :meth:`contribute` from ``client_update`` and
    return ``{"loss": (K,) row}``; :meth:`shared` picks the part of the model that is averaged
    (FedRep: the body) and :meth:`averaged` its tensors (default: the part's whole state vector,
    BatchNorm statistics included; FedBN leaves its BatchNorm layers out).
    """

    row_shapes = {"loss": lambda K: (K,)}
    #: the weight each server model's average got this round (sum of the n_i that trained it)
    log_keys = {**ClientTraining.log_keys, "weight_per_model": Kind.PER_MODEL}

    def shared(self, model: nn.Module) -> nn.Module:
        """The part of a model that the server averages (default: all of it)."""
        return model

    def averaged(self, model: nn.Module) -> list[torch.Tensor]:
        """The tensors of ``model`` that clients send and the server averages, in a fixed order:
        the state vector of :meth:`shared` (:func:`fedfew.core.model_set.state_tensors`: parameters, then
        BatchNorm running statistics and counters)."""
        return state_tensors(self.shared(model))

    def begin_round(self, rnd: int, participants: list[int]) -> None:
        module = self.ctx.module
        #: (D,) per server model: its averaged tensors at the start of the round, flat (once per
        #: round rather than once per client); the clients' deltas are taken against these
        self.broadcast = server_states(module.models, self.averaged)
        #: the round's running weighted sums of the deltas
        self.weighted_sum = WeightedSum(module.K, self.broadcast[0].numel(), device=self.ctx.fabric.device)

    def contribute(self, k: int, client: ClientSplit) -> bool:
        """Add the working copy (its :meth:`averaged` tensors) as the client's model for server
        model k, weighted by n_i. A non-finite model is reported to the run's non-finite log and left
        out (:mod:`fedfew.core.nonfinite`; FloatingPointError with ``fail_on_nonfinite``), as FedFew does; returns whether it
        was added."""
        delta = flatten_tensors(self.averaged(self.ctx.module.working)) - self.broadcast[k]
        what = "local model" if self.ctx.module.K == 1 else f"local copy of model {self.ctx.module.model_ids[k]}"
        if not self.ctx.finite_or_reported(client.id, delta, what):
            return False
        self.weighted_sum.add(k, float(self.ctx.num_train[client.id]), delta)
        return True

    def end_round(self, rnd: int, participants: list[int], rows: dict[str, torch.Tensor]) -> dict[str, Any]:
        self.weighted_sum.all_reduce_()
        totals = self.weighted_sum.apply_([self.averaged(m) for m in self.ctx.module.models], self.broadcast)
        self.weighted_sum, self.broadcast = None, []
        return {"loss": rows["loss"], "weight_per_model": totals}
