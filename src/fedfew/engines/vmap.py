"""``engine=vmap``: a chunk of clients' K local copies trained together with :mod:`torch.func`.

The R = C x K copies (C clients of a chunk, client-major) live in one stacked set of
parameters (R, *shape) per parameter tensor, allocated once and reused for every chunk (no
per-client copies of the model). Each step is one vectorised forward/backward::

    grads, losses = vmap(grad_and_value(loss_fn), randomness="different")(params, buffers, x, y, weight)

through ``functional_call`` on the working copy as a template, followed by one SGD step
(weight decay, momentum as ``torch.optim.SGD``) on the stacked parameters with ``_foreach``
ops. Batches are gathered by index from the device-resident data, (R, B) indices at a time.

Chunks (only on accelerators by default, see :meth:`VmapEngine.max_clients`): clients are
sorted by train size (largest first), so at step s the copies still training are a prefix of
the rows; the step runs on that prefix only (finished clients cost nothing) and a client whose
last batch is smaller than the step's width is padded with zero-weight samples.

BatchNorm: running statistics are functional buffers (R, ...) updated in place by the
vectorised forward, exactly as the loop engine updates its working copy, and their deltas are
part of each copy's state-vector delta (:func:`fedfew.core.model_set.state_tensors`); since zero-weight
padding would enter the batch statistics, clients of different sizes never share a chunk for
a model with BatchNorm, and a final batch of one sample is merged into the previous batch as in
``engine=loop`` (:func:`fedfew.core.local_training.batch_bounds`).

Random numbers (documented difference to ``engine=loop``): model k of a client is shuffled by
its own generator seeded with ``derive_seed(seed, "local", round, client, k)`` -- the same
seed the loop engine gives ``torch.manual_seed`` -- so for models without dropout both
engines visit identical batches and agree up to float rounding. Dropout masks come from the
global generator seeded once per chunk (from the chunk's seeds and client ids) and differ
per copy (``randomness="different"``); they are not the loop engine's masks, so with dropout
the engines agree in distribution only. Text batches are cut to the longest sequence of the
whole step (all copies), not of each copy's batch; TextCNN's max over time can see a few more
padding positions than with ``loop`` (a small, documented difference).
"""
from __future__ import annotations

from typing import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

from fedfew.engines import ENGINES
from fedfew.engines.base import ClientJob, ClientResult, Engine, has_batch_norm
from fedfew.core.local_training import batch_bounds
from fedfew.core.model_set import is_state_buffer, state_numel
from fedfew.core.seeding import derive_seed


def activation_bytes_per_sample(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes of the outputs of every leaf module for one sample of ``x`` (a rough measure of
    the activations autograd keeps), measured with forward hooks under ``no_grad``."""
    total = 0

    def hook(_module, _inputs, output):
        nonlocal total
        if isinstance(output, torch.Tensor):
            total += output.numel() * output.element_size()

    leaves = [m for m in model.modules() if not list(m.children())]
    handles = [m.register_forward_hook(hook) for m in leaves]
    was_training = model.training
    try:
        model.eval()
        with torch.no_grad():
            model(x)
    finally:
        model.train(was_training)
        for h in handles:
            h.remove()
    return max(1, total // max(1, len(x)))


@ENGINES.register("vmap")
class VmapEngine(Engine):
    """Stacked copies, one vectorised step per batch (see module docstring)."""

    name = "vmap"
    #: most clients in one chunk with ``engine_clients=auto`` on an accelerator
    MAX_AUTO_CLIENTS = 32
    #: share of the accelerator's free memory the stacked copies and their activations may use
    MEMORY_SHARE = 0.4

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        template = self.module.working
        self._names = [name for name, _ in template.named_parameters()]
        self._buffer_names = [name for name, _ in template.named_buffers()]
        #: the state vector's tensors as (stacked list, index): parameters, then the state buffers
        self._state = [("params", j) for j in range(len(self._names))] + [
            ("buffers", j) for j, (name, b) in enumerate(template.named_buffers()) if is_state_buffer(name, b)]
        self.dim = state_numel(template)
        #: BatchNorm: chunks only hold clients of equal size (no padding in batch statistics)
        self.exact_groups = has_batch_norm(template)
        if self.module.optimizer != "sgd":
            raise ValueError(f"engine=vmap implements SGD only, got optim.name={self.module.optimizer!r}; "
                             "use engine=loop for Adam/AdamW")
        self.momentum = float(self.module.momentum)
        self.weight_decay = float(self.module.weight_decay)
        self._rows = 0
        self._params: list[torch.Tensor] = []
        self._buffers: list[torch.Tensor] = []
        self._velocity: list[torch.Tensor] = []
        self._deltas = torch.empty(0)
        self._activation_bytes: int | None = None
        step = vmap(grad_and_value(self._loss), randomness="different")
        self._step = torch.compile(step, backend=self.compile) if self.compile is not None else step

    # -- the vectorised step ---------------------------------------------------------------

    def _loss(self, params, buffers, x, y, weight):
        """Weighted cross-entropy of one copy: sum_j weight_j * CE_j (weight = 1/b on the b
        real samples of the batch, 0 on padding), i.e. the batch-mean loss of ``loop``."""
        with self._autocast():
            logits = functional_call(self.module.working, (params, buffers), (x,))
        return (F.cross_entropy(logits.float(), y, reduction="none") * weight).sum()

    def _sgd_(self, rows: int, grads: list[torch.Tensor], first: bool) -> None:
        """``torch.optim.SGD``'s update (dampening 0, no Nesterov) on the first ``rows`` copies,
        each copy's gradient first clipped to ``optim.clip_norm`` as ``loop`` clips it
        (:func:`fedfew.core.model_set.clip_before_step`: scaled by clip / (norm + 1e-6) when its norm
        exceeds the bound)."""
        params = [p[:rows] for p in self._params]
        if self.module.clip_norm is not None:
            norms = torch.stack([g.reshape(rows, -1).float().pow(2).sum(dim=1) for g in grads]).sum(dim=0).sqrt()
            scale = (self.module.clip_norm / (norms + 1e-6)).clamp(max=1.0)
            grads = [g * scale.to(g.dtype).view(rows, *([1] * (g.dim() - 1))) for g in grads]
        if self.weight_decay:
            grads = torch._foreach_add(grads, params, alpha=self.weight_decay)
        if self.momentum:
            velocity = [v[:rows] for v in self._velocity]
            if first:  # torch's SGD starts the buffer at the first gradient
                torch._foreach_copy_(velocity, grads)
            else:
                torch._foreach_mul_(velocity, self.momentum)
                torch._foreach_add_(velocity, grads)
            grads = velocity
        torch._foreach_add_(params, grads, alpha=-float(self.module.lr))  # this round's lr

    # -- stacked state ------------------------------------------------------------------------

    def _ensure_rows(self, rows: int) -> None:
        """Grow the stacked parameters/buffers/velocity/deltas to ``rows`` copies (never shrinks)."""
        if rows <= self._rows:
            return
        template = self.module.working
        self._params = [torch.empty((rows, *p.shape), dtype=p.dtype, device=p.device) for p in template.parameters()]
        self._buffers = [torch.empty((rows, *b.shape), dtype=b.dtype, device=b.device) for b in template.buffers()]
        if self.momentum:
            self._velocity = [torch.empty_like(p) for p in self._params]
        first = next(template.parameters())
        self._deltas = torch.empty((rows, self.dim), dtype=first.dtype, device=first.device)
        self._rows = rows

    def _load(self, clients: int) -> None:
        """Copy server model k into copy (c, k) of every client c of the chunk."""
        K = self.K
        for k, model in enumerate(self.module.models):
            for dst, src in zip(self._params, model.parameters()):
                dst[: clients * K].view(clients, K, *src.shape)[:, k].copy_(src.detach())
            for dst, src in zip(self._buffers, model.buffers()):
                dst[: clients * K].view(clients, K, *src.shape)[:, k].copy_(src)

    def _write_deltas(self, clients: int) -> torch.Tensor:
        """(C*K, D) theta_ck(local) - theta_k of the state vectors in the reused delta buffer."""
        rows = clients * self.K
        out = self._deltas[:rows].view(clients, self.K, self.dim)
        server = [(list(m.parameters()), list(m.buffers())) for m in self.module.models]
        offset = 0
        for kind, j in self._state:
            stacked = (self._params if kind == "params" else self._buffers)[j]
            n = stacked[0].numel()
            block = out[..., offset : offset + n]
            block.copy_(stacked[:rows].view(clients, self.K, n))
            for k in range(self.K):
                block[:, k].sub_(server[k][0 if kind == "params" else 1][j].detach().reshape(-1))
            offset += n
        return self._deltas[:rows]

    # -- chunks --------------------------------------------------------------------------------

    def max_clients(self) -> int:
        """Clients trained together at most: ``engine_clients`` when set; with ``auto``, one on
        the CPU (a CPU step is compute-bound already) and, on an accelerator, as many as fit in
        :attr:`MEMORY_SHARE` of its free memory (parameters, gradients, velocity and deltas
        per copy plus an activation estimate), at most :attr:`MAX_AUTO_CLIENTS`."""
        if str(self.requested_clients).lower() != "auto":
            return max(1, int(self.requested_clients))
        device = next(self.module.working.parameters()).device
        if device.type != "cuda":
            return 1
        free, _total = torch.cuda.mem_get_info(device)
        per_copy = 4 * self.dim * 4 + 3 * self._activations() * self.batch_size
        return max(1, min(self.MAX_AUTO_CLIENTS, int(self.MEMORY_SHARE * free // per_copy) // self.K))

    def _activations(self) -> int:
        if self._activation_bytes is None:
            x, _ = self.data.batch(torch.arange(min(2, len(self.data.targets)), device=self.data.targets.device))
            self._activation_bytes = activation_bytes_per_sample(self.module.working, x)
        return self._activation_bytes

    def plan(self, sizes: dict[int, int]) -> list[list[int]]:
        """Chunks of at most :meth:`max_clients` clients, largest first (equal sizes only for
        BatchNorm models)."""
        limit = self.max_clients()
        chunks: list[list[int]] = []
        for c in sorted(sizes, key=lambda c: (-sizes[c], c)):
            last = chunks[-1] if chunks else None
            if last is None or len(last) >= limit or (self.exact_groups and sizes[last[0]] != sizes[c]):
                chunks.append([c])
            else:
                last.append(c)
        return chunks

    # -- training --------------------------------------------------------------------------------

    def _orders(self, jobs: Sequence[ClientJob], generators: list[torch.Generator], width: int) -> torch.Tensor:
        """(R, width) sample indices of one epoch: row (c, k) is client c's train indices in
        the order of a fresh permutation from generator (c, k) (:meth:`FederatedData.epoch_order`),
        padded with its first index."""
        K = self.K
        device = jobs[0].index.device
        orders = torch.empty((len(jobs) * K, width), dtype=torch.int64, device=device)
        for c, job in enumerate(jobs):
            n = job.index.numel()
            for k in range(K):
                r = c * K + k
                orders[r, :n] = self.data.epoch_order(job.index, self.batch_size, generators[r])
                orders[r, n:] = job.index[0]
        return orders

    def train(self, jobs: Sequence[ClientJob]) -> Iterator[ClientResult]:
        jobs = sorted(jobs, key=lambda j: (-j.index.numel(), j.client))
        if self.exact_groups and len({j.index.numel() for j in jobs}) > 1:
            raise ValueError("engine=vmap: a model with BatchNorm trains only clients of equal size together")
        K, C, B = self.K, len(jobs), self.batch_size
        R = C * K
        device = next(self.module.working.parameters()).device
        sizes = [j.index.numel() for j in jobs for _ in range(K)]  # rows, non-increasing
        if sizes[-1] < 1:
            raise ValueError("engine=vmap: a client without train samples")
        self._ensure_rows(R)
        generators = [torch.Generator(device=device).manual_seed(int(s)) for j in jobs for s in j.seeds]
        torch.manual_seed(derive_seed(jobs[0].seeds[0], "vmap-dropout", *[j.client for j in jobs]))
        template = self.module.working
        template.train()
        n_rows = torch.tensor(sizes, dtype=torch.float32, device=device)
        running = torch.zeros(R, dtype=torch.float32, device=device)
        with torch.no_grad():
            self._load(C)
            for v in self._velocity:
                v[:R].zero_()
            first = True
            for _ in range(self.epochs):
                orders = self._orders(jobs, generators, sizes[0])
                running.zero_()
                # BatchNorm: every row has the same size (exact groups), so one merged last batch fits all
                for start, end in batch_bounds(sizes[0], B, merge_single=self.exact_groups):
                    active = sum(1 for n in sizes if n > start)
                    width = end - start
                    counts = n_rows[:active].sub(start).clamp_(max=width)
                    if sizes[active - 1] - start >= width:  # every active copy has a full batch
                        weight = torch.full((active, width), 1.0 / width, device=device)
                    else:
                        real = torch.arange(width, device=device)[None, :] < counts[:, None]
                        weight = real / counts[:, None]
                    x, y = self.data.batch(orders[:active, start : start + width].reshape(-1))
                    x = x.reshape(active, width, *x.shape[1:])
                    y = y.reshape(active, width)
                    params = {name: p[:active] for name, p in zip(self._names, self._params)}
                    buffers = {name: b[:active] for name, b in zip(self._buffer_names, self._buffers)}
                    grads, loss = self._step(params, buffers, x, y, weight)
                    self._sgd_(active, [grads[name] for name in self._names], first)
                    first = False
                    running[:active] += loss.float() * counts
            deltas = self._write_deltas(C)
        losses = (running / n_rows).double().cpu()
        self._client_done()
        for c, job in enumerate(jobs):
            yield ClientResult(job.client, losses[c * K : (c + 1) * K], deltas[c * K : (c + 1) * K])

    def row_buffers(self, rows: int) -> dict[str, torch.Tensor]:
        """The first ``rows`` copies' buffers (e.g. BatchNorm running statistics) after
        :meth:`train` (for tests and inspection)."""
        return {name: b[:rows] for name, b in zip(self._buffer_names, self._buffers)}
