"""Fragments: the one description of a piece of training state that every framework maps onto.

A fragment is a regular n-D box of a canonical global tensor plus a view of the rank's memory
holding it. Irregular flat shards (ZeRO / FSDP1 / distributed-optimizer partitions) are
`FlatPiece`s of packed buffers and become a few boxes each (`flat_views`, `piece_fragments`);
padding is clipped away by `box_fragment`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import torch

Shape = Tuple[int, ...]
Box = Tuple[Shape, Shape]  # (offsets, lengths)


@dataclass
class Fragment:
    key: str
    global_shape: Shape
    dtype: torch.dtype
    offsets: Shape
    local: torch.Tensor  # shape == lengths; a view of the rank's memory
    # Load only: stored keys that may fill this fragment when `key` is absent or of another dtype
    # (model weights from fp32 masters, masters from fp32 weights), and whether a stored dtype
    # other than `dtype` may be converted on load.
    sources: Tuple[str, ...] = ()
    cast: bool = False
    # Load only: a finish step computes the live state from this memory rather than keeping it (a
    # data position dealt anew), so a verified load does not compare it with the live state.
    recomputed: bool = False

    @property
    def lengths(self) -> Shape:
        return tuple(self.local.shape)

    @property
    def nbytes(self) -> int:
        return self.local.numel() * self.local.element_size()


def box_fragment(key: str, global_shape: Sequence[int], offsets: Sequence[int],
                 local: torch.Tensor) -> Optional[Fragment]:
    """A fragment for `local` placed at `offsets`, clipped to `global_shape`.

    The part of `local` outside the global tensor (padded vocabulary, alignment padding) is
    never stored: the fragment's view is narrowed to the inside. Returns None when nothing
    of the box lies inside the tensor.
    """
    global_shape = tuple(int(s) for s in global_shape)
    offsets = tuple(int(o) for o in offsets)
    if len(offsets) != len(global_shape) or local.dim() != len(global_shape):
        raise ValueError(f"{key}: box of rank {local.dim()} at {offsets} does not fit a tensor of "
                         f"shape {global_shape}")
    view = local
    for d, (off, size) in enumerate(zip(offsets, global_shape)):
        if off < 0:
            raise ValueError(f"{key}: negative offset {off} in dim {d}")
        keep = min(view.shape[d], size - off)
        if keep <= 0:
            return None
        if keep != view.shape[d]:
            view = view.narrow(d, 0, keep)
    return Fragment(key, global_shape, local.dtype, offsets, view)


def flat_range_boxes(shape: Sequence[int], start: int, end: int) -> List[Box]:
    """Decompose elements [start, end) of a row-major tensor into regular boxes, in order.

    At most 2*ndim - 1 boxes: a partial first row, whole middle rows, a partial last row,
    recursively. Each box is contiguous in row-major order, so it is a view of a flat buffer.
    """
    shape = tuple(int(s) for s in shape)
    total = math.prod(shape)
    if not 0 <= start <= end <= total:
        raise ValueError(f"flat range [{start}, {end}) outside a tensor of {total} elements")
    return _boxes(shape, start, end)


def _boxes(shape: Shape, start: int, end: int) -> List[Box]:
    if start == end:
        return []
    if len(shape) <= 1:
        return [((start,), (end - start,))] if shape else [((), ())]
    inner = math.prod(shape[1:])
    first, col0 = divmod(start, inner)
    last, col1 = divmod(end, inner)
    rest = shape[1:]
    row = lambda r, boxes: [((r,) + o, (1,) + l) for o, l in boxes]  # noqa: E731
    if first == last:  # inside one row
        return row(first, _boxes(rest, col0, col1))
    out: List[Box] = []
    if col0:
        out += row(first, _boxes(rest, col0, inner))
        first += 1
    if last > first:
        out.append(((first,) + (0,) * len(rest), (last - first,) + rest))
    if col1:
        out += row(last, _boxes(rest, 0, col1))
    return out


def flat_offset(shape: Sequence[int], offsets: Sequence[int]) -> int:
    """Row-major element index of `offsets` in a tensor of `shape`."""
    index = 0
    for size, off in zip(shape, offsets):
        index = index * size + off
    return index


@dataclass(frozen=True)
class FlatPiece:
    """Elements [start, start + numel) of the row-major tensor `name` (of `shape`) lie at
    [offset, offset + numel) of a flat buffer: the unit of every packed layout (ZeRO partitions,
    FSDP1 flat parameters, Megatron's distributed-optimizer buffers)."""
    name: str
    shape: Shape
    offset: int
    numel: int
    start: int


def flat_views(shape: Sequence[int], start: int, numel: int, offset: int = 0) -> List[Tuple[Box, int]]:
    """The boxes of elements [start, start + numel) of a tensor of `shape`, each with the position
    where it begins in a flat buffer that holds those elements from `offset` on."""
    shape = tuple(int(s) for s in shape)
    return [((o, n), flat_offset(shape, o) - start + offset) for o, n in flat_range_boxes(shape, start, start + numel)]


def flat_fragments(key: str, global_shape: Sequence[int], flat: torch.Tensor,
                   start: int, end: Optional[int] = None) -> List[Fragment]:
    """Fragments for a rank that owns elements [start, end) of `key`, held in the 1-D `flat`.

    `flat[0]` is global element `start`. Every fragment's local is a zero-copy view of `flat`.
    """
    if flat.dim() != 1:
        raise ValueError(f"{key}: flat buffer must be 1-D, got shape {tuple(flat.shape)}")
    end = start + flat.numel() if end is None else end
    if end - start > flat.numel():
        raise ValueError(f"{key}: range [{start}, {end}) is longer than its buffer ({flat.numel()})")
    return piece_fragments([FlatPiece(key, tuple(global_shape), 0, end - start, start)], flat)


def piece_fragments(pieces: Sequence[FlatPiece], flat: torch.Tensor,
                    key_of: Callable[[str], str] = lambda name: name) -> List[Fragment]:
    """Fragments of the 1-D buffer `flat` for every piece it holds, under the keys `key_of(name)`;
    each local is a zero-copy view of `flat`. Alignment gaps between pieces are never stored."""
    frags = []
    for p in pieces:
        for (offsets, lengths), begin in flat_views(p.shape, p.start, p.numel, p.offset):
            view = flat[begin:begin + math.prod(lengths)].view(lengths)
            frags.append(Fragment(key_of(p.name), tuple(p.shape), flat.dtype, offsets, view))
    return frags


def intersect(a: Box, b: Box) -> Optional[Box]:
    """The intersection of two boxes, or None when they do not overlap."""
    offs, lens = [], []
    for ao, al, bo, bl in zip(a[0], a[1], b[0], b[1]):
        lo, hi = max(ao, bo), min(ao + al, bo + bl)
        if hi <= lo:
            return None
        offs.append(lo)
        lens.append(hi - lo)
    return tuple(offs), tuple(lens)


def sub_view(tensor: torch.Tensor, tensor_offsets: Sequence[int], box: Box) -> torch.Tensor:
    """The view of `tensor` (placed at `tensor_offsets`) that covers `box`: `tensor` itself where
    the box is all of it (a save's and a same-layout load's usual case; each narrow costs
    microseconds, per tensor, per save)."""
    view, shape = tensor, tensor.shape
    for d, (t_off, b_off, b_len) in enumerate(zip(tensor_offsets, box[0], box[1])):
        if b_off != t_off or b_len != shape[d]:
            view = view.narrow(d, b_off - t_off, b_len)
    return view


def packed_pieces(entries: Sequence[Tuple[str, Sequence[int], int]], start: int, end: int) -> List[FlatPiece]:
    """The pieces of a rank owning elements [start, end) of a packed buffer that holds each
    (name, shape, offset) of `entries` from its offset on; piece offsets are relative to `start`."""
    pieces = []
    for name, shape, offset in entries:
        lo, hi = max(start, offset), min(end, offset + math.prod(shape))
        if lo < hi:
            pieces.append(FlatPiece(name, tuple(int(s) for s in shape), lo - start, hi - lo, lo - offset))
    return pieces
