"""`save` and `load`: the public entry points every framework extension goes through.

Both delegate to the process group's default `Checkpointer`, which keeps the staging pool and
the plan cache from one save to the next.
"""
from __future__ import annotations

import atexit
from typing import Any, Dict

import torch.distributed as dist

from .checkpointer import Checkpointer
from .committed import checkpoint_format, is_checkpoint, read_metadata
from .diff import DiffReport, KeyDiff, diff
from .results import LoadResult, SaveHandle, SaveInfo

__all__ = ["save", "save_async", "load", "checkpointer", "Checkpointer", "SaveInfo", "SaveHandle", "LoadResult",
           "read_metadata", "is_checkpoint", "checkpoint_format", "diff", "DiffReport", "KeyDiff"]

_checkpointers: Dict[Any, Checkpointer] = {}


@atexit.register
def _close_all() -> None:
    """Finish pending saves and drop the checkpoint groups before the interpreter tears down
    (process groups freed during finalization could abort the process)."""
    for ckpt in _checkpointers.values():
        ckpt.close()
    _checkpointers.clear()


def checkpointer(process_group=None) -> Checkpointer:
    """The default Checkpointer of `process_group` (the world group when None)."""
    group = process_group or (dist.group.WORLD if dist.is_available() and dist.is_initialized() else None)
    if group not in _checkpointers:
        _checkpointers[group] = Checkpointer(process_group)
    return _checkpointers[group]


def save(path, state: Dict[str, Any], *, process_group=None, **options) -> SaveInfo:
    """Save `state` (modules, optimizers, tensors, objects) to `path`, collectively; returns once
    the checkpoint is committed.

    Every rank of `process_group` calls it. If any rank failed, every rank raises the same
    SaveError naming the failing ranks, and nothing is committed. Options: framework, layout,
    step, overwrite, base (`SaveOptions`).
    """
    return checkpointer(process_group).save(path, state, **options)


def save_async(path, state: Dict[str, Any], *, process_group=None, overlap: bool = False,
               **options) -> SaveHandle:
    """`save` in the background: returns a SaveHandle once the snapshot is taken (with
    `overlap=True` at once, the snapshot running beside the next forward and backward: call
    `handle.wait_snapshot()` before the next optimizer step). `handle.wait()` for the commit."""
    return checkpointer(process_group).save_async(path, state, overlap=overlap, **options)


def load(path, state: Dict[str, Any], *, process_group=None, strict: bool = True, verify: bool = False) -> LoadResult:
    """Load a checkpoint into `state` in place, resharding to whatever layout `state` has.
    `verify=True`: then prove the live state holds what was loaded (`Checkpointer.load`)."""
    return checkpointer(process_group).load(path, state, strict=strict, verify=verify)
