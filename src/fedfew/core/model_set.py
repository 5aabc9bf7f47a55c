"""The K-model set: K server models plus one working copy for local training.

Only the K server models and one working model live on the device, whatever the number of
clients M: a client's local training loads server model k into the working copy (an
in-place copy, no deep copy), trains it, and returns the delta of its state.

A model's *state vector* (:func:`state_tensors`, :func:`flat_state`, :func:`assign_state_`) is
what the algorithms average, send and keep per client: the parameters, then the buffers that
are part of the model's learned state (BatchNorm's running_mean/running_var and its
``num_batches_tracked`` counter), in a fixed order. :func:`flat_parameters` stays for what is
about parameters only (proximal terms, distances, gradients, diagnostics). See docs/models.md
for the BatchNorm policy.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from fedfew.core.seeding import derive_seed

INITS = ("independent", "identical")

#: local optimizers by config value (``optim.name``); each gets ``lr`` and ``weight_decay``,
#: SGD also ``momentum``. A fresh optimizer is made for every local training, so Adam's
#: moments never carry over between rounds or clients.
OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "sgd": lambda params, lr, momentum, weight_decay: torch.optim.SGD(
        params, lr=lr, momentum=momentum, weight_decay=weight_decay),
    "adam": lambda params, lr, momentum, weight_decay: torch.optim.Adam(params, lr=lr, weight_decay=weight_decay),
    "adamw": lambda params, lr, momentum, weight_decay: torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay),
}

def clip_before_step(optimizer: torch.optim.Optimizer, clip_norm: float) -> torch.optim.Optimizer:
    """Make every ``optimizer.step()`` first scale the gradients of the parameters it updates
    so that their joint L2 norm is at most ``clip_norm`` (``torch.nn.utils.clip_grad_norm_``:
    a gradient of norm g > clip_norm is multiplied by clip_norm / (g + 1e-6); a smaller one is
    left as it is). The norm is over this optimizer's parameters only (APFL's two optimizers,
    FedRep's head optimizer clip separately), in float32 or wider, whatever the model's dtype.

    Args:
        optimizer: any torch optimizer; a step pre-hook is registered on it.
        clip_norm: the bound (> 0), in the units of the gradient (loss per parameter unit).
    Returns:
        ``optimizer`` itself.
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]

    def clip(_optimizer, _args, _kwargs) -> None:
        torch.nn.utils.clip_grad_norm_([p for p in params if p.grad is not None], clip_norm)

    optimizer.register_step_pre_hook(clip)
    return optimizer


#: local learning-rate schedules over rounds (``optim.schedule``): round r of R (1-based) uses
#: ``lr * factor(r, R, optim)``. ``exponential`` is PFLlib's ``learning_rate_decay`` (gamma per
#: round); ``cosine`` anneals from ``lr`` to ``optim.min_lr`` at the last round.
def _cosine(r: int, R: int, optim: Any) -> float:
    floor = float(optim.get("min_lr", 0.0)) / float(optim.lr)  # min_lr as a fraction of lr
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * (r - 1) / max(R - 1, 1)))


LR_SCHEDULES: dict[str, Callable[[int, int, Any], float]] = {
    "constant": lambda r, R, optim: 1.0,
    "exponential": lambda r, R, optim: float(optim.get("gamma", 0.99)) ** (r - 1),
    "cosine": _cosine,
}


def round_lr(optim: Any, rnd: int, rounds: int) -> float:
    """The local learning rate of round ``rnd`` (1-based) of ``rounds``.

    Args:
        optim: the ``optim`` config: ``lr`` (> 0), ``schedule`` (constant | exponential |
            cosine; default constant), ``gamma`` (exponential, per round), ``min_lr`` (cosine, the
            last round's lr, in [0, lr]), ``warmup_rounds`` (default 0: the first W rounds
            scale the schedule's lr by r / W, a linear warm-up).
    Returns:
        The learning rate (same units as ``optim.lr``); ``lr`` itself at round 1 without warm-up.
    Raises:
        ValueError: an unknown ``optim.schedule``.
    """
    name = str(optim.get("schedule", "constant"))
    if name not in LR_SCHEDULES:
        raise ValueError(f"optim.schedule={name!r}; allowed: {', '.join(LR_SCHEDULES)}")
    warmup = int(optim.get("warmup_rounds", 0))
    ramp = min(1.0, int(rnd) / warmup) if warmup > 0 else 1.0
    return float(optim.lr) * ramp * LR_SCHEDULES[name](int(rnd), int(rounds), optim)


def has_batch_norm(model: nn.Module) -> bool:
    """Whether ``model`` holds a BatchNorm layer (its train-mode output mixes the batch's samples)."""
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


#: the integer buffer BatchNorm counts its train-mode batches in
COUNTER = "num_batches_tracked"


def is_state_buffer(name: str, buffer: torch.Tensor) -> bool:
    """Whether buffer ``name`` belongs to the state vector: any floating-point buffer (BatchNorm's
    running statistics) and BatchNorm's integer ``num_batches_tracked`` counter."""
    return buffer.is_floating_point() or name.rsplit(".", 1)[-1] == COUNTER


def named_state(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of the state vector: ``named_parameters()`` in order, then the
    :func:`is_state_buffer` buffers in ``named_buffers()`` order (the tensors themselves)."""
    return [*module.named_parameters(), *((n, b) for n, b in module.named_buffers() if is_state_buffer(n, b))]


def state_tensors(module: nn.Module) -> list[torch.Tensor]:
    """The tensors of the state vector of ``module`` (see :func:`named_state`)."""
    return [t for _, t in named_state(module)]


def state_numel(module: nn.Module) -> int:
    """D, the length of ``module``'s state vector (= the parameter count d for a model without
    BatchNorm; each BatchNorm layer of C channels adds 2C + 1)."""
    return sum(t.numel() for t in state_tensors(module))


def flatten_tensors(tensors: list[torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
    """(D,) the tensors concatenated (a new, detached tensor) in ``dtype`` (default: the first
    floating-point tensor's dtype; integer counters are converted to it exactly below 2^24 in
    float32)."""
    if dtype is None:
        dtype = next((t.dtype for t in tensors if t.is_floating_point()), torch.float32)
    if not tensors:
        return torch.zeros(0, dtype=dtype)
    return torch.cat([t.detach().reshape(-1).to(dtype) for t in tensors])


def assign_tensors_(tensors: list[torch.Tensor], flat: torch.Tensor) -> None:
    """Write the (D,) vector ``flat`` into ``tensors`` in place (inverse of :func:`flatten_tensors`);
    integer tensors (counters) get the value rounded to the nearest integer.

    Raises:
        ValueError: ``flat`` does not have exactly sum of the tensors' numel entries.
    """
    total = sum(t.numel() for t in tensors)
    if flat.numel() != total:
        raise ValueError(f"flat vector has {flat.numel()} entries, the state has {total}")
    offset = 0
    with torch.no_grad():
        for t in tensors:
            n = t.numel()
            part = flat[offset : offset + n].view_as(t)
            t.copy_(part if t.is_floating_point() else part.round())
            offset += n


def flat_state(module: nn.Module) -> torch.Tensor:
    """(D,) the state vector of ``module``: parameters, then BatchNorm running statistics and
    counters (:func:`named_state`), in the parameters' dtype; a new, detached tensor."""
    return flatten_tensors(state_tensors(module))


def assign_state_(module: nn.Module, flat: torch.Tensor) -> None:
    """Write a (D,) state vector into ``module`` in place (inverse of :func:`flat_state`; the
    counters are rounded to integers).

    Raises:
        ValueError: wrong length.
    """
    assign_tensors_(state_tensors(module), flat)


def flat_parameters(module: nn.Module) -> torch.Tensor:
    """(d,) all parameters of ``module`` concatenated (a new tensor, detached)."""
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def assign_flat_(module: nn.Module, flat: torch.Tensor) -> None:
    """Write a (d,) vector into ``module``'s parameters in place (inverse of flat_parameters)."""
    offset = 0
    with torch.no_grad():
        for p in module.parameters():
            n = p.numel()
            p.copy_(flat[offset : offset + n].view_as(p))
            offset += n
    if offset != flat.numel():
        raise ValueError(f"flat vector has {flat.numel()} entries, module has {offset} parameters")


def unflatten_like(flat: torch.Tensor, module: nn.Module) -> list[torch.Tensor]:
    """Views of a (d,) vector shaped like ``module``'s parameters (in ``parameters()`` order),
    detached and cast to each parameter's dtype: e.g. the reference of a proximal term. A longer
    state vector (:func:`flat_state`) works too: its first d entries are the parameters."""
    out, offset = [], 0
    for p in module.parameters():
        out.append(flat[offset : offset + p.numel()].view_as(p).detach().to(p.dtype))
        offset += p.numel()
    return out


def copy_parameters_(dst: nn.Module, src: nn.Module) -> None:
    """Copy ``src``'s parameters and buffers into ``dst`` in place (same architecture)."""
    with torch.no_grad():
        for a, b in zip(dst.parameters(), src.parameters()):
            a.copy_(b)
        for a, b in zip(dst.buffers(), src.buffers()):
            a.copy_(b)


class KModelSet(nn.Module):
    """K server models (``models``, an ``nn.ModuleList``) and a working copy (``working``).

    Args:
        build_model: returns a fresh model (same architecture every call).
        K: number of server models, >= 1.
        init: ``"independent"`` (default: model k initialised from its own seeded stream
            ``derive_seed(seed, "init", k)``) or ``"identical"`` (every model a copy of model
            0, as the reference pgg3/FedFew does; only shuffling then breaks the symmetry).
        seed: base seed.
        lr: SGD learning rate (> 0), default 0.005 as in the reference.
        momentum: SGD momentum (default 0, the reference's; ignored by Adam/AdamW).
        weight_decay: weight decay (default 0).
        optimizer: local optimizer, a key of :data:`OPTIMIZERS` (``"sgd"``, the reference's,
            ``"adam"`` or ``"adamw"``).
        clip_norm: ``optim.clip_norm``: None (no clipping) or the largest L2 norm of the
            gradient an optimizer step may use (:func:`clip_before_step`); every optimizer
            :meth:`make_optimizer` builds clips, so every method's local steps do.
    Raises:
        ValueError: K < 1, an unknown ``init`` or an unknown ``optimizer``, ``clip_norm <= 0``.
    """

    def __init__(
        self,
        build_model: Callable[[], nn.Module],
        K: int,
        init: str = "independent",
        seed: int = 0,
        lr: float = 0.005,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        optimizer: str = "sgd",
        clip_norm: float | None = None,
    ) -> None:
        super().__init__()
        if clip_norm is not None and not clip_norm > 0:
            raise ValueError(f"optim.clip_norm must be null or a number > 0, got {clip_norm}")
        if K < 1:
            raise ValueError(f"algorithm.K must be >= 1, got {K}")
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"optim.name={optimizer!r}; allowed: {', '.join(OPTIMIZERS)}")
        if init not in INITS:
            raise ValueError(f"algorithm.init={init!r}; allowed: {', '.join(INITS)}")
        models = []
        for k in range(K):
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(derive_seed(seed, "init", 0 if init == "identical" else k))
                models.append(build_model())
        self.models = nn.ModuleList(models)
        #: original id of each model in ``models`` (0..K-1 at the start; :meth:`retire_` keeps the
        #: survivors' ids, so logs name a model the same way for the whole run)
        self.model_ids: list[int] = list(range(K))
        self.initial_K = K
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(seed, "init", "working"))
            self.working = build_model()
        self.lr, self.momentum, self.weight_decay = lr, momentum, weight_decay
        self.optimizer = optimizer
        self.clip_norm = None if clip_norm is None else float(clip_norm)

    @property
    def K(self) -> int:
        return len(self.models)

    def forward(self, x: torch.Tensor, k: int | None = None) -> torch.Tensor:
        """Logits (B, C) of server model ``k``, or of the working copy when ``k`` is None."""
        return (self.working if k is None else self.models[k])(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int = 0) -> torch.Tensor:
        """Mean cross-entropy of the working copy on one batch ((B, ...) inputs, (B,) labels)."""
        x, y = batch
        return F.cross_entropy(self.working(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """The local optimizer over the working copy's parameters (a fresh one per local training)."""
        return self.make_optimizer(self.working.parameters())

    def make_optimizer(self, params) -> torch.optim.Optimizer:
        """A fresh ``optim.name`` optimizer (lr, momentum, weight decay from the config) over
        ``params``; with ``clip_norm`` its every step first clips the gradient (:func:`clip_before_step`)."""
        optimizer = OPTIMIZERS[self.optimizer](params, self.lr, self.momentum, self.weight_decay)
        if self.clip_norm is not None:
            clip_before_step(optimizer, self.clip_norm)
        return optimizer

    def retire_(self, position: int) -> int:
        """Remove server model ``position`` (0..K-1) from the set (``algorithm.K=auto``); the
        later models move up one position and keep their ids. Returns the retired model's id.

        Raises:
            ValueError: the last model, or a position out of range.
        """
        if not 0 <= position < self.K or self.K == 1:
            raise ValueError(f"cannot retire model position {position} of a set of {self.K}")
        del self.models[position]
        return self.model_ids.pop(position)

    def keep_models_(self, model_ids: list[int]) -> None:
        """Shrink the set to the models with these original ids (their order in the set is
        kept), e.g. before loading a checkpoint of a run that retired models.

        Raises:
            ValueError: an id that is not in the set.
        """
        missing = [i for i in model_ids if i not in self.model_ids]
        if missing:
            raise ValueError(f"model ids {missing} are not in the set (ids {self.model_ids})")
        for position in reversed(range(self.K)):
            if self.model_ids[position] not in model_ids:
                self.retire_(position)

    def load_working(self, source: nn.Module | int) -> None:
        """Copy server model ``source`` (an index) or any same-shaped module into ``working``."""
        copy_parameters_(self.working, self.models[source] if isinstance(source, int) else source)
