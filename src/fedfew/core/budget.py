"""What a run spends: parameters and bytes communicated, and local SGD steps.

Communication is counted per participating client per round from the algorithm's own
:meth:`fedfew.algorithms.base.Algorithm.communication` (parameter counts up and down: FedFew
K models down and K deltas up, IFCA 1 up and K down, FedRep the body, Local 0, ...) and
converted to bytes with the element size of the model's parameters (:func:`bytes_per_parameter`:
4 for float32). The number of participants per round is fixed by ``participation`` /
``clients_per_round`` (:func:`fedfew.simulator.simulation.select_participants` draws the same count every
round), so the bytes of round r are the same for every r and the cumulative bytes after r
rounds are r times them.

Local SGD steps are counted as they happen (:class:`StepCounter`: every ``optimizer.step()``
of local training, whatever the algorithm: FedFew's K local trainings, FedRep's head and body
epochs, Ditto's global and personal models, APFL's two models ...).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from omegaconf import DictConfig
from torch import nn


def bytes_per_parameter(model: nn.Module) -> float:
    """Bytes one parameter of ``model`` takes on the wire: its dtype's element size (4 for
    float32, 2 for bfloat16); for mixed dtypes the size-weighted mean.

    Raises:
        ValueError: the model has no parameters.
    """
    params = list(model.parameters())
    count = sum(p.numel() for p in params)
    if count == 0:
        raise ValueError("bytes_per_parameter: the model has no parameters")
    return sum(p.numel() * p.element_size() for p in params) / count


@dataclass(frozen=True)
class Communication:
    """Communication of one participating client in one round.

    Attributes:
        params_up, params_down: parameters sent to / received from the server (the
            algorithm's :meth:`~fedfew.algorithms.base.Algorithm.communication`).
        bytes_per_parameter: element size of the model's parameters (:func:`bytes_per_parameter`).
        bytes_up, bytes_down: ``params_* x bytes_per_parameter`` (rounded to whole bytes).
    """

    params_up: int
    params_down: int
    bytes_per_parameter: float
    bytes_up: int
    bytes_down: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def communication(algorithm: Any, cfg: DictConfig, model: nn.Module) -> Communication:
    """Parameters and bytes one participating client sends and receives per round.

    Args:
        algorithm: the algorithm class (``fedfew.algorithms.ALGORITHMS.get(name)``).
        cfg: its ``algorithm`` config node.
        model: one model of the run's architecture and dtype (for d, body/head sizes and the
            element size).
    """
    up, down = algorithm.communication(cfg, model)
    size = bytes_per_parameter(model)
    return Communication(int(up), int(down), size, int(round(int(up) * size)), int(round(int(down) * size)))


class StepCounter:
    """Counts every ``torch.optim.Optimizer.step()`` of this process while active (a global
    optimizer post-hook, :func:`torch.optim.optimizer.register_optimizer_step_post_hook`).

    Functional updates without an optimizer (the vmap engine) are not counted.

        with StepCounter() as steps:
            ...local training...
        steps.count
    """

    def __init__(self) -> None:
        self.count = 0
        self._handle = None

    def _hook(self, optimizer, args, kwargs) -> None:
        self.count += 1

    def __enter__(self) -> "StepCounter":
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self._handle = register_optimizer_step_post_hook(self._hook)
        return self

    def __exit__(self, *exc) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
