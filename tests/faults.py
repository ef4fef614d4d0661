"""Fault injection for the fault matrix: each phase of a save or load, each kind of fault, armed
in one rank's process. Storage faults go through a faulty Storage (the `faulty://` scheme tests
save to and load from), plan and finish faults through a state handler's own steps; only the
snapshot's copy and the exchange's receiving side, which have no public seam, are patched; so are
the snapshots an overlapped save's test holds back (`snapshots_held`)."""
from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional

import torch

import ckpt_plugins as cp
from ckpt_plugins._src.fragment import box_fragment
from ckpt_plugins._src.state import LoadItems, SaveItems
from ckpt_plugins._src.storage import LocalStorage, Writer, register_scheme

SAVE_PHASES = ("plan", "snapshot", "write", "commit")
LOAD_PHASES = ("metadata", "load_plan", "own_read", "shared_read", "exchange", "finish")
ROWS, COLS = 16, 512  # the own tensor: ROWS rows per rank; the replicated one: 4 * ROWS rows


@dataclass(frozen=True)
class Case:
    phase: str
    fault: str  # exception | storage | corrupt | kill
    rank: int  # the rank the fault is armed on (every rank for a shared read: whoever reads it)
    mode: str = "sync"  # sync | async | overlap (saves)

    @property
    def cause(self) -> str:
        """What every rank's error must say about the cause."""
        return {"exception": "injected fault", "storage": "injected storage error",
                "corrupt": "checksum mismatch" if self.phase.endswith("read") else "metadata"}[self.fault]


class Armed:
    """The hook of the state: a save's plan, a load's plan (its checks) and finish step run
    through it."""

    def __init__(self):
        self.plan: Optional[Callable[[], None]] = None
        self.load_plan: Optional[Callable[[], None]] = None
        self.finish: Optional[Callable[[], None]] = None

    def save_items(self, prefix):
        if self.plan:
            self.plan()
        return SaveItems()

    def load_items(self, prefix, metadata):
        return LoadItems(finish=[self.finish] if self.finish else [],
                         checks=[lambda read: self.load_plan()] if self.load_plan else [])


class _FaultyWriter(Writer):
    def __init__(self, inner: Writer, fault: Callable[[Writer, object], None]):
        self.inner, self.fault = inner, fault

    def write(self, data) -> None:
        self.fault(self.inner, data)

    def close(self) -> None:
        self.inner.close()


class FaultyStorage(LocalStorage):
    """A local directory (`faulty://<dir>`) whose operations fail when this process armed them:
    `FAULTS[operation](name, offset)` runs first ("put_atomic", "read_bytes", "read_into");
    `FAULTS["write"](writer, data)` writes a data file's pieces (a slow or dying write, say)."""
    FAULTS: Dict[str, Callable[..., None]] = {}

    def open_writer(self, name):
        writer = super().open_writer(name)
        fault = self.FAULTS.get("write")
        return _FaultyWriter(writer, fault) if fault is not None and name.startswith("data/") else writer

    def put_atomic(self, name, data):
        self._fault("put_atomic", name)
        return super().put_atomic(name, data)

    def read_bytes(self, name):
        self._fault("read_bytes", name)
        return super().read_bytes(name)

    def read_into(self, name, offset, buffer):
        self._fault("read_into", name, offset)
        return super().read_into(name, offset, buffer)

    def _fault(self, operation: str, *args) -> None:
        fault = self.FAULTS.get(operation)
        if fault is not None:
            fault(*args)


register_scheme("faulty", lambda url: FaultyStorage(url[len("faulty://"):]))


class Rows(cp.Handler):
    """Rank r's own rows of a (world * ROWS, COLS) tensor: read by that rank alone."""

    def __init__(self, tensor: torch.Tensor, rank: int, world: int):
        self.tensor, self.rank, self.world = tensor, rank, world

    def _frags(self, prefix):
        return [box_fragment(prefix, (self.world * ROWS, COLS), (self.rank * ROWS, 0), self.tensor)]

    def save_items(self, prefix):
        return SaveItems(fragments=self._frags(prefix))

    def load_items(self, prefix, metadata):
        return LoadItems(fragments=self._frags(prefix))


class Hook(cp.Handler):
    def __init__(self, armed: Armed):
        self.armed = armed

    def save_items(self, prefix):
        return self.armed.save_items(prefix)

    def load_items(self, prefix, metadata):
        return self.armed.load_items(prefix, metadata)


def values(rank: int, world: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    rep = torch.randn(4 * ROWS, COLS, generator=g)
    own = torch.randn(world * ROWS, COLS, generator=g)[rank * ROWS:(rank + 1) * ROWS].clone()
    return rep, own


def state(rank: int, world: int, seed: int, armed: Armed):
    rep, own = values(rank, world, seed)
    # a strided destination: what other ranks pass on lands in a buffer and is copied from there
    rep = rep.t().contiguous().t()
    return {"rep": rep, "own": Rows(own, rank, world), "hook": Hook(armed)}, (rep, own)


def act(case: Case, mark: str) -> None:
    """The fault itself. A killed rank first notes when it died."""
    if case.fault == "kill":
        with open(mark, "w") as f:
            f.write(str(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    if case.fault == "storage":
        raise OSError(errno.EIO, f"injected storage error in {case.phase}")
    raise RuntimeError(f"injected fault in {case.phase}")


def stored_range(path: str, key: str, rank_rows: Optional[int] = None):
    """(file, first byte, end byte) of `key`'s stored box (the one holding row `rank_rows`)."""
    meta = cp.read_metadata(path).tensors[key]
    for box in meta.boxes:
        if rank_rows is None or box.offsets[0] <= rank_rows < box.offsets[0] + box.lengths[0]:
            return box.file, box.offset, box.offset + box.nbytes
    raise KeyError(key)


def flip(path: str, where) -> None:
    file, start, _ = where
    with open(os.path.join(path, file), "r+b") as f:
        f.seek(start + 7)
        byte = f.read(1)
        f.seek(start + 7)
        f.write(bytes([byte[0] ^ 0x5A]))


def local_path(path: str) -> str:
    return path[len("faulty://"):] if path.startswith("faulty://") else path


def arm(case: Case, rank: int, world: int, armed: Armed, path: str, mark: str) -> List[Callable[[], None]]:
    """Arm `case` in this process (a no-op on ranks it does not concern); returns the disarms.
    `path`: the checkpoint a load case reads (corruptions are made by rank 0 before the load)."""
    from ckpt_plugins._src import host_share, hostmem, shm
    from ckpt_plugins._src.engine import channels

    undo: List[Callable[[], None]] = []
    mine = rank == case.rank or case.phase == "shared_read"
    path = local_path(path)

    def patch(owner, name, make):
        original = getattr(owner, name)
        setattr(owner, name, make(original))
        undo.append(lambda: setattr(owner, name, original))

    def storage_fault(operation: str, fault: Callable[..., None]) -> None:
        FaultyStorage.FAULTS[operation] = fault
        undo.append(lambda: FaultyStorage.FAULTS.pop(operation, None))

    if case.fault == "corrupt":
        if rank == 0:
            if case.phase == "metadata":
                meta = os.path.join(path, "metadata.json")
                with open(meta, "rb") as f:
                    good = f.read()
                with open(meta, "wb") as f:
                    f.write(good[:len(good) // 2])

                def restore():
                    with open(meta, "wb") as f:
                        f.write(good)
                undo.append(restore)
            else:
                where = stored_range(path, "own", case.rank * ROWS) if case.phase == "own_read" else \
                    stored_range(path, "rep")
                flip(path, where)
                undo.append(lambda: flip(path, where))
        return undo
    if not mine:
        return undo
    phase = case.phase
    if phase in ("plan", "load_plan", "finish"):  # the state's own handler steps
        setattr(armed, phase, lambda: act(case, mark))
        undo.append(lambda: setattr(armed, phase, None))
    elif phase == "snapshot":
        patch(hostmem, "stream_copy", lambda original: lambda *a, **k: act(case, mark))
    elif phase == "write":
        storage_fault("write", lambda writer, data: act(case, mark))
    elif phase == "commit":
        storage_fault("put_atomic", lambda name: act(case, mark) if name == "metadata.json" else None)
    elif phase == "metadata":  # where this rank gets it: the storage, or its host's copy (host_share)
        patch(host_share.HostMetadata, "read", lambda original: lambda *a, **k: act(case, mark))
    elif phase in ("own_read", "shared_read"):
        file, start, end = stored_range(path, "own", case.rank * ROWS) if phase == "own_read" else \
            stored_range(path, "rep")
        storage_fault("read_into", lambda name, offset: act(case, mark) if name == file and start <= offset < end
                      else None)
    elif phase == "exchange":  # this rank is a needer: it fails taking what the reader passed on
        patch(shm.Attached, "memory", lambda original: lambda *a, **k: act(case, mark))
        patch(channels.Incoming, "copy_from_buffer", lambda original: lambda *a, **k: act(case, mark))
    return undo


@contextlib.contextmanager
def snapshots_held(timeout: float = 60.0) -> Iterator[threading.Event]:
    """Snapshots start only once the event yielded is set (as a slow copy would finish late), or
    after `timeout` seconds: a save that wrongly waits for its snapshot fails its test instead of
    hanging it."""
    from ckpt_plugins._src.engine.write import StagedWrite
    go, native = threading.Event(), StagedWrite.snapshot
    StagedWrite.snapshot = lambda self, buf, **kw: (go.wait(timeout), native(self, buf, **kw))[1]
    try:
        yield go
    finally:
        StagedWrite.snapshot = native


def report(path: str, **fields) -> None:
    with open(path, "w") as f:
        json.dump(fields, f)
