"""Synthetic federated data of the real shapes: CIFAR-10-shaped images and AG-News-shaped texts
(speed and memory do not depend on the values)."""
from __future__ import annotations

import functools

CIFAR_POOL = 60_000           # CIFAR-10 train + test
CIFAR_TEST_FRACTION = 0.25    # our partitions' default held-out share


def _client_bounds(pool: int, num_clients: int, sizes=None):
    """(M + 1,) boundaries of consecutive client blocks: an even split of ``pool``, or the
    given per-client ``sizes`` (cycled over the M clients; ``pool`` is then their sum)."""
    import numpy as np

    if sizes is None:
        return np.linspace(0, pool, num_clients + 1).astype(np.int64)
    per_client = [int(sizes[i % len(sizes)]) for i in range(num_clients)]
    return np.concatenate([[0], np.cumsum(per_client)]).astype(np.int64)


@functools.lru_cache(maxsize=2)
def _random_pool(pool: int, shape: tuple[int, ...], classes: int, seed: int):
    """(pool, *shape) standard-normal inputs and (pool,) labels, drawn once per process for each
    setting (the gpu-check's cases share one 60,000-image pool instead of drawing it a dozen
    times); the tensors are read, never written."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randn((pool, *shape), generator=g), torch.randint(0, classes, (pool,), generator=g)


def synthetic_images(pool: int, num_clients: int, seed: int = 0, shape=(3, 32, 32), classes: int = 10,
                     sizes=None):
    """CIFAR-10-shaped :class:`FederatedData`: ``pool`` random images split evenly among the
    clients (a quarter of each client held out for testing).

    Args:
        sizes: optional per-client sample counts (cycled over the clients; each >= 2) instead
            of the even split; ``pool`` is then ignored.
    """
    import numpy as np

    from fedfew.data.base import ClientSplit, FederatedData

    bounds = _client_bounds(pool, num_clients, sizes)
    pool = int(bounds[-1])
    inputs, targets = _random_pool(pool, tuple(shape), classes, seed)
    clients = []
    for i in range(num_clients):
        ids = np.arange(bounds[i], bounds[i + 1], dtype=np.int64)
        n_test = max(1, int(round(len(ids) * CIFAR_TEST_FRACTION)))
        clients.append(ClientSplit(i, train=ids[n_test:], test=ids[:n_test]))
    return FederatedData(inputs=inputs, targets=targets, num_classes=classes, clients=clients,
                         partition_hash=f"synthetic-{pool}-{num_clients}-{seed}", name="synthetic-cifar10")


def synthetic_texts(num_clients: int, per_client: int = 480, vocab: int = 23_868, seed: int = 0,
                    length: int | None = None, sizes=None):
    """AG-News-shaped texts (token ids, lengths ~ 44 +- 15 up to 200) when the real files are absent.

    Args:
        length: every text exactly this many tokens (no padding; ``inputs`` is (N, length))
            instead of the AG-News-like lengths.
        sizes: optional per-client sample counts (cycled over the clients) instead of
            ``per_client`` each.
    """
    import numpy as np
    import torch

    from fedfew.data.base import ClientSplit, FederatedData

    bounds = _client_bounds(num_clients * per_client, num_clients, sizes if sizes is not None else [per_client])
    n = int(bounds[-1])
    g = torch.Generator().manual_seed(seed)
    if length is None:
        lengths = (torch.randn(n, generator=g) * 15 + 44).round().clamp(8, 200).long()
        inputs = torch.randint(2, vocab, (n, 200), generator=g)
        inputs[torch.arange(200)[None, :] >= lengths[:, None]] = 0
    else:
        lengths = torch.full((n,), int(length), dtype=torch.long)
        inputs = torch.randint(2, vocab, (n, int(length)), generator=g)
    targets = torch.randint(0, 4, (n,), generator=g)
    clients = []
    for i in range(num_clients):
        ids = np.arange(bounds[i], bounds[i + 1], dtype=np.int64)
        n_test = len(ids) // 4
        clients.append(ClientSplit(i, train=ids[n_test:], test=ids[:n_test]))
    return FederatedData(inputs=inputs, targets=targets, num_classes=4, clients=clients, lengths=lengths,
                         vocab_size=vocab, partition_hash=f"synthetic-text-{n}-{length}", name="synthetic-agnews")
