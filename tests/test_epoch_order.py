"""A local epoch's visiting order (:meth:`FederatedData.epoch_order`): a permutation of the
client's samples; with ``group_by_length`` its batches hold texts of neighbouring lengths."""
from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedfew.data.base import ClientSplit, FederatedData


def texts(lengths, group_by_length):
    lengths = torch.as_tensor(lengths, dtype=torch.int64)
    n = len(lengths)
    tokens = (torch.arange(1, lengths.max() + 1)[None, :] <= lengths[:, None]).long() * 7
    return FederatedData(inputs=tokens, targets=torch.zeros(n, dtype=torch.int64), num_classes=2,
                         clients=[ClientSplit(0, train=np.arange(n), test=np.arange(0))], lengths=lengths,
                         vocab_size=8, group_by_length=group_by_length)


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 60), min_size=1, max_size=90), batch_size=st.integers(1, 20),
       seed=st.integers(0, 2**31 - 1))
def test_grouped_order_is_a_permutation_of_length_blocks(lengths, batch_size, seed):
    data = texts(lengths, group_by_length=True)
    index = torch.arange(len(lengths))  # the client's indices (all samples)
    order = data.epoch_order(index, batch_size, torch.Generator().manual_seed(seed))
    assert sorted(order.tolist()) == index.tolist()  # every sample exactly once
    if len(lengths) <= batch_size:
        return
    sorted_lengths = sorted(lengths, reverse=True)
    full = len(lengths) // batch_size
    blocks = [sorted_lengths[b * batch_size:(b + 1) * batch_size] for b in range(full)]
    got = [sorted(data.lengths[order[b * batch_size:(b + 1) * batch_size]].tolist(), reverse=True) for b in range(full)]
    # each full batch is one block of the length-sorted client, in some order; the rest is last
    assert sorted(got) == sorted(blocks)
    assert sorted(data.lengths[order[full * batch_size:]].tolist(), reverse=True) == sorted_lengths[full * batch_size:]


def test_grouping_cuts_padding_by_hand():
    # lengths 1..8, batches of 2: grouped batches pad to (8,7),(6,5),(4,3),(2,1) -> 20 columns vs random
    data = texts(list(range(1, 9)), group_by_length=True)
    order = data.epoch_order(torch.arange(8), 2, torch.Generator().manual_seed(0))
    pairs = sorted(sorted(data.lengths[order[i:i + 2]].tolist()) for i in range(0, 8, 2))
    assert pairs == [[1, 2], [3, 4], [5, 6], [7, 8]]


def test_without_grouping_the_order_is_torch_randperm():
    """Off (the default) the order is exactly ``index[randperm(n)]``: runs without the option
    keep their results bit for bit."""
    data = texts([5, 1, 9, 3, 3, 7], group_by_length=False)
    index = torch.arange(6)
    got = data.epoch_order(index, 2, torch.Generator().manual_seed(3))
    assert torch.equal(got, index[torch.randperm(6, generator=torch.Generator().manual_seed(3))])
    # images/tabular data (no lengths) ignore the flag
    images = FederatedData(inputs=torch.zeros(6, 2), targets=torch.zeros(6, dtype=torch.int64), num_classes=2,
                           clients=[], group_by_length=True)
    assert torch.equal(images.epoch_order(index, 2, torch.Generator().manual_seed(3)), got)
