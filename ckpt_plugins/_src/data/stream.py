"""The global sample stream of one epoch, and how data-parallel ranks deal it (pure functions).

An epoch's order is what `torch.utils.data.DistributedSampler` draws: a permutation of the dataset
(seeded by seed + epoch) or the identity. Positions are indices into that order. A layout of
`world` ranks deals a sorted list of remaining positions the way DistributedSampler deals the whole
order: padded by repeating its start (or truncated, with drop_last) to a multiple of `world`, then
rank r takes every world-th entry from r. So ranks that each took j samples have consumed the
first j * world entries: a prefix, whatever `world` is, which is why the position reshards.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Sequence

import torch


@dataclass(frozen=True)
class Order:
    """What fixes an epoch's order: the dataset's length and the sampler's seed, shuffle, drop_last."""
    length: int
    seed: int = 0
    shuffle: bool = True
    drop_last: bool = False

    def changes(self, other: "Order") -> Dict[str, tuple]:
        """What differs from `other`, as {field: (other's, this one's)}."""
        return {name: (getattr(other, name), getattr(self, name)) for name in self.__dataclass_fields__
                if getattr(self, name) != getattr(other, name)}


def epoch_order(order: Order, epoch: int) -> List[int]:
    """The dataset indices of the epoch, in order (DistributedSampler's permutation)."""
    if not order.shuffle:
        return list(range(order.length))
    g = torch.Generator()
    g.manual_seed(order.seed + epoch)
    return torch.randperm(order.length, generator=g).tolist()


def dealt(remaining: Sequence[int], world: int, drop_last: bool) -> List[int]:
    """`remaining` padded (by repeating its start) or truncated to a multiple of `world`."""
    n = len(remaining)
    if drop_last:
        return list(remaining[:n // world * world])
    total = math.ceil(n / world) * world
    if n == 0:
        return []
    return (list(remaining) * math.ceil(total / n))[:total]


def share(remaining: Sequence[int], world: int, rank: int, drop_last: bool) -> List[int]:
    """The positions rank `rank` of `world` takes, in the order it takes them."""
    return dealt(remaining, world, drop_last)[rank::world]


def after(remaining: Sequence[int], world: int, drop_last: bool, taken: Sequence[int]) -> List[int]:
    """The positions still to come once rank r of `world` took `taken[r]` of its share."""
    if len(taken) != world:
        raise ValueError(f"{len(taken)} ranks' counts for a layout of {world} ranks")
    deal = dealt(remaining, world, drop_last)
    used = {deal[r + i * world] for r in range(world) for i in range(taken[r])}
    return [p for p in remaining if p not in used]


@dataclass
class Cursor:
    """A sorted list of remaining positions of an epoch of `length`, stored compactly: every
    position from `next` on except those in `done` (consumed out of turn: by ranks that took
    more than others)."""
    next: int
    done: List[int] = field(default_factory=list)

    @classmethod
    def of(cls, remaining: Sequence[int], length: int) -> "Cursor":
        if not remaining:
            return cls(length)
        kept = set(remaining)
        return cls(remaining[0], [p for p in range(remaining[0], length) if p not in kept])

    def remaining(self, length: int) -> List[int]:
        done = set(self.done)
        return [p for p in range(self.next, length) if p not in done]
