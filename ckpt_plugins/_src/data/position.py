"""A data position as checkpoint items, shared by every loader integration (`DataState`, the HF
Trainer's): the epoch, what fixes its order, the positions still to come when the current layout
started, its rank count (replicated objects), and how many samples each rank took (a tensor with
one element per rank). Any layout loads it: the remaining positions are dealt anew.
"""
from __future__ import annotations

import logging
from dataclasses import asdict
from typing import Callable, List, Optional

import torch

from ..errors import DataChangedError, LoadMismatchError
from ..format import Metadata
from ..fragment import Fragment
from ..state import LoadItems, SaveItems
from .stream import Cursor, Order, after

log = logging.getLogger("ckpt_plugins")


def position_items(prefix: str, epoch: int, order: Order, world: int, rank: int, remaining: Optional[List[int]],
                   taken: int) -> SaveItems:
    """Rank `rank` of a layout of `world` ranks dealing `remaining` (None: the whole epoch, stored
    without listing it) took `taken` samples."""
    cursor = Cursor(0) if remaining is None else Cursor.of(remaining, order.length)
    return SaveItems(
        objects={f"{prefix}/position": {"epoch": int(epoch), "order": asdict(order), "world": int(world),
                                        "cursor": asdict(cursor)}},
        fragments=[Fragment(f"{prefix}/taken", (world,), torch.int64, (rank,),
                            torch.tensor([taken], dtype=torch.int64))])


def load_position(prefix: str, metadata: Metadata, order: Order, restart_epoch: bool,
                  loaded: Callable[[int, Optional[List[int]]], None]) -> LoadItems:
    """Items that load a stored position for a loader whose order is now `order`, then call
    `loaded(epoch, remaining positions)` (None: the whole epoch, when the data changed and
    `restart_epoch` allows it). Another dataset is refused before any data moves."""
    key, objects = f"{prefix}/taken", f"{prefix}/position"
    if key not in metadata.tensors or objects not in metadata.objects:
        raise LoadMismatchError(f"the checkpoint holds no data loader state under {prefix!r}")
    taken = torch.zeros(metadata.tensors[key].shape, dtype=torch.int64)
    saved: dict = {}
    items = LoadItems(fragments=[Fragment(key, tuple(taken.shape), torch.int64, (0,), taken, recomputed=True)],
                      objects={objects: saved.update})

    def check(read) -> None:
        position = read(objects)
        changes = order.changes(Order(**position["order"]))
        if changes and not restart_epoch:
            raise DataChangedError(
                "the data loader's data changed since the checkpoint: " + ", ".join(
                    f"{name} {was!r} -> {now!r}" for name, (was, now) in changes.items()) +
                ". Its position cannot be resumed; pass restart_epoch=True to start epoch "
                f"{position['epoch']} again on the new data")

    def finish() -> None:
        epoch = int(saved["epoch"])
        if order.changes(Order(**saved["order"])):
            log.warning("data loader: the data changed since the checkpoint; epoch %d starts again", epoch)
            return loaded(epoch, None)
        before = Cursor(**saved["cursor"]).remaining(order.length)
        loaded(epoch, after(before, int(saved["world"]), order.drop_last, taken.tolist()))

    items.checks.append(check)
    items.finish.append(finish)
    return items
