"""Pieces shared by the averaging baselines (FedAvg, FedProx, IFCA, FedRep, Ditto, APFL).

- :class:`WeightedSum`: per server model k, the running sums sum_i c_i * delta_i and sum_i c_i
  over the clients that trained model k (c_i = n_i), combined across ranks by one all-reduce;
  the server then moves model k to the weighted mean of those clients' models, and a model
  that no client trained keeps its weights exactly. The deltas are state-vector deltas
  (:func:`fedfew.core.model_set.flat_state`): BatchNorm running statistics are averaged with the same
  weights as the parameters, the counters too (rounded back to integers).
- :func:`proximal_term`: (coeff / 2) * ||theta - theta_ref||^2, gradient coeff * (theta - theta_ref)
  (FedProx's mu_prox, Ditto's lambda).
- :class:`Averaging`: the "clients train from the broadcast model, the server averages" round
  that those methods share; a subclass writes :meth:`~Averaging.client_update` and, when it
  keeps personal models, :meth:`~fedfew.algorithms.base.Algorithm.candidates`.

The module name starts with ``_`` so the algorithm registry does not treat it as a method.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from fedfew.algorithms.base import Algorithm
from fedfew.algorithms.round_log import Kind
from fedfew.data.base import ClientSplit
from fedfew.core.distributed import all_reduce_
from fedfew.core.local_training import train_local
from fedfew.core.model_set import assign_state_, assign_tensors_, flatten_tensors, state_tensors
from fedfew.core.seeding import derive_seed


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


def proximal_term(reference: list[torch.Tensor], coeff: float) -> Callable[[nn.Module], torch.Tensor]:
    """penalty(model) = coeff / 2 * sum_p ||p - ref_p||^2; its gradient is coeff * (p - ref_p).

    Args:
        reference: detached tensors shaped like ``model.parameters()`` (the broadcast model).
        coeff: FedProx's mu_prox or Ditto's lambda (>= 0).
    """

    def penalty(model: nn.Module) -> torch.Tensor:
        total = sum(((p - r) ** 2).sum() for p, r in zip(model.parameters(), reference))
        return 0.5 * coeff * total

    return penalty


def loss_row(value: float | torch.Tensor) -> torch.Tensor:
    """A client's "loss" row as float64 (host)."""
    return torch.as_tensor(value, dtype=torch.float64).reshape(-1).cpu()


class Averaging(Algorithm):
    """Clients train from broadcast server models; the server moves each model to the
    n_i-weighted mean of the models of the clients that trained it (McMahan et al. 2017).

    Subclasses call :meth:`local_train` and :meth:`contribute` from ``client_update`` and
    return ``{"loss": (K,) row}``; :meth:`shared` picks the part of the model that is averaged
    (FedRep: the body) and :meth:`averaged` its tensors (default: the part's whole state vector,
    BatchNorm statistics included; FedBN leaves its BatchNorm layers out).
    """

    row_shapes = {"loss": lambda K: (K,)}
    #: the weight each server model's average got this round (sum of the n_i that trained it)
    log_keys = {**Algorithm.log_keys, "weight_per_model": Kind.PER_MODEL}

    #: True for methods with per-client host state (personal models, heads); that state stays
    #: on the process that owns the client (the round loop never moves a client)
    client_state: bool = False

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
        # flat averaged state of the server models, once per round rather than once per client
        self._server = [flatten_tensors(self.averaged(m)) for m in module.models]
        self._sum = WeightedSum(module.K, self._server[0].numel(), device=self.ctx.fabric.device)

    def local_train(
        self, client: ClientSplit, rnd: int, k: int | None, *, epochs: int | None = None,
        penalty: Callable[[nn.Module], torch.Tensor] | None = None, stream: Any = None,
    ) -> float:
        """Train ``module.working`` on the client's train split; returns its running loss.

        Args:
            client, rnd: the client and the round (for the seed).
            k: server model to start from (loaded into the working copy); None: keep what
                the working copy holds (a personal model loaded by the caller).
            epochs: local epochs (default ``local_epochs``, the shared budget).
            penalty: extra loss term (proximal terms).
            stream: extra name for the shuffling/dropout seed, so two trainings of the same
                client in one round draw independent streams (default: k, as FedFew's).
        """
        ctx, run = self.ctx, self.ctx.cfg
        if k is not None:
            ctx.module.load_working(k)
        return train_local(
            ctx.module, ctx.data, ctx.train_index[client.id],
            int(run.local_epochs if epochs is None else epochs), int(run.dataset.batch_size),
            seed=derive_seed(run.seed, "local", rnd, client.id, k if stream is None else stream),
            penalty=penalty, autocast=ctx.autocast,
        )

    def contribute(self, k: int, client: ClientSplit) -> bool:
        """Add the working copy (its :meth:`averaged` tensors) as the client's model for server
        model k, weighted by n_i. A non-finite model is reported to the run's non-finite log and left
        out (:mod:`fedfew.core.nonfinite`; FloatingPointError with ``fail_on_nonfinite``), as FedFew does; returns whether it
        was added."""
        delta = flatten_tensors(self.averaged(self.ctx.module.working)) - self._server[k]
        what = "local model" if self.ctx.module.K == 1 else f"local copy of model {self.ctx.module.model_ids[k]}"
        if not self.ctx.finite_or_reported(client.id, delta, what):
            return False
        self._sum.add(k, float(self.ctx.num_train[client.id]), delta)
        return True

    def end_round(self, rnd: int, participants: list[int], rows: dict[str, torch.Tensor]) -> dict[str, Any]:
        self._sum.all_reduce_()
        totals = self._sum.apply_([self.averaged(m) for m in self.ctx.module.models], self._server)
        self._sum, self._server = None, []
        return {"loss": rows["loss"], "weight_per_model": totals}

    def load_personal(self, client: ClientSplit, name: str = "model", k: int = 0) -> bool:
        """Load the client's saved state vector ``name`` (:func:`fedfew.core.model_set.flat_state`:
        parameters and its own BatchNorm statistics) into the working copy, or server model k
        when it has none yet; returns whether a saved copy existed."""
        self.ctx.module.load_working(k)  # other buffers (if any) and the fallback state
        saved = self.load_client(client.id, name)
        if saved is None:
            return False
        assign_state_(self.ctx.module.working, saved)
        return True
