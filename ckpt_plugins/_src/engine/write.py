"""The save side of execution: snapshot a rank's share of a save into staging memory and write
its data files from there. What to write where was decided by `plan`.

A pipeline over one staging buffer: the snapshot copies items into it file by file in offset
order, and one writer thread per file follows the snapshot's progress, writing aligned pieces as
soon as they are staged and checksumming each item once it is complete.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

from ..format import chunk_checksums
from .. import hostmem
from ..hostmem import align_up
from ..storage import Storage
from ..telemetry import Recorder

PIECE = 8 << 20  # bytes per write call: big enough for the disk, small enough to pipeline
COPY_PIECE = 4 << 20  # bytes per snapshot copy: threads share big tensors, writers follow early


@dataclass
class StageItem:
    file: str
    offset: int
    source: Union[torch.Tensor, bytes]  # a fragment's live view, or an encoded object

    @property
    def nbytes(self) -> int:
        s = self.source
        return s.numel() * s.element_size() if isinstance(s, torch.Tensor) else len(s)


class StagedWrite:
    """One rank's share of a save: snapshot into a staging buffer, then write every file from it."""

    def __init__(self, storage: Storage, items: Sequence[StageItem]):
        self.storage, self.items = storage, list(items)
        self.sizes: Dict[str, int] = {}
        for item in self.items:
            self.sizes[item.file] = max(self.sizes.get(item.file, 0), item.offset + item.nbytes)
        self.base: Dict[str, int] = {}
        total = 0
        for name in sorted(self.sizes):
            self.base[name] = total
            total += align_up(self.sizes[name])
        self.nbytes = total
        self.buffer: Optional[torch.Tensor] = None
        self.stored_as: Callable[[str], str] = str  # where a planned file is written (an overwrite's generation)
        self._ready = {name: 0 for name in self.sizes}  # staged prefix of each file
        self._failed: Optional[BaseException] = None
        self._cond = threading.Condition()

    @property
    def pinned(self) -> bool:
        """Whether staging must be pinned: some source lives on a GPU."""
        return any(isinstance(i.source, torch.Tensor) and i.source.device.type == "cuda" for i in self.items)

    def snapshot(self, buffer: torch.Tensor, threads: int = 1) -> None:
        """Copy every item into `buffer` (>= self.nbytes). Afterwards the sources may change.

        Contiguous host tensors are copied as byte pieces by `threads` threads with streaming
        stores (`hostmem.stream_copy`, the GIL released): one `copy_` per tensor forks and joins
        torch's thread pool every time, which ranks sharing few cores turned into a 2-5x slower
        snapshot here. Other sources (device tensors, strided views, encoded objects) are copied
        by this thread, in order.
        """
        self.buffer = buffer
        try:
            by_file = {name: sorted((i for i in self.items if i.file == name), key=lambda i: i.offset)
                       for name in self.sizes}
            # round-robin over files so every writer gets data early
            order = [i for group in zip(*[_padded(v, max(map(len, by_file.values()), default=0))
                                          for v in by_file.values()]) for i in group if i is not None]
            pieces = [p for item in order for p in self._pieces(item, buffer)]
            progress = _Progress(self, pieces)
            own = [i for i, p in enumerate(pieces) if p.host is None]
            shared = iter([i for i, p in enumerate(pieces) if p.host is not None])
            take, errors = threading.Lock(), []

            def copy_shared() -> None:
                try:
                    while not errors:
                        with take:
                            index = next(shared, None)
                        if index is None:
                            return
                        pieces[index].run()
                        progress.done(index)
                except BaseException as exc:
                    errors.append(exc)

            helpers = [threading.Thread(target=copy_shared, name="ckpt-snapshot-copy", daemon=True)
                       for _ in range(max(0, threads - 1))]
            for t in helpers:
                t.start()
            try:
                for index in own:
                    pieces[index].run()
                    progress.done(index)
                copy_shared()
            finally:
                for t in helpers:
                    t.join()
            if errors:
                raise errors[0]
            with self._cond:  # alignment gaps after the last item count as staged too
                self._ready = dict(self.sizes)
                self._cond.notify_all()
        except BaseException as exc:
            self.fail(exc)
            raise

    def _pieces(self, item: StageItem, buffer: torch.Tensor) -> List["_Piece"]:
        start = self.base[item.file] + item.offset
        dest = buffer[start:start + item.nbytes]
        src = item.source
        if not isinstance(src, torch.Tensor):
            return [_Piece(item.file, item.offset + item.nbytes, dest, src)]
        src = src.detach()
        if src.device.type != "cpu" or not src.is_contiguous() or src.is_conj() or src.is_neg() or not item.nbytes:
            return [_Piece(item.file, item.offset + item.nbytes, dest, src)]
        return [_Piece(item.file, item.offset + min(item.nbytes, at + COPY_PIECE), dest, src,
                       host=(dest.data_ptr() + at, src.data_ptr() + at, min(COPY_PIECE, item.nbytes - at)))
                for at in range(0, item.nbytes, COPY_PIECE)]

    def fail(self, exc: BaseException) -> None:
        """Stop the writers: the snapshot cannot complete."""
        with self._cond:
            self._failed = exc
            self._cond.notify_all()

    def write(self, threads: int, recorder: Optional[Recorder] = None) -> List[List[int]]:
        """Write every file as the snapshot progresses; returns each item's chunk checksums.
        `recorder` gets each file's write (seconds spent in the storage, bytes, O_DIRECT bytes,
        retries) and the checksums' seconds."""
        checksums: List[List[int]] = [[] for _ in self.items]
        recorder = recorder or Recorder("save", "", 0, enabled=False)
        with ThreadPoolExecutor(max(1, min(threads, len(self.sizes))), thread_name_prefix="ckpt-write") as pool:
            list(pool.map(lambda name: self._write_file(name, checksums, recorder), sorted(self.sizes)))
        return checksums

    def _write_file(self, name: str, checksums: List[List[int]], recorder: Recorder) -> None:
        size, base = self.sizes[name], self.base[name]
        pending = sorted((i for i, it in enumerate(self.items) if it.file == name),
                         key=lambda i: self.items[i].offset)
        first, busy, summing = time.time(), 0.0, 0.0
        writer = self.storage.open_writer(self.stored_as(name))
        try:
            pos = 0
            while pos < size:
                target = min(size, pos + PIECE)
                with self._cond:
                    while self._ready[name] < target and self._failed is None:
                        self._cond.wait()
                    if self._failed is not None:
                        raise RuntimeError(f"snapshot failed: {type(self._failed).__name__}: {self._failed}")
                t = time.time()
                writer.write(_bytes(self.buffer[base + pos:base + target]))
                busy += time.time() - t
                pos = target
                t = time.time()
                while pending and self.items[pending[0]].offset + self.items[pending[0]].nbytes <= pos:
                    index = pending.pop(0)
                    start = base + self.items[index].offset
                    checksums[index] = chunk_checksums(_bytes(self.buffer[start:start + self.items[index].nbytes]))
                summing += time.time() - t
            t = time.time()
            writer.close()  # fsync: part of the write
            busy += time.time() - t
        except BaseException:
            writer.close()
            raise
        end = time.time()
        recorder.add("write", first, end, size, busy=busy, files=1, direct_bytes=writer.direct_bytes,
                     retries=writer.retries)
        recorder.add("checksum", first, end, size, busy=summing)
        recorder.record.info.setdefault("files", []).append(
            {"file": name, "bytes": size, "start": first, "end": end, "seconds": round(busy, 6),
             "direct_bytes": writer.direct_bytes, "retries": writer.retries})


@dataclass
class _Piece:
    """A part of the snapshot: bytes of one item, ending at `end` in its file."""
    file: str
    end: int
    dest: torch.Tensor
    source: Union[torch.Tensor, bytes]  # also keeps a host copy's source alive
    host: Optional[Tuple[int, int, int]] = None  # (dest, src, nbytes) for a plain host copy

    def run(self) -> None:
        if self.host is not None:
            hostmem.stream_copy(*self.host)
        elif isinstance(self.source, torch.Tensor):
            src = self.source
            self.dest.view(src.dtype).view(src.shape).copy_(src, non_blocking=True)
            if src.device.type != "cpu":
                torch.cuda.synchronize()
        else:
            memoryview(self.dest.numpy())[:] = self.source


class _Progress:
    """Advances each file's staged prefix as pieces finish, in any order."""

    def __init__(self, job: "StagedWrite", pieces: Sequence[_Piece]):
        self.job, self.pieces = job, pieces
        self.left = {name: deque(i for i, p in enumerate(pieces) if p.file == name) for name in job.sizes}
        self.finished: set = set()

    def done(self, index: int) -> None:
        job = self.job
        with job._cond:
            self.finished.add(index)
            name = self.pieces[index].file
            queue, moved = self.left[name], False
            while queue and queue[0] in self.finished:
                job._ready[name] = self.pieces[queue.popleft()].end
                moved = True
            if moved:
                job._cond.notify_all()


def _padded(values: list, n: int) -> list:
    return values + [None] * (n - len(values))


def _bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.numpy()) if t.numel() else memoryview(b"")
