"""The save side of execution: snapshot a rank's share of a save into staging memory and write
its data files from there. What to write where was decided by `plan`; where it sits in the
staging buffer, by `window`.

A pipeline over one staging buffer: the snapshot copies items into it file by file in offset
order, and one writer thread per file follows the snapshot's progress, writing aligned pieces as
soon as they are staged and checksumming them as they go. A save bigger than the buffer streams
through it window by window: the snapshot copies a window once the writers have written the one
that used its half of the buffer before. A compressed save's writers compress each item chunk by
chunk on the way out (`codec`), never in the snapshot.
"""
from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

from ..codec import Packer, head_bytes, xor
from ..format import CHUNK_BYTES, ChunkSums, StoredItem
from .. import hostmem, own_threads
from ..storage import AlignedStream, Storage
from ..storage.stream import DIRECT
from ..telemetry import Recorder
from .pace import Pace, TimedWriter
from .window import Window, Windows, plan_windows

PIECE = 8 << 20  # bytes per write call: big enough for the disk, small enough to pipeline
COPY_PIECE = 4 << 20  # bytes per snapshot copy: threads share big tensors, writers follow early


@dataclass
class StageItem:
    file: str
    offset: int
    source: Union[torch.Tensor, bytes]  # a fragment's live view, or an encoded object
    base: Optional[Callable[[int], bytes]] = None  # a delta's: chunk k of the same box in its base

    @property
    def nbytes(self) -> int:
        s = self.source
        return s.numel() * s.element_size() if isinstance(s, torch.Tensor) else len(s)

    @property
    def group(self) -> int:
        """The bytes of one element, by which compression groups them; 0: never compressed (objects)."""
        return self.source.element_size() if isinstance(self.source, torch.Tensor) else 0

    @property
    def head(self) -> int:
        """How many bytes of each element to compress: all of a delta's (unchanged ones are zeros)."""
        return self.group if self.base is not None else head_bytes(self.source.dtype.is_floating_point, self.group)


@dataclass
class WriteResult:
    items: List[StoredItem]  # where each item went and its checksums, in the job's order (the
    # planned file and place, unless compressed)
    sizes: Dict[str, int]  # each file's bytes


class StagedWrite:
    """One rank's share of a save: snapshot into a staging buffer, then write every file from it
    (`compress`: each tensor's chunks compressed where that shrinks them; "auto": where that also
    shortens the commit, as `pace` measures it). `chunk`: the checksums' and the compression's
    unit, the checkpoint's `chunk_bytes`."""

    def __init__(self, storage: Storage, items: Sequence[StageItem], compress: Union[bool, str] = False,
                 chunk: int = CHUNK_BYTES):
        self.storage, self.items, self.compress, self.chunk = storage, list(items), compress, chunk
        self.packs = bool(compress) or any(item.base is not None for item in self.items)  # else written as staged
        self.sizes: Dict[str, int] = {}
        for item in self.items:
            self.sizes[item.file] = max(self.sizes.get(item.file, 0), item.offset + item.nbytes)
        self.nbytes = sum(hostmem.align_up(size) for size in self.sizes.values())  # staged whole
        # the writers' measurements, to decide by: as many writers at once as files, or cores
        self.pace = Pace(min(len(self.sizes), len(os.sched_getaffinity(0)))) if compress == "auto" else None
        self.buffer: Optional[torch.Tensor] = None
        self.stored_as: Callable[[str], str] = str  # where a planned file is written (an overwrite's generation)
        self._windows: Optional[Windows] = None  # set by the snapshot, from its buffer's size
        self._unwritten: List[int] = []  # per window: its file ranges not yet written
        self._freed = 0  # leading windows written: their halves of the buffer may be reused
        self._ready = {name: 0 for name in self.sizes}  # staged prefix of each file
        self._awaited = {name: 0 for name in self.sizes}  # the staged prefix each file's writer waits for
        self._failed: Optional[Tuple[str, BaseException]] = None  # (which side, its error)
        self._cond = threading.Condition()

    @property
    def pinned(self) -> bool:
        """Whether staging must be pinned: some source lives on a GPU."""
        return any(isinstance(i.source, torch.Tensor) and i.source.device.type == "cuda" for i in self.items)

    def snapshot(self, buffer: torch.Tensor, threads: int = 1) -> None:
        """Copy every item into `buffer`, streaming through it window by window when it is smaller
        than `self.nbytes` (the writers must be running then). Afterwards the sources may change.

        Contiguous host tensors are copied as byte pieces by `threads` threads with streaming
        stores (`hostmem.stream_copy`, the GIL released): one `copy_` per tensor forks and joins
        torch's thread pool every time, which ranks sharing few cores turned into a 2-5x slower
        snapshot here. Other sources (device tensors, strided views, encoded objects) are copied
        by this thread, in order.
        """
        self.buffer = buffer
        try:
            windows = plan_windows(self.sizes, buffer.numel())
            with self._cond:
                self._windows, self._unwritten = windows, [len(w.ranges) for w in windows.windows]
                self._cond.notify_all()
            for k, window in enumerate(windows.windows):
                self._wait_freed(k - 1)  # window k reuses the half of window k - 2
                self._copy_window(window, threads)
        except BaseException as exc:
            self.fail(exc)
            raise

    def _wait_freed(self, count: int) -> None:
        with self._cond:
            while self._freed < count and self._failed is None:
                self._cond.wait()
        self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self._failed is not None:
            side, exc = self._failed
            raise RuntimeError(f"{side} failed: {type(exc).__name__}: {exc}")

    def _copy_window(self, window: Window, threads: int) -> None:
        by_file = {name: [p for i in sorted((i for i in self.items if i.file == name), key=lambda i: i.offset)
                          for p in self._pieces(i, window)]
                   for name in window.ranges}
        # round-robin over files so every writer gets data early
        pieces = [p for group in zip(*[_padded(v, max(map(len, by_file.values()), default=0))
                                       for v in by_file.values()]) for p in group if p is not None]
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

        helpers = [own_threads.thread(copy_shared, "ckpt-snapshot-copy")
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
        with self._cond:  # alignment gaps up to the window's end count as staged too
            for name, (_, end) in window.ranges.items():
                self._ready[name] = max(self._ready[name], end)
            self._cond.notify_all()

    def _pieces(self, item: StageItem, window: Window) -> List["_Piece"]:
        """The pieces of `item` that fall in `window`: its bytes [start, end) there."""
        lo, hi = window.ranges.get(item.file, (0, 0))
        start, end = max(lo, item.offset) - item.offset, min(hi, item.offset + item.nbytes) - item.offset
        if start >= end:
            return []
        at = window.place(item.file, item.offset + start)
        dest = self.buffer[at:at + end - start]
        src = item.source
        if not isinstance(src, torch.Tensor):
            return [_Piece(item.file, item.offset + end, dest, memoryview(src)[start:end])]
        src = src.detach()
        if src.device.type != "cpu" or not src.is_contiguous() or src.is_conj() or src.is_neg():
            whole = start == 0 and end == item.nbytes
            return [_Piece(item.file, item.offset + end, dest, src, span=None if whole else (start, end))]
        return [_Piece(item.file, item.offset + min(end, at + COPY_PIECE), dest, src,
                       host=(dest.data_ptr() + at - start, src.data_ptr() + at, min(COPY_PIECE, end - at)))
                for at in range(start, end, COPY_PIECE)]

    def fail(self, exc: BaseException, side: str = "snapshot") -> None:
        """Stop the other side (the writers, or a streaming snapshot): this one cannot complete."""
        with self._cond:
            if self._failed is None:
                self._failed = (side, exc)
            self._cond.notify_all()

    def write(self, recorder: Optional[Recorder] = None) -> WriteResult:
        """Write every file as the snapshot progresses, a thread per file (a streaming snapshot
        needs every file's writer to free its window), or the calling thread for one file (a
        pool started and joined per save cost a small save more than its write); returns where
        each item went, with its chunk checksums. `recorder` gets each file's write (seconds
        spent in the storage, bytes, O_DIRECT bytes, retries), the checksums' and the
        compression's seconds."""
        result = WriteResult([StoredItem(item.file, item.offset, item.nbytes, []) for item in self.items],
                             dict(self.sizes))
        recorder = recorder or Recorder("save", "", 0, enabled=False)
        names = sorted(self.sizes)
        try:
            if len(names) == 1:
                self._write_file(names[0], result, recorder)
            elif names:
                with own_threads.executor(len(names), "ckpt-write") as pool:
                    list(pool.map(lambda name: self._write_file(name, result, recorder), names))
        except BaseException:
            if self._failed is not None and self._failed[0] == "writing":
                raise self._failed[1]  # the writer that failed first, not one it stopped
            raise
        return result

    def _write_file(self, name: str, result: WriteResult, recorder: Recorder) -> None:
        size = self.sizes[name]
        first, busy, summing = time.time(), 0.0, 0.0
        writer = self.storage.open_writer(self.stored_as(name))
        closing = False
        try:
            sums = _FileSums(self.items, name, self.chunk)
            # compressed chunks of any size go out through page-aligned pieces: O_DIRECT, as plain ones
            packed = (_PackedFile(self.items, name, self._stream(writer), self.chunk, bool(self.compress), self.pace)
                      if self.packs else None)
            pos = 0
            while pos < size:
                with self._cond:
                    while self._windows is None and self._failed is None:
                        self._cond.wait()
                    self._raise_if_failed()
                    k = self._windows.index(name, pos)
                    window = self._windows.windows[k]
                    end = window.ranges[name][1]
                    target = min(end, pos + PIECE)
                    self._awaited[name] = target
                    while self._ready[name] < target and self._failed is None:
                        self._cond.wait()
                    self._raise_if_failed()
                t = time.time()
                data = _bytes(self.buffer[window.place(name, pos):window.place(name, target)])
                if packed is None:
                    writer.write(data)
                else:
                    packed.feed(pos, data)
                busy += time.time() - t
                t = time.time()
                sums.feed(pos, data)
                summing += time.time() - t
                pos = target
                if pos == end:
                    self._written(k)
            t = time.time()
            closing = True  # a close that fails has released the file: it is not closed again
            (writer if packed is None else packed.writer).close()  # fsync: part of the write
            busy += time.time() - t
            sums.into(result.items)
            if packed is not None:
                size = result.sizes[name] = packed.into(result.items)
                recorder.add("compress", first, time.time(), packed.raw, busy=packed.busy)
        except BaseException as exc:
            if not closing:
                with contextlib.suppress(Exception):  # the failure to report is `exc`
                    writer.close()
            self.fail(exc, "writing")
            raise
        end = time.time()
        recorder.add("write", first, end, size, busy=busy, files=1, direct_bytes=writer.direct_bytes,
                     retries=writer.retries)
        recorder.add("checksum", first, end, size, busy=summing)
        recorder.record.info.setdefault("files", []).append(
            {"file": name, "bytes": size, "start": first, "end": end, "seconds": round(busy, 6),
             "direct_bytes": writer.direct_bytes, "retries": writer.retries})

    def _stream(self, writer) -> AlignedStream:
        return AlignedStream(writer if self.pace is None else TimedWriter(writer, self.pace), PIECE)

    def _written(self, k: int) -> None:
        """One file's range of window `k` is written: the window's half is free once all are."""
        with self._cond:
            self._unwritten[k] -= 1
            while self._freed < len(self._unwritten) and not self._unwritten[self._freed]:
                self._freed += 1
            self._cond.notify_all()


class _FileItems:
    """A file's bytes, fed in order as they are written, handed to the items they belong to:
    `_take(index, view, at)` gets bytes [at, at + len(view)) of item `index`."""

    def __init__(self, items: Sequence[StageItem], name: str):
        self.order = deque(sorted((i for i, it in enumerate(items) if it.file == name), key=lambda i: items[i].offset))
        self.items, self.indices = items, list(self.order)

    def feed(self, pos: int, data: memoryview) -> None:
        """Bytes [pos, pos + len(data)) of the file as planned."""
        self._hand(pos, data, self._within(pos, pos + len(data)))

    def _hand(self, pos: int, data: memoryview, within: List[int]) -> None:
        """Hand bytes [pos, pos + len(data)) to the items `within` them."""
        end = pos + len(data)
        for index in within:
            item = self.items[index]
            start, stop = max(pos, item.offset), min(end, item.offset + item.nbytes)
            self._take(index, data[start - pos:stop - pos], start - item.offset)
        self._passed(end)

    def _within(self, pos: int, end: int) -> List[int]:
        """The items with bytes in [pos, end)."""
        found = []
        for index in self.order:
            item = self.items[index]
            if item.offset >= end:
                break
            if max(pos, item.offset) < min(end, item.offset + item.nbytes):
                found.append(index)
        return found

    def _passed(self, end: int) -> None:
        while self.order and self.items[self.order[0]].offset + self.items[self.order[0]].nbytes <= end:
            self.order.popleft()

    def _take(self, index: int, view: memoryview, at: int) -> None:
        raise NotImplementedError


class _FileSums(_FileItems):
    """The chunk checksums of one file's items."""

    def __init__(self, items: Sequence[StageItem], name: str, chunk: int):
        super().__init__(items, name)
        self.sums = {i: ChunkSums(chunk) for i in self.indices}

    def _take(self, index: int, view: memoryview, at: int) -> None:
        self.sums[index].feed(view)

    def into(self, written: List[StoredItem]) -> None:
        for index, sums in self.sums.items():
            written[index].crc32c = sums.result()


class _PackedFile(_FileItems):
    """One file's items, compressed chunk by chunk, written one after the other. Until a chunk is
    stored otherwise than staged, the file is written as planned, gaps included, and a piece whose
    items all go as they are is written whole, as a plain save's; from then on the items follow one
    another without the plan's gaps. A delta item's chunks are XORed with its base's first, and one
    that did not change is not written. With `compress`, a tensor whose first chunk does not pay is
    stored as it is; without, every item but the deltas; objects always. With a `pace`, a chunk
    (but a delta's) is compressed only while that shortens the commit. A tensor none of whose
    chunks was compressed is recorded as stored as it is: its bytes are the same."""

    def __init__(self, items: Sequence[StageItem], name: str, writer, chunk: int, compress: bool,
                 pace: Optional[Pace] = None):
        super().__init__(items, name)
        self.writer, self.chunk, self.pace = writer, chunk, pace
        self.placed = {i: StoredItem(name, 0, items[i].nbytes, [], items[i].group if compress or items[i].base else 0,
                                     delta=items[i].base is not None) for i in self.indices}
        self.partial: Dict[int, bytearray] = {}
        self.begun: set = set()
        self.tried: set = set()  # items a chunk of which was compressed
        self.plain: set = set()  # items stored as they are from here on
        self.started = 0  # where the last item begun starts
        self.synced = True  # every byte so far stored as staged, where planned
        self.packer: Optional[Packer] = None
        self.pos = self.raw = 0
        self.busy = 0.0

    def feed(self, pos: int, data: memoryview) -> None:
        within = self._within(pos, pos + len(data))
        if self.synced and self.pos == pos and all(self._whole(index) for index in within):
            self._put(None, data)
            for index in within:
                self._begin(index, self.items[index].offset)
                self.placed[index].group = 0
            self._passed(pos + len(data))
            return
        self._hand(pos, data, within)
        if self.synced and not self.partial:  # the piece's last gap too: the next starts where planned
            self._put(None, bytes(pos + len(data) - self.pos))

    def _whole(self, index: int) -> bool:
        """Whether the rest of item `index` goes as staged: an object or an item stored so, or one
        begun as it is whose chunks would be."""
        out = self.placed[index]
        return not out.group or (not out.packed and index not in self.partial and self._as_is(index, out))

    def _begin(self, index: int, at: int) -> None:
        """Item `index` starts at `at` of the file; what is not written before it is a gap."""
        if index not in self.begun:
            if at > self.pos:
                self._put(None, bytes(at - self.pos))
            self.begun.add(index)
            self.placed[index].offset = self.started = at

    def _take(self, index: int, view: memoryview, at: int) -> None:
        """Bytes [at, at + len(view)) of item `index`: whole chunks go out from the view, parts of
        one gather first."""
        nbytes, out = self.items[index].nbytes, self.placed[index]
        if self.synced:
            self._begin(index, self.items[index].offset)
        elif index not in self.begun:
            # the one before stored nothing (a delta of no change): a gap byte keeps every item's
            # offset its own, as loads key reads by it; an item stored as it is starts page-aligned,
            # so that it goes out without a copy
            gap = 1 if self.begun and self.pos == self.started else 0
            if nbytes >= DIRECT and (not out.group or self._as_is(index, out)):
                gap += -(self.pos + gap) % hostmem.PAGE
            self._begin(index, self.pos + gap)
        while view:
            if not out.group:  # an object, or a tensor whose first chunk did not pay: as it is
                self._put(out, view)
                return
            start = at // self.chunk * self.chunk
            length = min(self.chunk, nbytes - start)
            n = min(len(view), start + length - at)
            if at == start and n == length and self._as_is(index, out):
                n = self._run(at, len(view), nbytes)
                self._put(out, view[:n], [min(self.chunk, nbytes - k) for k in range(at, at + n, self.chunk)])
            elif at == start and n == length:
                self._pack(index, out, view[:n])
            else:
                gathered = self.partial.setdefault(index, bytearray())
                gathered += view[:n]
                if len(gathered) == length:
                    self._chunk(index, out, self.partial.pop(index))
            view, at = view[n:], at + n

    def _run(self, at: int, have: int, nbytes: int) -> int:
        """How many bytes from chunk start `at` of an item of `nbytes` to store as they are in one
        write, of `have` at hand: every whole chunk, but one while storage's pace is unknown (the
        next may be worth compressing)."""
        if self.pace is not None and not self.pace.known():
            return min(self.chunk, nbytes - at)
        n = min(have, nbytes - at)
        return n if at + n == nbytes else n - n % self.chunk

    def _as_is(self, index: int, out: StoredItem) -> bool:
        """Whether the item's next chunk is stored as it is: not a delta's, and compressing it does
        not pay (its first did not shrink, or the pace says it would lengthen the commit)."""
        return not out.delta and (index in self.plain or (
            self.pace is not None and self.pace.pays((out.group, self.items[index].head)) is False))

    def _chunk(self, index: int, out: StoredItem, data) -> None:
        """A whole chunk gathered from parts: as it is, or through `_pack`."""
        if self._as_is(index, out):
            self._put(out, data, [len(data)])
        else:
            self._pack(index, out, data)

    def _pack(self, index: int, out: StoredItem, data) -> None:
        """A whole chunk not known to go as it is: XORed with its base (a delta's), compressed,
        and written as whichever pays."""
        t = time.time()
        self.raw += len(data)
        if out.delta:
            self.synced = False
            data = xor(data, self.items[index].base(len(out.packed)))
            if not data.any():  # unchanged: nothing stored
                out.packed.append(0)
                self.busy += time.time() - t
                return
        self.packer = self.packer or Packer()
        cpu = time.thread_time()
        frame = self.packer.pack(data, out.group, self.items[index].head)
        # the pace is measured in this thread's CPU time: waits for the GIL or a core are not
        # the compressing's cost, and one chunk's measure decides a kind's
        seconds = time.thread_time() - cpu
        self.busy += time.time() - t
        stored = data if frame is None else frame
        if not out.delta:
            if frame is None and index not in self.tried:  # the first chunk tried did not pay:
                self.plain.add(index)                          # none of the rest is tried
            self.tried.add(index)
            if self.pace is not None:  # measured; written compressed while that pays (a kind's
                kind = (out.group, self.items[index].head)  # first chunk is compressed to find out)
                self.pace.compressed(kind, len(data), len(stored), seconds)
                stored = stored if self.pace.pays(kind) else data
        self.synced = self.synced and stored is data
        self._put(out, stored, [len(stored)])

    def _put(self, out: Optional[StoredItem], stored, chunks: Sequence[int] = ()) -> None:
        """Write `stored`: its chunks' stored lengths are `chunks` (a compressed item's)."""
        if len(stored):
            self.writer.write(stored)
            self.pos += len(stored)
        if chunks:
            out.packed.extend(chunks)

    def into(self, written: List[StoredItem]) -> int:
        """Each item's place and chunks (its checksums already there); the file's size."""
        for index, out in self.placed.items():
            if not out.packed or (not out.delta and sum(out.packed) == out.nbytes):  # every chunk as it is
                out.group, out.delta, out.packed = 0, False, []
            out.crc32c, written[index] = written[index].crc32c, out
        return self.pos


@dataclass
class _Piece:
    """A part of the snapshot: bytes of one item, ending at `end` in its file."""
    file: str
    end: int
    dest: torch.Tensor
    source: Union[torch.Tensor, memoryview]  # also keeps a host copy's source alive
    host: Optional[Tuple[int, int, int]] = None  # (dest, src, nbytes) for a plain host copy
    span: Optional[Tuple[int, int]] = None  # only these bytes of a tensor source (a streamed window)

    def run(self) -> None:
        if self.host is not None:
            hostmem.stream_copy(*self.host)
        elif isinstance(self.source, torch.Tensor):
            src = self.source
            if self.span is None:
                self.dest.view(src.dtype).view(src.shape).copy_(src, non_blocking=True)
            else:
                self.dest.copy_(_byte_range(src, *self.span), non_blocking=True)
            if src.device.type != "cpu":
                torch.cuda.synchronize()
        else:
            memoryview(self.dest.numpy())[:] = self.source


def _byte_range(src: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Bytes [start, end) of `src` as laid out contiguously, on its device, copying at most the
    rows they span (a strided source has no bytes of its own to slice)."""
    if src.dim() == 0:
        return src.resolve_conj().resolve_neg().reshape(1).view(torch.uint8)[start:end]
    row = src[0].numel() * src.element_size()
    first, last = start // row, -(-end // row)
    block = src[first:last].resolve_conj().resolve_neg().contiguous()
    return block.reshape(-1).view(torch.uint8)[start - first * row:end - first * row]


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
            queue, ready = self.left[name], job._ready[name]
            while queue and queue[0] in self.finished:
                job._ready[name] = self.pieces[queue.popleft()].end
            if ready < job._awaited[name] <= job._ready[name]:
                job._cond.notify_all()


def _padded(values: list, n: int) -> list:
    return values + [None] * (n - len(values))


def _bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.numpy()) if t.numel() else memoryview(b"")
