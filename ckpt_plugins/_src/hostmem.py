"""Host memory: page-aligned buffers, fresh tensors that fault in cheaply, fast copies by address.

Copies into touched memory with streaming stores beat memmove and `copy_`, and fresh memory costs
its page faults on first touch (`bench/snapshot_copy.py` measures each).
"""
from __future__ import annotations

import ctypes
import math
import sys
import torch

try:
    from .._hostcopy import STREAMING, copy as _stream_copy
except ImportError:  # installed without a C compiler: memmove
    STREAMING, _stream_copy = 0, None

PAGE = 4096
HUGE_PAGE = 2 << 20
DIRECT_MIN = 1 << 20  # tensors this big start page-aligned in data files (plan.PAGE_ITEM_BYTES)
_MADV_HUGEPAGE = 14
_libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def align_up(n: int, align: int = PAGE) -> int:
    return -(-n // align) * align


def aligned_empty(nbytes: int, pin: bool = False) -> torch.Tensor:
    """Uninitialised page-aligned host memory of `nbytes` rounded up to pages (uint8)."""
    raw = torch.empty(align_up(nbytes) + PAGE, dtype=torch.uint8, pin_memory=pin)
    start = (-raw.data_ptr()) % PAGE
    return raw[start:start + align_up(nbytes)]


def fresh_empty(shape, dtype: torch.dtype, device=None) -> torch.Tensor:
    """Uninitialised memory for a load to fill. On the host, from 1 MiB up: page aligned, so the
    loader's O_DIRECT reads land in it with no copy out of its ring and fault its pages in on
    every read thread at once, and advised to use huge pages."""
    nbytes = math.prod(shape) * dtype.itemsize
    if (device is not None and torch.device(device).type != "cpu") or nbytes < DIRECT_MIN:
        return torch.empty(shape, dtype=dtype, device=device)
    return advise_huge_pages(aligned_empty(nbytes)[:nbytes].view(dtype).view(shape))


def advise_huge_pages(tensor: torch.Tensor) -> torch.Tensor:
    """Advise untouched host memory that a load fills next to use huge pages (Linux): one page
    fault per 2 MiB instead of per 4 KiB. Only its huge-page-aligned part; advice, never an error."""
    nbytes = tensor.numel() * tensor.element_size()
    if _libc is not None and tensor.device.type == "cpu" and nbytes >= 2 * HUGE_PAGE:
        start, end = align_up(tensor.data_ptr(), HUGE_PAGE), (tensor.data_ptr() + nbytes) // HUGE_PAGE * HUGE_PAGE
        _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_HUGEPAGE)
    return tensor


def stream_copy(dst: int, src: int, nbytes: int) -> None:
    """Copy `nbytes` from address `src` to `dst` (not overlapping) with streaming stores, which
    skip reading the destination into the cache: for touched memory (the staging buffers)."""
    if _stream_copy is not None:
        _stream_copy(dst, src, nbytes)
    else:
        ctypes.memmove(dst, src, nbytes)


def copy(dst: int, src: int, nbytes: int) -> None:
    """Copy `nbytes` from address `src` to `dst` (not overlapping): for memory that may be fresh
    (streaming stores into freshly faulted pages ran 1.7x slower than memmove here)."""
    ctypes.memmove(dst, src, nbytes)
