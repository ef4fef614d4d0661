"""The HF Trainer's training data as a global, reshardable position.

The Trainer deals one global order: accelerate gives each process every n-th batch of it, so a
step consumes the next `per_device_train_batch_size x processes x gradient_accumulation_steps`
samples of the epoch's order, whatever the process count. `EpochSampler` replaces the Trainer's
random sampler with one whose order is fixed by the seed and the epoch and which a resume can
start at any position of its epoch; `TrainerData` stores the position as `ckpt_plugins.data`
does (a layout of one global dealer), so a resume with another global batch or process count
consumes each sample of the epoch once, and a position saved by `DataState` in another framework
loads here too.
"""
from __future__ import annotations

from typing import Callable, List, Optional

import torch

from ckpt_plugins.data.position import load_position, position_items
from ckpt_plugins.data.stream import Order, epoch_order
from ckpt_plugins.format import Metadata
from ckpt_plugins.state import Handler, LoadItems, SaveItems


class EpochSampler(torch.utils.data.Sampler):
    """A random order seeded by `seed + epoch`; a resumed epoch deals only its remaining positions.
    `global_step()` tells where a pass over the data started (to count what it consumed)."""

    def __init__(self, length: int, seed: int, global_step: Callable[[], int]):
        self.order = Order(length, seed)
        self.global_step = global_step
        self.epoch, self.started = 0, 0
        self.resumed: Optional[tuple] = None  # (epoch, remaining positions) from a checkpoint

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def resumed_positions(self) -> Optional[List[int]]:
        """The positions this epoch's pass deals when it resumed one (None: the whole epoch)."""
        return self.resumed[1] if self.resumed is not None and self.resumed[0] == self.epoch else None

    def __iter__(self):
        self.started = self.global_step()
        order = epoch_order(self.order, self.epoch)
        positions = self.resumed_positions()
        return iter(order if positions is None else [order[p] for p in positions])

    def __len__(self) -> int:
        return self.order.length  # the Trainer's steps per epoch stay those of a whole epoch


class TrainerData(Handler):
    """The position of an `EpochSampler` in a Trainer whose steps each consume `global_batch()`."""

    def __init__(self, sampler: EpochSampler, global_batch: Callable[[], int]):
        self.sampler, self.global_batch = sampler, global_batch

    def save_items(self, prefix: str) -> SaveItems:
        s = self.sampler
        remaining = s.resumed_positions()
        dealt = s.order.length if remaining is None else len(remaining)
        taken = min(dealt, (s.global_step() - s.started) * self.global_batch())
        return position_items(prefix, s.epoch, s.order, 1, 0, remaining, taken)

    def load_items(self, prefix: str, metadata: Metadata) -> LoadItems:
        def loaded(epoch: int, remaining: Optional[List[int]]) -> None:
            self.sampler.resumed = (epoch, remaining)
            self.sampler.set_epoch(epoch)

        return load_position(prefix, metadata, self.sampler.order, False, loaded)
