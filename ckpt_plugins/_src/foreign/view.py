"""A foreign checkpoint as the ordinary load plan sees it: metadata whose boxes point at the foreign
files' own bytes, with no checksums (foreign formats carry none), objects read or computed from
the foreign files, and per-box transforms where stored bytes are not the model's values (FP8
block quantization). Resharding and read-once loading then work unchanged.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Sequence, Tuple

import torch

from ..errors import LoadMismatchError
from ..format import Metadata, ObjectMeta, StoredBox, TensorMeta, dtype_from_name, dtype_name
from ..fragment import Box, Fragment

# Foreign boxes carry no checksums, so nothing needs reads rounded out to checksum chunks: a
# partial read reads exactly the bytes it uses.
FOREIGN_CHUNK = 1


@dataclass
class ComputedObject(ObjectMeta):
    """An object the foreign format spreads over several items (DCP's param groups): `compute`
    builds it from the checkpoint's storage."""
    compute: Callable[[Any], Any] = None


def computed(compute: Callable[[], Any]) -> List[ComputedObject]:
    """A view's object, computed when a load asks for it (the list `Metadata.objects` holds)."""
    return [ComputedObject(file="", offset=0, nbytes=0, crc32c=[], encoding="torch", compute=lambda _: compute())]


@dataclass
class ForeignMetadata(Metadata):
    """Metadata of a checkpoint in another format (`source` names it). `transforms`: stored key ->
    how a box of its values is computed from stored boxes (instead of read as is)."""
    source: str = ""
    transforms: Dict[str, "Transform"] = field(default_factory=dict)
    descriptive: Tuple[str, ...] = ()  # objects that describe the checkpoint (config.json), not state


def raw_box(file: str, offset: int, dtype: torch.dtype, offsets: Sequence[int], lengths: Sequence[int]) -> StoredBox:
    """A box of row-major bytes at `offset` of `file`, with no checksums."""
    return StoredBox(file=file, offset=offset, nbytes=math.prod(lengths) * dtype.itemsize, crc32c=[],
                     offsets=tuple(int(o) for o in offsets), lengths=tuple(int(n) for n in lengths))


def view_boxes(file: str, base: int, view: torch.Tensor, at: Sequence[int]) -> List[StoredBox]:
    """A view (any strides; a meta tensor will do) of row-major bytes stored from `base` in `file`,
    as raw boxes of the canonical tensor it is the box at `at` of: one per contiguous run."""
    shape, strides, itemsize = tuple(view.shape), view.stride(), view.element_size()
    k, expect = len(shape), 1
    while k > 0 and (shape[k - 1] == 1 or strides[k - 1] == expect):  # the contiguous trailing dims
        expect *= shape[k - 1]
        k -= 1
    boxes = []
    for index in itertools.product(*(range(n) for n in shape[:k])):
        element = view.storage_offset() + sum(i * s for i, s in zip(index, strides))
        boxes.append(raw_box(file, base + element * itemsize, view.dtype,
                             tuple(a + i for a, i in zip(at, index)) + tuple(at[k:]), (1,) * k + shape[k:]))
    return boxes


def tensor_meta(shape: Sequence[int], dtype: torch.dtype, boxes: List[StoredBox]) -> TensorMeta:
    return TensorMeta(shape=tuple(int(s) for s in shape), dtype=dtype_name(dtype), boxes=boxes)


class Transform:
    """How a box of a stored tensor's values is computed: `sources` are the fragments to read for
    it (fresh memory), `apply` computes the box from them in `dtype`."""

    def sources(self, key: str, shape: Sequence[int], dtype: torch.dtype, box: Box) -> List[Fragment]:
        raise NotImplementedError

    def apply(self, box: Box, read: List[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def value_dtype(self, stored: torch.dtype) -> torch.dtype:
        """The dtype of the values when nothing asks for another (a tool reading them whole)."""
        return stored


@dataclass(frozen=True)
class RowPermute(Transform):
    """q/k projections stored with each head's rows in Meta's rotary order (pairs interleaved;
    torchtitan's Llama 3): HF row h·d + a·d/2 + b is stored row h·d + 2b + a. A box needs the
    stored rows of the heads it touches."""
    head_dim: int

    def _heads(self, box: Box) -> Tuple[int, int]:
        (r, _), (n, _) = box
        return r // self.head_dim, -(-(r + n) // self.head_dim)

    def sources(self, key: str, shape: Sequence[int], dtype: torch.dtype, box: Box) -> List[Fragment]:
        h0, h1 = self._heads(box)
        (_, c), (_, nc) = box
        rows = (h1 - h0) * self.head_dim
        return [Fragment(key, tuple(shape), dtype, (h0 * self.head_dim, c), torch.empty((rows, nc), dtype=dtype))]

    def apply(self, box: Box, read: List[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        (r, _), (n, nc) = box
        h0, h1 = self._heads(box)
        d = self.head_dim
        hf = read[0].view(h1 - h0, d // 2, 2, nc).transpose(1, 2).reshape((h1 - h0) * d, nc)
        return hf[r - h0 * d:r - h0 * d + n].to(dtype)


@dataclass(frozen=True)
class BlockDequant(Transform):
    """Block-quantized weights (DeepSeek-V3/R1, Qwen3 FP8): value = weight × scale_inv of its
    `block`, in float32, then cast to the model's dtype. A box needs only the scale blocks its
    rows and columns touch."""
    scale_key: str
    scale_shape: Tuple[int, int]
    scale_dtype: torch.dtype
    block: Tuple[int, int]
    dtype: torch.dtype = torch.bfloat16  # the model's (config.json's), for tools reading them whole

    def blocks(self, box: Box) -> Box:
        (r, c), (nr, nc) = box
        (br, bc) = self.block
        r0, c0 = r // br, c // bc
        return (r0, c0), (-(-(r + nr) // br) - r0, -(-(c + nc) // bc) - c0)

    def sources(self, key: str, shape: Sequence[int], dtype: torch.dtype, box: Box) -> List[Fragment]:
        """Fragments to read (fresh memory) for `box` of `key`: its stored weights and scales."""
        scales = self.blocks(box)
        return [Fragment(key, tuple(shape), dtype, box[0], torch.empty(box[1], dtype=dtype)),
                Fragment(self.scale_key, self.scale_shape, self.scale_dtype, scales[0],
                         torch.empty(scales[1], dtype=self.scale_dtype))]

    def apply(self, box: Box, read: List[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        weight, scale = read
        (r, c), (nr, nc) = box
        (br, bc) = self.block
        (r0, c0), _ = self.blocks(box)
        full = scale.float().repeat_interleave(br, 0).repeat_interleave(bc, 1)
        full = full[r - r0 * br:r - r0 * br + nr, c - c0 * bc:c - c0 * bc + nc]
        return (weight.float() * full).to(dtype)

    def value_dtype(self, stored: torch.dtype) -> torch.dtype:
        return self.dtype


def transformed(metadata: Metadata, fragments: List[Fragment], finish: List[Callable[[], None]]) -> List[Fragment]:
    """`fragments` with each one whose stored tensor has a transform replaced by what the
    transform reads; `finish` gets the steps that compute them (before any other finish step)."""
    transforms = getattr(metadata, "transforms", None)
    if not transforms:
        return fragments
    out, steps = [], []
    for frag in fragments:
        key = metadata.aliases.get(frag.key, frag.key)
        how = transforms.get(key)
        if how is None:
            out.append(frag)
            continue
        meta = metadata.tensors[key]
        if tuple(meta.shape) != tuple(frag.global_shape):
            raise LoadMismatchError(f"{frag.key}: checkpoint holds shape {list(meta.shape)}, the model wants "
                                    f"{list(frag.global_shape)}")
        box = (tuple(frag.offsets), tuple(frag.lengths))
        reads = how.sources(key, meta.shape, dtype_from_name(meta.dtype), box)
        out += reads
        steps.append(lambda f=frag, h=how, b=box, r=reads: f.local.copy_(h.apply(b, [x.local for x in r], f.dtype)))
    finish[:0] = steps
    return out
