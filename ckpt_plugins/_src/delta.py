"""Delta checkpoints: boxes stored as the XOR of their chunks with the same chunks of an earlier
committed checkpoint (their base), compressed; a chunk that did not change is not stored at all.

A save given `delta_from=` records the base (`DeltaRef`: where, the digest of its metadata, how
deep the chain is) and stores each box the base holds alike (same key, dtype and box) as a delta.
A read of a delta box reads the same chunks of the base's box (through the base's own base, down
the chain) and applies the deltas; checksums cover the bytes as loaded. A base that is missing or
changed since (its metadata differs) is refused, naming it. Chains are bounded: a save whose base
is already `max_chain` deep stores everything itself and starts a new chain.
"""
from __future__ import annotations

import logging
from typing import Dict, Optional, Tuple

from .base_ref import BaseRef, digest, relative, resolve
from .committed import read_metadata
from .format import DeltaRef, Metadata, StoredItem
from .storage import Storage, storage_for

log = logging.getLogger("ckpt_plugins")


class Base:
    """A delta checkpoint's base, opened and checked: reads any chunk of any of its boxes, bytes as
    loaded (its own deltas applied)."""

    def __init__(self, storage: Storage, metadata: Metadata):
        self.storage, self.metadata = storage, metadata
        self.below = opened(storage, metadata)  # its own base, when it is a delta too: checked now
        self._boxes: Dict[str, Dict[Tuple[tuple, tuple], StoredItem]] = {}  # per key, by where a box lies

    def box(self, key: str, offsets, lengths, nbytes: int) -> Optional[StoredItem]:
        """The stored box of `key` exactly at (`offsets`, `lengths`), of `nbytes`, if there is one
        (bytes are XORed as bytes: a dtype of the same width would do)."""
        boxes = self._boxes.get(key)
        if boxes is None:
            meta = self.metadata.tensors.get(key)
            boxes = self._boxes[key] = {} if meta is None else {
                (tuple(b.offsets), tuple(b.lengths)): b for b in meta.boxes}
        found = boxes.get((tuple(offsets), tuple(lengths)))
        return found if found is not None and found.nbytes == nbytes else None

    def chunk(self, key: str, box: StoredItem, k: int) -> bytearray:
        """Chunk `k` of the base's `box` of `key`, verified."""
        from .engine.read import read_checked
        chunk = self.metadata.chunk_bytes
        return read_checked(self.storage, key, box, k * chunk, min(box.nbytes, (k + 1) * chunk), chunk,
                            base=self.below)


def opened(storage: Storage, metadata: Metadata) -> Optional[Base]:
    """The base `metadata` (of the checkpoint in `storage`) is a delta against, and its chain down
    to a checkpoint that stores everything, each checked; cached on the metadata, which is
    read-only once decoded. None when it is no delta."""
    ref = metadata.delta
    if ref is None:
        return None
    base = getattr(metadata, "_base", None)
    if base is None:
        base_storage = resolve(storage, BaseRef(ref.path, ref.digest, []))
        base = Base(base_storage, read_metadata(base_storage))
        object.__setattr__(metadata, "_base", base)
    return base


def start(storage: Storage, base_path, max_chain: int) -> Tuple[Optional[Base], Optional[DeltaRef]]:
    """For a save to `storage` given `delta_from=base_path`: the base to XOR against and the
    reference to record, or (None, None) when the chain is already `max_chain` deep (then the save
    stores everything itself)."""
    base_storage = storage_for(base_path)
    metadata = read_metadata(base_storage)
    depth = (metadata.delta.depth if metadata.delta is not None else 0) + 1
    if depth > max_chain:
        log.info("%s: a delta on %s would make a chain of %d; storing everything instead (max_chain=%d)",
                 storage, base_path, depth, max_chain)
        return None, None
    if base_storage.identity == storage.identity:
        raise ValueError(f"delta_from names the checkpoint being saved ({storage}); a delta needs an earlier one")
    return Base(base_storage, metadata), DeltaRef(relative(storage, base_storage, base_path), digest(base_storage),
                                                  depth)


