"""Execution: snapshot and write a rank's share of a save; run a load plan's reads and copies.

Side effects live here (and in storage); what to do was decided by `plan`.

Save is a pipeline over one staging buffer: the snapshot copies items into it file by file in
offset order, and one writer thread per file follows the snapshot's progress, writing aligned
pieces as soon as they are staged and checksumming each item once it is complete.
"""
from __future__ import annotations

import ctypes
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

from .errors import CorruptCheckpointError
from .format import chunk_checksums, dtype_from_name
from .fragment import Fragment, flat_offset, sub_view
from .plan import ReadItem, Transfer
from .staging import align_up
from .storage import Storage

PIECE = 8 << 20  # bytes per write call: big enough for the disk, small enough to pipeline
COPY_PIECE = 4 << 20  # bytes per snapshot copy: threads share big tensors, writers follow early
READ_PIECE = 8 << 20  # a big stored range is read as pieces of this size in parallel


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
        self._ready = {name: 0 for name in self.sizes}  # staged prefix of each file
        self._failed: Optional[BaseException] = None
        self._cond = threading.Condition()

    def snapshot(self, buffer: torch.Tensor, threads: int = 1) -> None:
        """Copy every item into `buffer` (>= self.nbytes). Afterwards the sources may change.

        Contiguous host tensors are copied as byte pieces by `threads` threads with memmove (the
        GIL released): one `copy_` per tensor forks and joins torch's thread pool every time, which
        ranks sharing few cores turned into a 2-5x slower snapshot here. Other sources (device
        tensors, strided views, encoded objects) are copied by this thread, in order.
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

    def write(self, threads: int) -> List[List[int]]:
        """Write every file as the snapshot progresses; returns each item's chunk checksums."""
        checksums: List[List[int]] = [[] for _ in self.items]
        with ThreadPoolExecutor(max(1, min(threads, len(self.sizes))), thread_name_prefix="ckpt-write") as pool:
            list(pool.map(lambda name: self._write_file(name, checksums), sorted(self.sizes)))
        return checksums

    def _write_file(self, name: str, checksums: List[List[int]]) -> None:
        size, base = self.sizes[name], self.base[name]
        pending = sorted((i for i, it in enumerate(self.items) if it.file == name),
                         key=lambda i: self.items[i].offset)
        writer = self.storage.open_writer(name)
        try:
            pos = 0
            while pos < size:
                target = min(size, pos + PIECE)
                with self._cond:
                    while self._ready[name] < target and self._failed is None:
                        self._cond.wait()
                    if self._failed is not None:
                        raise RuntimeError(f"snapshot failed: {type(self._failed).__name__}: {self._failed}")
                writer.write(_bytes(self.buffer[base + pos:base + target]))
                pos = target
                while pending and self.items[pending[0]].offset + self.items[pending[0]].nbytes <= pos:
                    index = pending.pop(0)
                    start = base + self.items[index].offset
                    checksums[index] = chunk_checksums(_bytes(self.buffer[start:start + self.items[index].nbytes]))
        finally:
            writer.close()


@dataclass
class _Piece:
    """A part of the snapshot: bytes of one item, ending at `end` in its file."""
    file: str
    end: int
    dest: torch.Tensor
    source: Union[torch.Tensor, bytes]  # also keeps a memmove's source alive
    host: Optional[Tuple[int, int, int]] = None  # (dest, src, nbytes) for a plain memmove

    def run(self) -> None:
        if self.host is not None:
            ctypes.memmove(*self.host)
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


# ---------------------------------------------------------------------------- load


def read_checked(storage: Storage, key: str, file: str, offset: int, nbytes: int, start: int, end: int,
                 crc32c: Sequence[int], chunk: int, buffer=None) -> bytearray:
    """Bytes [start, end) of an item stored at `offset`, verified against its chunk checksums."""
    buffer = bytearray(end - start) if buffer is None else buffer
    storage.read_into(file, offset + start, buffer)
    expected = crc32c[start // chunk:start // chunk + len(range(start, end, chunk))]
    if chunk_checksums(buffer, chunk) != list(expected):
        raise CorruptCheckpointError(f"checksum mismatch in {key}: file {file}, bytes "
                                     f"{offset + start}..{offset + end}; the checkpoint is corrupt")
    return buffer


def copy_out(read: ReadItem, data, targets: Sequence[Fragment], dtype: torch.dtype) -> None:
    """Copy the regions `read` feeds from `data` (its bytes [start, end)) into their targets."""
    stored = read.stored
    flat = torch.frombuffer(data, dtype=torch.uint8).view(dtype) if len(data) else None
    strides = [1] * len(stored.lengths)
    for d in range(len(strides) - 2, -1, -1):
        strides[d] = strides[d + 1] * stored.lengths[d + 1]
    first = read.start // dtype.itemsize
    for copy in read.copies:
        target = targets[copy.target]
        rel = [o - so for o, so in zip(copy.region[0], stored.offsets)]
        src = flat.as_strided(copy.region[1], strides, flat_offset(stored.lengths, rel) - first)
        sub_view(target.local, target.offsets, copy.region).copy_(src)


def _direct_destination(read: ReadItem, targets: Sequence[Fragment], dtype: torch.dtype):
    """The destination's own bytes when a whole stored box lands unchanged in one contiguous CPU
    view (same layout, or row resharding): the read then goes straight there, with no copy."""
    stored = read.stored
    if len(read.copies) != 1 or (read.start, read.end) != (0, stored.nbytes):
        return None
    copy = read.copies[0]
    if copy.region != (tuple(stored.offsets), tuple(stored.lengths)):
        return None
    target = targets[copy.target]
    view = sub_view(target.local, target.offsets, copy.region)
    if view.dtype != dtype or view.device.type != "cpu" or not view.is_contiguous() or not view.numel():
        return None
    return memoryview(view.reshape(-1).view(torch.uint8).numpy())


def read_items(storage: Storage, reads: Sequence[ReadItem], targets: Sequence[Fragment],
               dtypes: Dict[str, str], chunk: int, threads: int = 2,
               transfers: Optional[Dict[int, Transfer]] = None, rank: int = 0, group=None) -> int:
    """Run this rank's reads (and its part of the read-once exchange); returns bytes read from storage.

    Reads run on a thread pool; each verified range is copied into its destination views as soon
    as it lands (straight into the destination when it is one contiguous view). `transfers` maps a
    read's position to its shared read: its reader reads the union range once and sends it to
    the other ranks needing it. Ranges that need a buffer take it from a `_Ring`, one for reads
    and one for receives, both in the transfers' order, so the oldest transfer can always finish.
    """
    import torch.distributed as dist

    transfers = transfers or {}
    send_lock = threading.Lock()  # one thread at a time posts sends on the group
    failed: List[BaseException] = []

    class Job:
        """One read, split into pieces that run in parallel; the last piece to land finishes it."""

        def __init__(self, position: int):
            self.read = reads[position]
            self.transfer = transfers.get(position)
            self.start, self.end = ((self.transfer.start, self.transfer.end) if self.transfer
                                    else (self.read.start, self.read.end))
            self.dtype = dtype_from_name(dtypes[self.read.key])
            direct = None if self.transfer is not None else _direct_destination(self.read, targets, self.dtype)
            self.direct = direct is not None
            self.data = direct  # or the bytes of `buffer`, a range of the read ring taken at dispatch
            self.buffer: Optional[torch.Tensor] = None
            step = max(chunk, READ_PIECE // chunk * chunk)  # pieces start on checksum chunks
            self.pieces = [(s, min(s + step, self.end)) for s in range(self.start, self.end, step)]
            self.left = len(self.pieces)
            self.lock = threading.Lock()
            self.done = threading.Event()
            self.sends: list = []

        def run_piece(self, start: int, end: int) -> int:
            try:
                stored = self.read.stored
                read_checked(storage, self.read.key, stored.file, stored.offset, stored.nbytes, start, end,
                             stored.crc32c, chunk, buffer=self.data[start - self.start:end - self.start])
                with self.lock:
                    self.left -= 1
                    last = self.left == 0
                if last:
                    self.finish()
                return end - start
            except BaseException as exc:
                failed.append(exc)
                self.done.set()  # its buffer may be retired: nothing more will land there
                raise

        def finish(self) -> None:
            if self.transfer is not None:
                with send_lock:
                    self.sends = [dist.isend(self.buffer, group=group, group_dst=r, tag=self.transfer.tag)
                                  for r in self.transfer.needers if r != rank]
            if not self.direct:
                copy_out(self.read, self.data[self.read.start - self.start:self.read.end - self.start], targets,
                         self.dtype)
            self.done.set()

        def retire(self) -> None:
            self.done.wait()
            for work in self.sends:
                work.wait()

    # shared reads first, in the transfers' order: the other ranks wait for them
    order = sorted(range(len(reads)), key=lambda p: (0, transfers[p].tag) if p in transfers else (1, p))
    jobs = [Job(p) for p in order if p not in transfers or transfers[p].reader == rank]
    receiving = [(reads[p], t) for p, t in sorted(transfers.items(), key=lambda pt: pt[1].tag) if t.reader != rank]
    read_ring = _Ring([job.end - job.start for job in jobs if not job.direct])
    receive_ring = _Ring([t.end - t.start for _, t in receiving])
    nbytes = 0
    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="ckpt-read") as pool:
        futures = []

        def dispatch() -> None:  # in the transfers' order, waiting for ring space as needed
            try:
                for job in jobs:
                    if failed:
                        return
                    if not job.direct:
                        job.buffer = read_ring.take(job.end - job.start, job.retire)
                        job.data = memoryview(job.buffer.numpy())
                    futures.extend(pool.submit(job.run_piece, s, e) for s, e in job.pieces)
                    if not job.pieces:  # nothing to read (an empty range) still completes its transfer
                        job.finish()
            except BaseException as exc:
                failed.append(exc)

        dispatcher = threading.Thread(target=dispatch, name="ckpt-read-dispatch", daemon=True)
        dispatcher.start()
        try:
            for read, t in receiving:  # taking ring space completes the oldest receives
                receive = _Receive(read, t, targets, dtype_from_name(dtypes[read.key]))
                receive.buffer = receive_ring.take(t.end - t.start, receive.complete)
                receive.work = dist.irecv(receive.buffer, group=group, group_src=t.reader, tag=t.tag)
            receive_ring.drain()
        finally:
            dispatcher.join()
            for future in futures:
                if future.exception() is None:
                    nbytes += future.result()
        if failed:
            raise failed[0]
        read_ring.drain()
    return nbytes


@dataclass
class _Receive:
    """A shared read another rank reads and sends here: copied out once it has arrived."""
    read: ReadItem
    transfer: Transfer
    targets: Sequence[Fragment]
    dtype: torch.dtype
    buffer: Optional[torch.Tensor] = None
    work: object = None

    def complete(self) -> None:
        self.work.wait()
        t, read = self.transfer, self.read
        copy_out(read, memoryview(self.buffer.numpy())[read.start - t.start:read.end - t.start], self.targets,
                 self.dtype)


class _Ring:
    """Reusable memory for the ranges a load reads or receives before copying them out.

    Ranges are taken in order and retired oldest first (`retire` waits until a range is copied
    out and sent), so memory stays bounded and is touched once: fresh memory for every range of a
    1 GiB resharded load cost 2-5 s of page faults here, and twice its bytes in memory.
    """

    BYTES = 64 << 20  # unless one range needs more
    ALIGN = 64

    def __init__(self, sizes: Sequence[int]):
        need = max([0] + [align_up(n, self.ALIGN) for n in sizes])
        self.size = max(need, min(self.BYTES, sum(align_up(n, self.ALIGN) for n in sizes)))
        self.memory = torch.empty(self.size, dtype=torch.uint8) if self.size else None
        self.entries: deque = deque()  # (start, end, retire) in taking order

    def take(self, nbytes: int, retire: Callable[[], None]) -> torch.Tensor:
        n = align_up(nbytes, self.ALIGN)
        while True:
            start = self._fit(n)
            if start is not None:
                self.entries.append((start, start + n, retire))
                return self.memory[start:start + nbytes] if n else torch.empty(0, dtype=torch.uint8)
            self._retire_oldest()

    def _fit(self, n: int) -> Optional[int]:
        if not self.entries:
            return 0
        tail, head = self.entries[0][0], self.entries[-1][1]
        if self.entries[-1][0] >= tail:  # live memory is [tail, head): free after it, then before it
            if head + n <= self.size:
                return head
            return 0 if n <= tail else None
        return head if head + n <= tail else None  # wrapped: free is [head, tail)

    def _retire_oldest(self) -> None:
        self.entries[0][2]()
        self.entries.popleft()

    def drain(self) -> None:
        while self.entries:
            self._retire_oldest()
