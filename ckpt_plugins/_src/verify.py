"""A verified load (`load(..., verify=True)`): proof that the live state is what was loaded.

Checksums at read time prove the bytes read are the bytes written. They do not prove the state in
memory after a resume is that state: a handler may fill a box its save would not describe, fill a
temporary the framework never adopts, or a finish step (the framework's own post-load code) may
cast or replace what landed. So each rank takes the checksums of every destination the load filled:
the checkpoint's own chunk checksums where a destination is exactly one stored box (a resume in
the same layout), else the CRC32C of what landed, taken right after the data landed (the engine
checked those bytes against the stored checksums). Once every finish step has run, it compares each
with the same region of its live tensors as a save would describe them (the handlers'
`save_items`), in canonical coordinates: whatever the layout change, the two descriptions must
agree, region for region and byte for byte.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import crc32c
import torch

from .errors import VerificationError
from .format import chunk_checksums, dtype_name
from .fragment import Box, Fragment, intersect, sub_view


@dataclass(frozen=True)
class Filled:
    """One destination the load filled: its key, box, dtype, and the CRC32C of its bytes (row
    major): one per `chunk` bytes, or of them all when `chunk` is 0."""
    key: str
    offsets: tuple
    lengths: tuple
    dtype: torch.dtype
    crc: Tuple[int, ...]
    chunk: int = 0

    @property
    def box(self) -> Box:
        return self.offsets, self.lengths

    def where(self, rank: int) -> str:
        return f"{self.key}, box at {list(self.offsets)} of {list(self.lengths)}, rank {rank}"


def filled(fragments: Sequence[Fragment], metadata) -> List[Filled]:
    """What the load put in `fragments` (its destinations that the plan filled), as checksums."""
    out = []
    for f in fragments:
        box = (tuple(f.offsets), tuple(f.lengths))
        stored = _stored_box(metadata, f, box)
        out.append(Filled(f.key, *box, f.local.dtype, tuple(stored.crc32c), metadata.chunk_bytes) if stored
                   else Filled(f.key, *box, f.local.dtype, (_crc(f.local),)))
    return out


def _stored_box(metadata, f: Fragment, box: Box):
    """The stored box `f` is exactly, with checksums of the same bytes (same dtype, no transform,
    no other source the plan may have taken instead), or None."""
    key = metadata.aliases.get(f.key, f.key)
    meta = metadata.tensors.get(key)
    if f.sources or meta is None or meta.dtype != dtype_name(f.dtype) or key in getattr(metadata, "transforms", {}):
        return None
    return next((b for b in meta.boxes if b.crc32c and (tuple(b.offsets), tuple(b.lengths)) == box), None)


def check_live(loaded: Sequence[Filled], live: Sequence[Fragment], rank: int) -> int:
    """Compare what the load filled with the live state's fragments (`Handler.save_items`): every
    filled region the live state describes holds the same bytes, and every live region of a
    loaded key was filled. Returns the bytes compared; raises VerificationError naming the
    first disagreement (key, box, rank)."""
    by_key: Dict[str, List[Fragment]] = {}
    for frag in live:
        by_key.setdefault(frag.key, []).append(frag)
    checked = 0
    for f in loaded:
        mine = by_key.get(f.key)
        if not mine:  # not part of what a save would describe (a temporary the handler consumed, an alias)
            continue
        region = _assemble(f, mine)
        if region is None:
            raise VerificationError(f"{f.where(rank)}: the load filled this region but the live state does "
                                    f"not hold it there (it holds {_boxes(mine)}): a wrong box")
        if region.dtype != f.dtype:
            raise VerificationError(f"{f.where(rank)}: loaded as {f.dtype}, the live tensor is {region.dtype}")
        if (tuple(chunk_checksums(_bytes(region), f.chunk)) if f.chunk else (_crc(region),)) != f.crc:
            raise VerificationError(f"{f.where(rank)}: the live tensor differs from what the load put there "
                                    "(replaced, cast, or filled from another key since)")
        checked += region.numel() * region.element_size()
    boxes: Dict[str, List[Box]] = {}
    for f in loaded:
        boxes.setdefault(f.key, []).append(f.box)
    for key, frags in by_key.items():
        for frag in frags if key in boxes else ():
            box = (tuple(frag.offsets), tuple(frag.lengths))
            if _covered(box, boxes[key]) < math.prod(box[1]):
                raise VerificationError(f"{key}, box at {list(box[0])} of {list(box[1])}, rank {rank}: the live "
                                        "state holds this region but the load did not fill it: a wrong box")
    return checked


def _assemble(f: Filled, frags: Sequence[Fragment]):
    """The live bytes of `f`'s region, from the live fragments of its key; None where they do
    not cover it."""
    for frag in frags:
        if intersect(f.box, (tuple(frag.offsets), tuple(frag.lengths))) == f.box:
            return sub_view(frag.local, frag.offsets, f.box)
    out = torch.empty(f.lengths, dtype=f.dtype)
    if _covered(f.box, [(tuple(g.offsets), tuple(g.lengths)) for g in frags]) < math.prod(f.lengths):
        return None
    for frag in frags:
        part = intersect(f.box, (tuple(frag.offsets), tuple(frag.lengths)))
        if part is not None:
            sub_view(out, f.offsets, part).copy_(sub_view(frag.local, frag.offsets, part))
    return out


def _covered(box: Box, boxes: Sequence[Box]) -> int:
    """Elements of `box` inside `boxes` (which do not overlap one another)."""
    return sum(math.prod(part[1]) for b in boxes for part in [intersect(box, b)] if part is not None)


def _bytes(tensor: torch.Tensor):
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy() if flat.numel() else b""


def _crc(tensor: torch.Tensor) -> int:
    return crc32c.crc32c(_bytes(tensor))


def _boxes(frags: Sequence[Fragment]) -> str:
    return ", ".join(f"{list(f.offsets)} of {list(f.lengths)}" for f in frags[:4]) + (" ..." if len(frags) > 4 else "")
