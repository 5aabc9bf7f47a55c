"""One client's data: cut from the federated data, written to its own data directory, read back.

A SuperNode holds the samples of one client only. :func:`cut` takes client ``i`` out of the
:class:`~fedfew.data.base.FederatedData` that :func:`fedfew.data.federated.build_federated_data`
builds from the run config (the partition is deterministic from the config and the seed), as a
:class:`Partition` whose tensors hold that client's samples only, in the order train, test,
validation; its :class:`~fedfew.data.base.ClientSplit` indexes them. :meth:`Partition.data` turns
it back into a ``FederatedData`` of M clients in which only client ``i`` holds samples, so every
algorithm indexes clients by their run-wide id as in the simulator, and a batch of local
positions is the same samples, in the same order, as the simulator's batch of pooled indices
(batches are drawn by position: :meth:`~fedfew.data.base.FederatedData.epoch_order`).

``python -m fedfew.flower.partitions --out DIR [hydra overrides]`` writes every client's
partition to ``DIR/client_<i>/partition.pt`` (:func:`export`), the data directory of SuperNode
``i`` (``flower-supernode --node-config "partition-id=i num-partitions=M data-dir=DIR/client_i"``);
:func:`load` reads it back and checks that it is the partition the node was started for.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from fedfew.core.run_folders import python_command
from fedfew.data.base import ClientSplit, FederatedData

#: the file in a client's data directory
PARTITION_FILE = "partition.pt"
FORMAT_VERSION = 1


class PartitionError(ValueError):
    """A client's data directory is missing or holds another partition than the node was started
    for; the message names the partition id and the data directory."""


def setup_of(cfg: DictConfig) -> dict[str, Any]:
    """The config keys that decide which samples each client holds (dataset, M, seed, partition)."""
    return {"dataset": str(cfg.dataset.name), "num_clients": int(cfg.num_clients), "seed": int(cfg.seed),
            "partition": OmegaConf.to_container(cfg.partition, resolve=True)}


@dataclass
class Partition:
    """The samples of client ``client_id`` of a run with ``num_clients`` clients.

    Attributes:
        client_id, num_clients: i and M.
        inputs: (n, ...) the client's inputs (float32 images/features, int64 token ids).
        targets: (n,) int64 labels. lengths: (n,) int64 text lengths, or None.
        n_train, n_test, n_val: sizes of the three splits (``inputs`` holds them in that order).
        group: the client's true group on a clustered partition, else None.
        num_classes, vocab_size, name, group_by_length: as in FederatedData.
        partition_hash, data_fingerprint: of the whole federation's partition and data (so the
            server can check that every node holds a piece of the same split).
        setup: :func:`setup_of` the config it was cut with.
    """

    client_id: int
    num_clients: int
    inputs: torch.Tensor
    targets: torch.Tensor
    lengths: torch.Tensor | None
    n_train: int
    n_test: int
    n_val: int
    group: int | None
    num_classes: int
    vocab_size: int | None
    name: str
    group_by_length: bool
    partition_hash: str
    data_fingerprint: str
    setup: dict[str, Any]

    def split(self) -> ClientSplit:
        """The client's split, as local positions into :attr:`inputs`."""
        a, b = self.n_train, self.n_train + self.n_test
        return ClientSplit(self.client_id, np.arange(a, dtype=np.int64), np.arange(a, b, dtype=np.int64),
                           np.arange(b, b + self.n_val, dtype=np.int64), self.group)

    def data(self) -> FederatedData:
        """FederatedData of M clients where client ``client_id`` holds this partition and every
        other client is empty (an algorithm indexes ``data.clients`` by run-wide id)."""
        empty = np.empty(0, dtype=np.int64)
        clients = [self.split() if c == self.client_id else ClientSplit(c, empty, empty)
                   for c in range(self.num_clients)]
        return FederatedData(inputs=self.inputs, targets=self.targets, num_classes=self.num_classes, clients=clients,
                             lengths=self.lengths, vocab_size=self.vocab_size, partition_hash=self.partition_hash,
                             data_fingerprint=self.data_fingerprint, name=self.name,
                             group_by_length=self.group_by_length)

    def describe(self) -> dict[str, Any]:
        """What the server learns about the client (the query reply): sizes, label counts of each
        split, group, input shape, classes, vocabulary, and the partition's hash and fingerprint."""
        def counts(lo: int, hi: int) -> list[int]:
            return torch.bincount(self.targets[lo:hi].long(), minlength=self.num_classes).tolist()

        a, b, c = self.n_train, self.n_train + self.n_test, self.n_train + self.n_test + self.n_val
        return {"client_id": self.client_id, "num_clients": self.num_clients, "n_train": self.n_train,
                "n_test": self.n_test, "n_val": self.n_val, "train_counts": counts(0, a), "test_counts": counts(a, b),
                "val_counts": counts(b, c), "group": -1 if self.group is None else int(self.group),
                "input_shape": list(self.inputs.shape[1:]), "num_classes": self.num_classes,
                "vocab_size": -1 if self.vocab_size is None else int(self.vocab_size), "name": self.name,
                "partition_hash": self.partition_hash, "data_fingerprint": self.data_fingerprint}


def cut(data: FederatedData, client_id: int, cfg: DictConfig) -> Partition:
    """Client ``client_id``'s :class:`Partition` of ``data`` (built from ``cfg``).

    Raises:
        PartitionError: ``client_id`` is not in ``[0, M)``.
    """
    M = data.num_clients
    if not 0 <= client_id < M:
        raise PartitionError(f"partition-id={client_id} is not a client of this run (num_clients={M}: ids 0..{M - 1})")
    c = data.clients[client_id]
    index = torch.as_tensor(np.concatenate([c.train, c.test, c.val]).astype(np.int64))
    inputs = data.inputs[index]
    if inputs.dtype == torch.uint8 and getattr(data, "mean", None) is not None:  # host-streamed images
        from fedfew.data.images import normalize

        inputs = normalize(inputs, data.mean, data.std)
    return Partition(client_id, M, inputs.clone(), data.targets[index].clone(),
                     None if data.lengths is None else data.lengths[index].clone(), len(c.train), len(c.test),
                     len(c.val), c.group, data.num_classes, data.vocab_size, data.name, data.group_by_length,
                     data.partition_hash, data.data_fingerprint, setup_of(cfg))


def save(partition: Partition, directory: Path) -> Path:
    """Write ``partition`` to ``directory/partition.pt`` (atomically); returns the file."""
    from fedfew.core.io import atomic_torch_save

    directory.mkdir(parents=True, exist_ok=True)
    path = directory / PARTITION_FILE
    atomic_torch_save(path, {"version": FORMAT_VERSION, **vars(partition)})
    return path


def export(cfg: DictConfig, out: Path) -> list[Path]:
    """Every client's partition of ``cfg`` to ``out/client_<i>/`` (:func:`save`); returns the folders."""
    from fedfew.data.federated import build_federated_data

    data = build_federated_data(cfg)
    folders = []
    for cid in range(data.num_clients):
        folder = Path(out) / f"client_{cid}"
        save(cut(data, cid, cfg), folder)
        folders.append(folder)
    return folders


def load(directory: str | Path, partition_id: int, num_partitions: int | None, cfg: DictConfig | None = None) -> Partition:
    """Read the partition in ``directory`` and check it is client ``partition_id`` of
    ``num_partitions`` (and, given the run config ``cfg``, of the same setup: :func:`setup_of`).

    Raises:
        PartitionError: the directory or its partition file is missing, or it holds another
            client, another number of clients or another setup; the message names the partition
            id and the directory.
    """
    directory = Path(directory).expanduser()
    where = f"SuperNode partition-id={partition_id}, data-dir={directory}"
    if not directory.is_dir():
        raise PartitionError(f"{where}: the data directory does not exist (write it with "
                             f"`{python_command('fedfew.flower.partitions')} --out <dir> <run overrides>`)")
    path = directory / PARTITION_FILE
    if not path.is_file():
        raise PartitionError(f"{where}: no {PARTITION_FILE} in the data directory")
    stored = torch.load(path, weights_only=True)
    stored.pop("version", None)
    part = Partition(**stored)
    if part.client_id != partition_id or (num_partitions is not None and part.num_clients != num_partitions):
        raise PartitionError(f"{where}: the data directory holds partition {part.client_id} of {part.num_clients}, "
                             f"not partition {partition_id} of {num_partitions} (wrong partition-id or data-dir)")
    if cfg is not None and part.setup != setup_of(cfg):
        raise PartitionError(f"{where}: the partition was cut for {json.dumps(part.setup, sort_keys=True)}, but the "
                             f"run is {json.dumps(setup_of(cfg), sort_keys=True)}; export it again for this run")
    return part


def main(argv: list[str] | None = None) -> None:
    """``python -m fedfew.flower.partitions --out DIR [hydra overrides]``: write every client's
    data directory (:func:`export`) for the run ``python -m fedfew.train <overrides>`` would make."""
    from fedfew.config.compose import compose

    parser = argparse.ArgumentParser(prog=python_command("fedfew.flower.partitions"), description=main.__doc__)
    parser.add_argument("--out", required=True, type=Path, help="folder for client_<i>/ (one per client)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as for make train")
    args = parser.parse_args(argv)
    folders = export(compose(args.overrides), args.out)
    print(f"wrote {len(folders)} client data directories under {args.out.resolve()}")


if __name__ == "__main__":
    sys.exit(main())
