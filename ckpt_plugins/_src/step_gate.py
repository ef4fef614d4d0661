"""Overlapped saves in a framework's training loop: the optimizer step waits for the snapshot.

An overlapped save (`save_async(..., overlap=True)`) returns at once and copies the state beside
the next forward and backward. Those leave the saved tensors alone; the optimizer step does not.
A hook that saves this way hands the handle and the optimizers to a `StepGate`, whose wrapper
around each optimizer's `step` waits for the snapshot first: one wait, just before the first
mutation, whatever the framework's loop looks like (gradient accumulation steps the optimizer
only at a boundary)."""
from __future__ import annotations

from typing import Callable, Optional

from .own_threads import at_work
from .results import SaveHandle


def overlapped(asynchronous: bool, overlap: Optional[bool]) -> bool:
    """Whether a hook's save overlaps the next forward and backward: as `overlap` says (True
    implies an asynchronous save), else whenever the save is asynchronous (every hook's default)."""
    return asynchronous if overlap is None else bool(overlap)


def committed_first(native: Callable, checkpointer=None) -> Callable:
    """`native` (a framework's end of training: one that promises every save is done, or destroys
    the process group a commit needs), called once the last save of `checkpointer` (None: the
    process group's default, looked up at the call) has committed; that save's error is raised
    after `native` ran. Called on a thread doing checkpoint work (a finaliser that garbage
    collection ran there), `native` runs at once: the save may be waiting for that thread."""
    def call(*args, **kwargs):
        from .api import checkpointer as default  # the api builds on this module
        if at_work():
            return native(*args, **kwargs)
        try:
            (checkpointer or default()).wait()
        finally:
            result = native(*args, **kwargs)
        return result
    return call


class StepGate:
    """Holds optimizer steps until the pending overlapped save's snapshot is taken."""

    def __init__(self):
        self._pending: Optional[SaveHandle] = None

    def hold(self, handle: SaveHandle, *optimizers) -> None:
        """The next `step` of each of `optimizers` (objects with a `step` method: torch's, DeepSpeed's,
        Megatron's, accelerate's wrappers; None, a job without one, is skipped) waits for `handle`'s
        snapshot. Wraps each once."""
        self._pending = handle
        for optimizer in optimizers:
            if optimizer is None or getattr(optimizer, "_ckpt_plugins_gate", None) is self:
                continue
            native = optimizer.step

            def step(*args, _native=native, **kwargs):
                self.release()
                return _native(*args, **kwargs)

            optimizer.step = step
            optimizer._ckpt_plugins_gate = self

    def release(self) -> None:
        """Wait for the pending snapshot, if any. A failed snapshot is the save's failure: its
        handle's `wait()` raises it, not the training step."""
        handle, self._pending = self._pending, None
        if handle is not None:
            handle.wait_snapshot_quietly()
