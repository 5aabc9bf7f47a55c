"""What a client does in the baselines, apart from how the server aggregates.

- :class:`ClientTraining`: an :class:`~fedfew.algorithms.base.Algorithm` whose clients train a
  copy of a server model (or their own saved model) with the shared local loop
  (:func:`fedfew.core.local_training.train_local`), and keep personal state on the host.
  Methods with their own server step (Local, CFL, FedMGDA+, FedAMP, FedMTL) derive from it;
  the FedAvg-style ones derive from :class:`fedfew.algorithms._averaging.Averaging`, which adds
  the weighted average.
- :func:`proximal_term`: (coeff / 2) * ||theta - theta_ref||^2, gradient coeff * (theta - theta_ref)
  (FedProx's mu_prox, Ditto's lambda, FedAMP's and FedMTL's pulls).
- :func:`loss_row`: a client's "loss" row.

The module name starts with ``_`` so the algorithm registry does not treat it as a method.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from fedfew.algorithms.base import Algorithm
from fedfew.core.local_training import train_local
from fedfew.core.model_set import assign_state_
from fedfew.core.seeding import derive_seed
from fedfew.data.base import ClientSplit


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


class ClientTraining(Algorithm):
    """Client-side helpers: train the working copy on a client's data, load a client's saved model.

    A subclass writes ``client_update`` from :meth:`local_train` and :meth:`load_personal`, and
    its own ``begin_round`` / ``end_round`` (the server step).
    """

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
