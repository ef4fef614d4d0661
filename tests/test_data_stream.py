"""The global sample stream's arithmetic (pure): DistributedSampler's dealing, and resuming it at
another data-parallel size."""
from collections import Counter

import pytest
import torch

from ckpt_plugins._src.data.stream import Cursor, Order, after, epoch_order, share


@pytest.mark.parametrize("length,world,drop_last,shuffle", [
    (24, 4, False, True), (25, 4, False, True), (25, 4, True, True), (7, 3, False, False), (2, 3, False, True),
    (10, 6, True, False)])
def test_sharing_the_epoch_is_distributed_samplers_dealing(length, world, drop_last, shuffle):
    data = list(range(length))
    order = Order(length, seed=5, shuffle=shuffle, drop_last=drop_last)
    for epoch in (0, 3):
        positions = epoch_order(order, epoch)
        for rank in range(world):
            sampler = torch.utils.data.DistributedSampler(data, world, rank, shuffle=shuffle, seed=5,
                                                          drop_last=drop_last)
            sampler.set_epoch(epoch)
            assert [positions[p] for p in share(range(length), world, rank, drop_last)] == list(sampler)


def global_batches(remaining, world, per_rank, order):
    """Each step's samples over all ranks (a multiset) when `world` ranks take `per_rank` each."""
    shares = [share(remaining, world, r, False) for r in range(world)]
    steps = min(len(s) for s in shares) // per_rank
    return [Counter(order[p] for s in shares for p in s[i * per_rank:(i + 1) * per_rank]) for i in range(steps)]


@pytest.mark.parametrize("world", [2, 3, 6])
def test_a_resumed_layout_continues_the_same_global_batches(world):
    order = epoch_order(Order(96, seed=1), 0)
    full = global_batches(list(range(96)), 4, 3, order)  # DP 4, 3 per rank: global batch 12
    rest = after(list(range(96)), 4, False, [3 * 2] * 4)  # two steps taken
    assert rest == list(range(24, 96))
    assert global_batches(rest, world, 12 // world, order) == full[2:]


def test_uneven_counts_and_another_global_batch_consume_each_sample_once():
    remaining = list(range(30))
    rest = after(remaining, 4, False, [3, 2, 2, 1])  # ranks that took different counts
    taken = [p for r, n in enumerate([3, 2, 2, 1]) for p in share(remaining, 4, r, False)[:n]]
    assert sorted(taken + rest) == remaining and not set(taken) & set(rest)
    cursor = Cursor.of(rest, 30)
    assert cursor.remaining(30) == rest and cursor.next == 7 and cursor.done == [8]
    # the rest dealt to 3 ranks taking 4 each (another global batch), then to 2 taking all
    more = after(rest, 3, False, [4, 4, 4])
    final = [p for r in range(2) for p in share(more, 2, r, False)]
    consumed = taken + [p for r in range(3) for p in share(rest, 3, r, False)[:4]] + final
    assert sorted(consumed) == remaining  # every sample of the epoch exactly once


def test_order_changes_name_what_changed():
    assert Order(10, 1).changes(Order(12, 1)) == {"length": (12, 10)}
    assert Order(10, 1, True).changes(Order(10, 2, True)) == {"seed": (2, 1)}
