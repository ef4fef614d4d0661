"""Whether a rank's 16-bit weights are exactly its fp32 masters' cast, so a save may store the
masters once (`plan.drop_cast_weights` decides which weights, from every rank's word).

Mixed-precision frameworks (DeepSpeed bf16, Megatron's distributed optimizer) copy each step's
fp32 masters back into the weights, so the weights are normally their cast, but a user may have
changed them since (a weight loaded alone, a hand edit): the rule is checked on the bytes about
to be saved, never assumed. Each rank checks the masters it holds against the weights it holds
over the same region; a rank holding a master whose weight it does not hold cannot vouch for it.
The check runs in the save call, so it casts a block of rows at a time into a reused buffer (a
strided weight is packed into a second one) and compares bits as 64-bit words: fresh memory and
float comparisons cost several times more.
"""
from __future__ import annotations

from typing import Dict, List, Sequence

import torch

from .format import CAST_DTYPES, MASTER, MODEL, OPTIM, dtype_name
from .fragment import Fragment, intersect, sub_view

CHUNK = 1 << 20  # elements cast at a time


def masters_cast_exactly(fragments: Sequence[Fragment]) -> bool:
    """True when every fp32 master fragment among `fragments` whose weight is 16-bit is, cast to
    the weight's dtype, bit for bit the weight held here over the same box."""
    weights: Dict[str, List[Fragment]] = {}
    for frag in fragments:
        if frag.key.startswith(MODEL + "/"):
            weights.setdefault(frag.key, []).append(frag)
    buffers = _Buffers()
    for master in fragments:
        if not (master.key.startswith(OPTIM + "/") and master.key.endswith("/" + MASTER)
                and master.dtype == torch.float32 and master.local.numel()):
            continue
        held = weights.get(f"{MODEL}/{master.key[len(OPTIM) + 1:-len(MASTER) - 1]}", ())
        if held and dtype_name(held[0].dtype) not in CAST_DTYPES:
            continue
        box = (tuple(master.offsets), tuple(master.lengths))
        weight = next((w for w in held if intersect(box, (tuple(w.offsets), tuple(w.lengths))) == box), None)
        if weight is None or weight.local.device != master.local.device:  # offloaded masters: not worth a copy
            return False
        if not _equal_cast(master.local, sub_view(weight.local, weight.offsets, box), buffers):
            return False
    return True


class _Buffers:
    """Two reused buffers per weight dtype and device: the cast, and a strided weight packed."""

    def __init__(self):
        self.held: Dict[tuple, torch.Tensor] = {}

    def get(self, like: torch.Tensor, numel: int, which: int) -> torch.Tensor:
        key = (like.dtype, like.device, which)
        buffer = self.held.get(key)
        if buffer is None or buffer.numel() < numel:
            buffer = self.held[key] = torch.empty(max(numel, CHUNK), dtype=like.dtype, device=like.device)
        return buffer[:numel]


def _equal_cast(master: torch.Tensor, weight: torch.Tensor, buffers: _Buffers) -> bool:
    """Row blocks of about CHUNK elements: strided views (a fused tensor's part) are packed into
    the buffers, never copied into fresh memory."""
    if not master.dim():
        master, weight = master.reshape(1), weight.reshape(1)
    row = master[0].numel()
    step = max(1, CHUNK // max(row, 1))
    for start in range(0, master.shape[0], step):
        high, low = master[start:start + step], weight[start:start + step]
        cast = buffers.get(low, high.numel(), 0).view(high.shape)
        cast.copy_(high)
        if not low.is_contiguous():
            low = buffers.get(low, low.numel(), 1).view(low.shape).copy_(low)
        cast, low = cast.reshape(-1), low.reshape(-1)
        words = _words(cast, low)
        if not torch.equal(cast.view(words), low.view(words)):
            return False
    return True


def _words(*tensors: torch.Tensor) -> torch.dtype:
    """The widest integers that tile every one of `tensors` (so NaN payloads and -0.0 compare as
    bits, and fewer, wider elements compare faster)."""
    for dtype in (torch.int64, torch.int32):
        if all(t.numel() * t.element_size() % dtype.itemsize == 0 and t.data_ptr() % dtype.itemsize == 0
               for t in tensors):
            return dtype
    return torch.int16
