"""The HF Trainer's training data as a global, reshardable position.

The Trainer deals one global order: accelerate gives each process every n-th batch of it, so a
step consumes the next `per_device_train_batch_size x processes x gradient_accumulation_steps`
samples of the epoch's order, whatever the process count. `EpochSampler` replaces the Trainer's
random sampler with one whose order is fixed by the seed and the epoch and which a resume can
start at any position of its epoch; `TrainerData` stores the position as `ckpt_plugins.DataState`
does (a layout of one global dealer), so a resume with another global batch or process count
consumes each sample of the epoch once, and a position saved by `DataState` in another framework
loads here too.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import torch

from ckpt_plugins.ext import Handler, LoadItems, Metadata, Order, SaveItems, epoch_order, load_position, position_items


class EpochSampler(torch.utils.data.Sampler):
    """A random order seeded by `seed + epoch`. A resumed epoch deals the samples it had consumed
    first, padded with placeholders to whole steps (the Trainer skips them all without loading
    them, as it skips a resumed epoch's first batches), then the samples still to come; with the
    global batch unchanged, that is the uninterrupted epoch's order. `global_step()` tells where a
    pass over the data started (to count what it consumed)."""

    def __init__(self, length: int, seed: int, global_step: Callable[[], int]):
        self.order = Order(length, seed)
        self.global_step = global_step
        self.epoch, self.started = 0, 0
        self.resumed: Optional[tuple] = None  # (epoch, remaining positions) from a checkpoint
        self.front = 0  # positions the Trainer skips at the start of the resumed epoch

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def resumed_positions(self) -> Optional[List[int]]:
        """The positions this epoch's pass deals when it resumed one (None: the whole epoch)."""
        return self.resumed[1] if self.resumed is not None and self.resumed[0] == self.epoch else None

    def resume_front(self, step_samples: int) -> Tuple[int, int]:
        """(the epoch to resume, how many samples the Trainer skips in it): the consumed ones,
        rounded up to whole steps of `step_samples`. A finished epoch resumes at the next."""
        epoch, remaining = self.resumed if self.resumed is not None else (self.epoch, None)
        if remaining is None:
            return epoch, 0
        if not remaining:
            self.resumed = None
            self.set_epoch(epoch + 1)
            return epoch + 1, 0
        consumed = self.order.length - len(remaining)
        self.front = -(-consumed // step_samples) * step_samples
        return epoch, self.front

    def __iter__(self):
        self.started = self.global_step()
        order = epoch_order(self.order, self.epoch)
        remaining = self.resumed_positions()
        if remaining is None:
            return iter(order)
        left = set(remaining)
        consumed = [order[p] for p in range(self.order.length) if p not in left]
        filler = [order[0]] * (self.front - len(consumed))  # skipped, never loaded
        return iter(consumed[:self.front] + filler + [order[p] for p in remaining])

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
