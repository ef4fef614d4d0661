"""A data loader's progress as global, reshardable training state.

    data = DataState(loader)                 # loader: a DataLoader / StatefulDataLoader with a DistributedSampler
    for epoch in range(data.epoch, epochs):
        data.set_epoch(epoch)
        for batch in data:                   # instead of `for batch in loader`
            ...
    cp.save(path, {"model": model, "optim": opt, "data": data})
    cp.load(path, {"model": model, "optim": opt, "data": data})   # at any data-parallel size

What is stored is global: the epoch, what fixes its order (dataset length, seed, shuffle,
drop_last), the positions of that order still to come when this layout started, its rank count,
and how many samples each rank took (a tensor, one element per rank). With a `TokenPacker`, each
rank's tokens taken from the loader but not packed yet are stored as tensors too. A load at another
rank count deals the remaining positions anew (`stream`) and splits the pending tokens, in rank
order, into one contiguous share per new rank: nothing is lost or repeated. Samples a loader
prefetched (workers, prefetch_factor) but did not yield are not counted, and are fetched again.
"""
from __future__ import annotations

from typing import Any, Iterator, List, Optional

import torch

from ..errors import LoadMismatchError
from ..format import Metadata
from ..fragment import Fragment
from ..state import Handler, LoadItems, SaveItems
from .packing import TokenPacker
from .position import load_position, position_items
from .stream import Order, epoch_order, share


class _Resumable(torch.utils.data.Sampler):
    """The loader's own sampler, except while `once` holds the indices of a resumed epoch (set for
    one iteration of the loader: its iterator may ask more than once, as worker loaders do)."""

    def __init__(self, sampler):
        self.sampler, self.once = sampler, None

    def __iter__(self):
        return iter(self.once) if self.once is not None else iter(self.sampler)

    def __len__(self) -> int:
        return len(self.once) if self.once is not None else len(self.sampler)

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)


def _distributed_sampler(loader):
    batch_sampler = getattr(loader, "batch_sampler", None)
    sampler = getattr(batch_sampler, "sampler", None)
    if isinstance(sampler, _Resumable):
        return batch_sampler, sampler.sampler
    if not isinstance(sampler, torch.utils.data.DistributedSampler) or not getattr(batch_sampler, "batch_size", None):
        raise TypeError("DataState needs a loader that batches (batch_size set) over a map-style dataset with a "
                        f"torch.utils.data.DistributedSampler; this one samples with {type(sampler).__name__}")
    return batch_sampler, sampler


class DataState(Handler):
    """See the module docstring. `restart_epoch=True`: a checkpoint whose data no longer matches
    the loader's (another dataset length, seed, shuffle or drop_last) restarts its epoch instead of
    being refused."""

    def __init__(self, loader, packer: Optional[TokenPacker] = None, *, restart_epoch: bool = False):
        self.loader, self.packer, self.restart_epoch = loader, packer, restart_epoch
        self._batch_sampler, self.sampler = _distributed_sampler(loader)
        if not isinstance(self._batch_sampler.sampler, _Resumable):
            self._batch_sampler.sampler = _Resumable(self.sampler)  # installed once; passes through until a load
        self._resumable = self._batch_sampler.sampler
        self.epoch = self.sampler.epoch
        self.remaining: Optional[List[int]] = None  # positions this layout deals; None: the whole epoch
        self.taken = 0  # samples this rank took from its share of `remaining`
        self._finished = False

    @property
    def order(self) -> Order:
        s = self.sampler
        return Order(len(s.dataset), int(s.seed), bool(s.shuffle), bool(s.drop_last))

    def set_epoch(self, epoch: int) -> None:
        """Start epoch `epoch` (unless it is the one a load resumed)."""
        self.sampler.set_epoch(epoch)

    # ------------------------------------------------------------ iterating

    def __iter__(self) -> Iterator[Any]:
        s = self.sampler
        if s.epoch != self.epoch or self._finished:  # a new epoch, or the same one again once it ended
            self.epoch, self.remaining, self.taken, self._finished = s.epoch, None, 0, False
        count = len(s)  # samples this pass deals: every batch holds batch_size of them but the last
        if self.remaining is not None or self.taken:  # resumed, or an iteration broken off: go on
            positions = share(self._remaining(), s.num_replicas, s.rank, s.drop_last)[self.taken:]
            order = epoch_order(self.order, self.epoch)
            self._resumable.once = [order[p] for p in positions]
            count = len(positions)
        end, size = self.taken + count, self._batch_sampler.batch_size
        try:
            for batch in self.loader:
                self.taken = min(self.taken + size, end)
                if self.packer is None:
                    yield batch
                    continue
                self.packer.add(batch)
                while self.packer.ready():
                    yield self.packer.take()
            self._finished = True
        finally:
            self._resumable.once = None

    def _remaining(self) -> List[int]:
        return self.remaining if self.remaining is not None else list(range(self.order.length))

    # ------------------------------------------------------------ saving

    def save_items(self, prefix: str) -> SaveItems:
        s = self.sampler
        items = position_items(prefix, self.epoch, self.order, s.num_replicas, s.rank, self.remaining, self.taken)
        pending = self.packer.pending() if self.packer is not None else None
        if pending is not None and pending.numel():
            items.fragments.append(Fragment(f"{prefix}/pending/{s.rank}", (pending.numel(),), pending.dtype, (0,),
                                            pending.reshape(-1)))
        return items

    # ------------------------------------------------------------ loading

    def load_items(self, prefix: str, metadata: Metadata) -> LoadItems:
        # the pending tokens of every saved rank, in rank order, as one stream split evenly
        stored = sorted(((int(k.rsplit("/", 1)[1]), k) for k in metadata.tensors if k.startswith(f"{prefix}/pending/")))
        if stored and self.packer is None:
            raise LoadMismatchError(f"the checkpoint holds pending tokens of a sequence packer under {prefix!r}: "
                                    "pass the run's TokenPacker to DataState")
        lengths = [int(metadata.tensors[k].shape[0]) for _, k in stored]
        total, s = sum(lengths), self.sampler
        start, end = s.rank * total // s.num_replicas, (s.rank + 1) * total // s.num_replicas
        mine = torch.empty(end - start, dtype=self.packer.pending().dtype if self.packer is not None else torch.int64)
        fragments, accepted, at = [], set(), 0
        for (_, k), n in zip(stored, lengths):
            lo, hi = max(start, at), min(end, at + n)
            if lo < hi:
                fragments.append(Fragment(k, (n,), mine.dtype, (lo - at,), mine[lo - start:hi - start]))
            else:
                accepted.add(k)
            at += n

        def loaded(epoch: int, remaining: Optional[List[int]]) -> None:
            self.epoch, self.remaining, self.taken, self._finished = epoch, remaining, 0, False
            self.sampler.set_epoch(epoch)
            if self.packer is not None and remaining is not None:  # a restarted epoch drops the old data's tokens
                self.packer.restore(mine)

        items = load_position(prefix, metadata, self.order, self.restart_epoch, loaded)
        items.fragments += fragments
        items.accepted |= accepted
        return items
