"""Segments: a sub-box of a framework's local tensor and where it sits in a canonical tensor, and
the fragments they cut a local tensor (or a flat range of it) into, as views (no copy).

A fused local tensor gives several segments (Megatron's `linear_qkv`: q/k/v per query group); a
segment may see the local tensor through another shape (`view`) with its dimensions reordered
(`axes`): an expert of a grouped tensor, stored transposed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterator, List, Optional, Sequence, Tuple

import torch

from ..fragment import Box, Fragment, Shape, flat_views, intersect, sub_view


@dataclass(frozen=True)
class Segment:
    """Local sub-box `local` of a local tensor is the box at `offsets` of canonical `name`
    (global `shape`). `name` None: padding, stored nowhere. `view`: the local tensor seen as this
    shape (the box is in it); `axes`: canonical dimension k is the view's dimension axes[k], the
    view's other dimensions have length 1 in the box (None: the same dimensions)."""
    name: Optional[str]
    shape: Shape
    local: Box
    offsets: Shape
    view: Optional[Shape] = None
    axes: Optional[Tuple[int, ...]] = None


def whole(name: str, shape: Shape) -> Tuple[Segment, ...]:
    """A tensor stored whole under another name."""
    shape = tuple(shape)
    return (Segment(name, shape, ((0,) * len(shape), shape), (0,) * len(shape)),)


def segment_pieces(segments: Sequence[Segment], local_shape, tensor: torch.Tensor,
                   start: Optional[int]) -> Iterator[Tuple[Segment, torch.Tensor, Tuple[int, ...]]]:
    """(segment, view, offsets in the segment's tensor) for every part of `tensor` in a segment.
    `tensor` is shaped like the local parameter, or (start given) 1-D: its elements [start, ...)."""
    boxes_of = {}
    for seg in segments:
        shape = seg.view or tuple(local_shape)
        if shape not in boxes_of:
            boxes_of[shape] = ([((0,) * len(shape), shape, tensor.view(shape))] if start is None else
                               [(offsets, lengths, tensor[begin:begin + math.prod(lengths)].view(lengths))
                                for (offsets, lengths), begin in flat_views(shape, start, tensor.numel())])
        for offsets, lengths, view in boxes_of[shape]:
            inter = intersect((offsets, lengths), seg.local)
            if inter is None:
                continue
            piece = sub_view(view, offsets, inter)
            rel = [i - l for i, l in zip(inter[0], seg.local[0])]
            if seg.axes is None:
                yield seg, piece, tuple(o + r for o, r in zip(seg.offsets, rel))
                continue
            rest = [d for d in range(piece.dim()) if d not in seg.axes]
            piece = piece.permute(*seg.axes, *rest)
            for _ in rest:  # dimensions of length 1 in the box
                piece = piece.select(-1, 0)
            yield seg, piece, tuple(o + rel[a] for o, a in zip(seg.offsets, seg.axes))


def segment_fragments(segments: Sequence[Segment], local_shape, tensor: torch.Tensor,
                      key_of: Callable[[str], str], start: Optional[int] = None) -> List[Fragment]:
    """The fragments of `tensor` (local, or elements [start, ...) of it) that segments name."""
    return [Fragment(key_of(seg.name), seg.shape, view.dtype, at, view)
            for seg, view, at in segment_pieces(segments, local_shape, tensor, start) if seg.name is not None]


def zero_padding(segments: Sequence[Segment], local_shape, tensor: torch.Tensor, start: Optional[int] = None) -> None:
    """Padding (padded vocabulary rows) is never stored: a load leaves it zero."""
    for seg, view, _ in segment_pieces(segments, local_shape, tensor, start):
        if seg.name is None:
            view.zero_()


def within(segments: Sequence[Segment], box: Box) -> List[Segment]:
    """The segments of the sub-box `box` of the tensor they describe, relative to that sub-box (a
    rank's shard of a fused tensor). Segments seen through a `view` have no such sub-box."""
    out = []
    for seg in segments:
        if seg.view is not None:
            raise ValueError(f"{seg.name}: a segment of a reshaped view cannot be cut to a sub-box")
        inter = intersect(seg.local, box)
        if inter is None:
            continue
        rel = [i - l for i, l in zip(inter[0], seg.local[0])]
        dims = seg.axes if seg.axes is not None else range(len(rel))
        out.append(Segment(seg.name, seg.shape, (tuple(i - b for i, b in zip(inter[0], box[0])), inter[1]),
                           tuple(o + rel[a] for o, a in zip(seg.offsets, dims)), axes=seg.axes))
    return out


def segment_names(segments: Optional[Tuple[Segment, ...]], name: str, shape) -> List[Tuple[str, Tuple[int, ...]]]:
    """(canonical name, shape) of each tensor the segments name, in order; the tensor itself when none."""
    if segments is None:
        return [(name, tuple(shape))]
    return list(dict.fromkeys((s.name, s.shape) for s in segments if s.name is not None))
