"""Local-training engines: how a client's K local copies are trained in one round.

One module per engine; the module name is the config value (``engine=loop`` ->
``loop.py``). Each registers an :class:`~fedfew.engines.base.Engine` subclass with
:data:`ENGINES`:

- ``loop`` (default): the K models one after another through :func:`fedfew.core.local_training.train_local`,
  one working copy; bit-for-bit the simulator's reference behaviour.
- ``vmap``: the K copies of one client -- and, on a GPU, of several clients -- stacked and
  trained together with :mod:`torch.func` (one vectorised forward/backward per step, one SGD
  step on the stacked parameters). See :mod:`fedfew.engines.vmap` for its RNG scheme.

FedFew selects its engine with the top-level config key ``engine``; ``compile`` (false | true |
a backend name) wraps the local step in ``torch.compile``; the key ``engine_clients``
(``engine_clients=N`` on the command line; default ``auto``: one client at a time on the CPU,
as many as fit in a share of the free memory on a GPU) caps the clients the vmap engine trains
together. Chunks are planned over the cohort the round loop hands FedFew's ``train_clients``
(each process's own participants).

Which to use: on a GPU ``vmap`` (many small models per launch); on a CPU ``loop`` -- a CPU step
is compute-bound already, and vmap's grouped convolutions are no faster there (slower for
the 512-channel TextCNN, and much slower when other jobs share the cores).
"""
from fedfew.core.registry import Registry

ENGINES = Registry("engine", __name__)
