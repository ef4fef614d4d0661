"""Execution: snapshot and write a rank's share of a save; run a load plan's reads and copies.

Side effects live here (and in storage); what to do was decided by `plan`.

Save is a pipeline over one staging buffer: the snapshot copies items into it file by file in
offset order, and one writer thread per file follows the snapshot's progress, writing aligned
pieces as soon as they are staged and checksumming each item once it is complete.
"""
from __future__ import annotations

import logging
import math
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

from .errors import CorruptCheckpointError
from .format import chunk_checksums, dtype_from_name
from . import hostmem, shm
from .fragment import Fragment, flat_offset, sub_view
from .plan import ReadItem, Transfer, read_regions
from .hostmem import align_up, aligned_empty
from .storage import Storage

PIECE = 8 << 20  # bytes per write call: big enough for the disk, small enough to pipeline
COPY_PIECE = 4 << 20  # bytes per snapshot copy: threads share big tensors, writers follow early
READ_PIECE = 8 << 20  # a big stored range is read as pieces of this size in parallel

log = logging.getLogger("ckpt_plugins")


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


def region_view(data, dtype: torch.dtype, first: int, stored_lengths: Sequence[int], stored_offsets: Sequence[int],
                region) -> torch.Tensor:
    """`region` (global coordinates) of a stored box, as a strided view of `data`: the box's
    elements from index `first` on."""
    flat = torch.frombuffer(data, dtype=torch.uint8).view(dtype)
    strides = [1] * len(stored_lengths)
    for d in range(len(strides) - 2, -1, -1):
        strides[d] = strides[d + 1] * stored_lengths[d + 1]
    rel = [o - so for o, so in zip(region[0], stored_offsets)]
    return flat.as_strided(region[1], strides, flat_offset(stored_lengths, rel) - first)


def copy_out(read: ReadItem, data, targets: Sequence[Fragment], dtype: torch.dtype) -> None:
    """Copy the regions `read` feeds from `data` (its bytes [start, end)) into their targets."""
    if not len(data):
        return
    stored = read.stored
    for copy in read.copies:
        target = targets[copy.target]
        src = region_view(data, dtype, read.start // dtype.itemsize, stored.lengths, stored.offsets, copy.region)
        sub_view(target.local, target.offsets, copy.region).copy_(src)


def _region_bytes(region, itemsize: int) -> int:
    return math.prod(region[1]) * itemsize


def _contiguous_in(stored_lengths: Sequence[int], region) -> bool:
    """Whether `region`'s elements are one contiguous run of the stored box (row-major)."""
    lengths = region[1]
    d = next((i for i, n in enumerate(lengths) if n != 1), len(lengths))
    return all(n == s for n, s in zip(lengths[d + 1:], stored_lengths[d + 1:]))


def _needs_packing(stored_lengths: Sequence[int], regions) -> bool:
    """A payload is sent as a view of the read bytes when it is one contiguous region; else the
    reader packs the regions one after the other."""
    return len(regions) != 1 or not _contiguous_in(stored_lengths, regions[0])


def _contiguous_destination(read: ReadItem, targets: Sequence[Fragment], dtype: torch.dtype, whole: bool = True):
    """The destination's own bytes when the read's one region lands unchanged in one contiguous
    CPU view: the read (`whole`: the whole stored box, same layout or row resharding) or a
    received payload can then go straight there."""
    stored = read.stored
    if len(read.copies) != 1 or (whole and (read.start, read.end) != (0, stored.nbytes)):
        return None
    copy = read.copies[0]
    if whole and copy.region != (tuple(stored.offsets), tuple(stored.lengths)):
        return None
    target = targets[copy.target]
    view = sub_view(target.local, target.offsets, copy.region)
    if view.dtype != dtype or view.device.type != "cpu" or not view.is_contiguous() or not view.numel():
        return None
    return view.reshape(-1).view(torch.uint8)


def read_items(storage: Storage, reads: Sequence[ReadItem], targets: Sequence[Fragment],
               dtypes: Dict[str, str], chunk: int, threads: int = 2,
               transfers: Optional[Dict[int, Transfer]] = None, rank: int = 0, group=None,
               hosts: Optional[Sequence[Optional[str]]] = None) -> int:
    """Run this rank's reads (and its part of the read-once exchange); returns bytes read from storage.

    Reads run on a thread pool; each verified range is copied into its destination views by a
    copier thread (read straight into the destination when it is one contiguous view the device
    can fill directly). `transfers` maps a read's position to its shared read: its reader reads
    the union range once. Needers on the reader's host (`hosts`: one `shm.host_key` per rank,
    given to every rank or none) copy their regions out of the reader's read ring in shared
    memory, told where by a header; the reader sends every other needer only the regions it
    wants, packed (a contiguous region goes as a view), which lands straight in the needer's
    destination when that is one contiguous view. Ranges that need a buffer take it from a
    `_Ring`, one for reads (and packing) and one for receives, both in the transfers' order, so
    the oldest transfer can always finish.
    """
    import torch.distributed as dist

    transfers = transfers or {}
    order = sorted(range(len(reads)), key=lambda p: (0, transfers[p].tag) if p in transfers else (1, p))
    ready = [True] * len(hosts or ())  # readers whose ring is shared

    def shares(reader: int, needer: int) -> bool:
        """Whether `needer` copies what `reader` reads out of the reader's shared ring."""
        return (hosts is not None and reader != needer and hosts[reader] is not None
                and hosts[reader] == hosts[needer] and ready[reader])

    jobs = _read_jobs(storage, reads, targets, dtypes, chunk, transfers, rank, order, shares)
    segment = None
    if hosts is not None:  # every rank: agree on which readers share their ring
        sizes = [job.ring_bytes for job in jobs]
        try:
            segment = shm.Segment.create(_Ring.size_for(sizes)) if any(job.local for job in jobs) else None
        except OSError as exc:
            log.warning("no shared memory for this load (%s): ranks on this host exchange over the group", exc)
        shared = torch.tensor([int(segment is not None or not any(job.local for job in jobs))])
        flags = [torch.zeros(1, dtype=shared.dtype) for _ in hosts]
        dist.all_gather(flags, shared, group=group)
        ready[:] = [bool(f.item()) for f in flags]
        if not all(ready):  # a reader without a segment sends to its host over the group
            jobs = _read_jobs(storage, reads, targets, dtypes, chunk, transfers, rank, order, shares)
    try:
        return _run_reads(storage, jobs, reads, targets, dtypes, chunk, transfers, rank, group, shares, segment, threads)
    finally:
        if segment is not None:
            segment.unlink()


class _Job:
    """One read of this rank: split into pieces that run in parallel; the last to land hands it
    to the copier, which copies it into its destination and passes it on to the other needers."""

    def __init__(self, storage: Storage, read: ReadItem, transfer: Optional[Transfer], targets: Sequence[Fragment],
                 dtype: torch.dtype, chunk: int, rank: int, shares: Callable[[int, int], bool]):
        self.read, self.transfer, self.dtype = read, transfer, dtype
        t = transfer
        self.start, self.end = (t.start, t.end) if t else (read.start, read.end)
        self.local = [r for r in t.needers if shares(rank, r)] if t else []
        self.remote = [(r, g) for r, g in zip(t.needers, t.wants) if r != rank and not shares(rank, r)] if t else []
        own = (self.start, self.end) == (read.start, read.end)
        self.dest = _contiguous_destination(read, targets, dtype) if own else None
        # Straight into the destination, unless staging in page-aligned memory lets the read
        # bypass the page cache (a destination is rarely page aligned itself), or ranks on this
        # host copy from the shared ring: then the copier copies it there.
        align = storage.direct_alignment
        bounce = (self.dest is not None and bool(align) and (read.stored.offset + self.start) % align == 0
                  and self.dest.data_ptr() % align != 0 and self.end - self.start >= align)
        self.direct = None if bounce or self.local else self.dest
        self.data = None if self.direct is None else memoryview(self.direct.numpy())
        self.memory: Optional[torch.Tensor] = None  # ring memory, when the read lands there
        # payloads to pack, one per distinct region list among the needers on other hosts
        self.packed: Dict[tuple, Optional[torch.Tensor]] = {
            g: None for _, g in self.remote if _needs_packing(read.stored.lengths, g)}
        self.ring_bytes = ((align_up(self.end - self.start, _Ring.ALIGN) if self.direct is None else 0)
                           + sum(align_up(sum(_region_bytes(g, dtype.itemsize) for g in regions), _Ring.ALIGN)
                                 for regions in self.packed))
        step = max(chunk, READ_PIECE // chunk * chunk)  # pieces start on checksum chunks
        self.pieces = [(s, min(s + step, self.end)) for s in range(self.start, self.end, step)]
        self.left = len(self.pieces)
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.works: list = []  # sends and acknowledgements to wait for before the range is reused
        self.keep: list = []  # what those works send from or receive into

    def take(self, memory: torch.Tensor) -> None:
        """Place the read bytes (unless they go to the destination) and the packed payloads."""
        at = 0
        if self.direct is None:
            self.memory = memory
            self.data = memoryview(memory[:self.end - self.start].numpy())
            at = align_up(self.end - self.start, _Ring.ALIGN)
        for regions in self.packed:
            n = sum(_region_bytes(g, self.dtype.itemsize) for g in regions)
            self.packed[regions] = memory[at:at + n]
            at = align_up(at + n, _Ring.ALIGN)

    def payload(self, regions) -> torch.Tensor:
        stored, first = self.read.stored, self.start // self.dtype.itemsize
        views = [region_view(self.data, self.dtype, first, stored.lengths, stored.offsets, g) for g in regions]
        out = self.packed.get(regions)
        if out is None:  # one contiguous region: its bytes as they were read
            return views[0].reshape(-1).view(torch.uint8)
        at = 0
        for view in views:
            n = view.numel() * view.element_size()
            out[at:at + n].view(self.dtype).view(view.shape).copy_(view)
            at += n
        return out

    def retire(self) -> None:
        self.done.wait()
        while self.works:  # each once: waiting twice on a finished gloo work blocks forever
            self.works.pop().wait()


def _read_jobs(storage, reads, targets, dtypes, chunk, transfers, rank, order, shares) -> List[_Job]:
    return [_Job(storage, reads[p], transfers.get(p), targets, dtype_from_name(dtypes[reads[p].key]), chunk, rank, shares)
            for p in order if p not in transfers or transfers[p].reader == rank]


def _run_reads(storage, jobs, reads, targets, dtypes, chunk, transfers, rank, group, shares, segment, threads) -> int:
    import torch.distributed as dist

    send_lock = threading.Lock()  # one thread at a time posts sends on the group
    failed: List[BaseException] = []

    def run_piece(job: _Job, start: int, end: int) -> int:
        try:
            stored = job.read.stored
            read_checked(storage, job.read.key, stored.file, stored.offset, stored.nbytes, start, end,
                         stored.crc32c, chunk, buffer=job.data[start - job.start:end - job.start])
            with job.lock:
                job.left -= 1
                last = job.left == 0
            if last:
                copier.submit(finish, job)
            return end - start
        except BaseException as exc:
            failed.append(exc)
            job.done.set()  # its buffer may be retired: nothing more will land there
            raise

    def finish(job: _Job) -> None:
        """Copy the bytes read into the destination and pass them on (on the copier thread)."""
        try:
            if job.dest is not None and job.direct is None:
                hostmem.copy(job.dest.data_ptr(), job.memory.data_ptr(), job.end - job.start)
            t = job.transfer
            if t is not None:
                payloads = {g: job.payload(g) for _, g in job.remote}
                header = segment.header(job.memory.data_ptr() - segment.tensor.data_ptr()) if job.local else None
                acks = [torch.empty(1, dtype=torch.int64) for _ in job.local]
                job.keep = [header, acks]
                with send_lock:
                    job.works = [dist.isend(payloads[g], group=group, group_dst=r, tag=t.tag) for r, g in job.remote]
                    for r, ack in zip(job.local, acks):
                        job.works += [dist.isend(header, group=group, group_dst=r, tag=t.tag),
                                      dist.irecv(ack, group=group, group_src=r, tag=t.tag)]
            if job.dest is None:
                copy_out(job.read, job.data[job.read.start - job.start:job.read.end - job.start], targets, job.dtype)
        except BaseException as exc:
            failed.append(exc)
        finally:
            job.done.set()

    receiving = [_Receive(reads[p], t, targets, dtype_from_name(dtypes[reads[p].key]), shares(t.reader, rank))
                 for p, t in sorted(transfers.items(), key=lambda pt: pt[1].tag) if t.reader != rank]
    read_ring = _Ring([job.ring_bytes for job in jobs], memory=segment.tensor if segment is not None else None)
    receive_ring = _Ring([r.nbytes for r in receiving if r.direct is None and not r.local])
    attached, acks, ack = shm.Attached(), [], torch.zeros(1, dtype=torch.int64)
    unacked = {r for job in jobs for r in job.local}  # ranks that have not attached the segment yet

    def retire(job: _Job) -> None:
        job.retire()
        unacked.difference_update(job.local)
        if segment is not None and not unacked:  # every rank attached: the name can go
            segment.unlink()

    nbytes = 0
    # Read threads only read and verify, keeping the device's queue full; one copier thread sends
    # and copies what they read (copying on the read threads left the device idle here).
    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="ckpt-read") as pool, \
            ThreadPoolExecutor(1, thread_name_prefix="ckpt-copy") as copier:
        futures = []

        def dispatch() -> None:  # in the transfers' order, waiting for ring space as needed
            try:
                for job in jobs:
                    if failed:
                        return
                    if job.ring_bytes:
                        job.take(read_ring.take(job.ring_bytes, lambda job=job: retire(job)))
                    futures.extend(pool.submit(run_piece, job, s, e) for s, e in job.pieces)
                    if not job.pieces:  # nothing to read (an empty range) still completes its transfer
                        copier.submit(finish, job)
            except BaseException as exc:
                failed.append(exc)

        dispatcher = threading.Thread(target=dispatch, name="ckpt-read-dispatch", daemon=True)
        dispatcher.start()
        try:
            for receive in receiving:  # headers and straight-to-destination payloads: posted at once
                if receive.local or receive.direct is not None:
                    receive.buffer = torch.empty(shm.HEADER_BYTES, dtype=torch.uint8) if receive.local else receive.direct
                    receive.work = dist.irecv(receive.buffer, group=group, group_src=receive.transfer.reader,
                                              tag=receive.transfer.tag)
            for receive in receiving:  # in the transfers' order
                if receive.local:
                    receive.copy_shared(attached)
                    acks.append(dist.isend(ack, group=group, group_dst=receive.transfer.reader, tag=receive.transfer.tag))
                elif receive.direct is None:  # taking ring space completes the oldest receives
                    receive.buffer = receive_ring.take(receive.nbytes, receive.complete)
                    receive.work = dist.irecv(receive.buffer, group=group, group_src=receive.transfer.reader,
                                              tag=receive.transfer.tag)
            receive_ring.drain()
            for work in [r.work for r in receiving if r.direct is not None] + acks:
                work.wait()
        finally:
            dispatcher.join()
            for future in futures:
                if future.exception() is None:
                    nbytes += future.result()
        if failed:
            raise failed[0]
        read_ring.drain()
        for job in jobs:  # the ring retired those it held; the others were read into their destinations
            retire(job)
    return nbytes


class _Receive:
    """A shared read another rank reads: on its host, copied out of its shared ring where a
    header says; else the regions this rank wants, packed in the order of `read_regions`,
    received straight into the destination when it is one contiguous view, else into a ring
    buffer and copied out."""

    def __init__(self, read: ReadItem, transfer: Transfer, targets: Sequence[Fragment], dtype: torch.dtype,
                 local: bool):
        self.read, self.transfer, self.targets, self.dtype, self.local = read, transfer, targets, dtype, local
        self.regions = read_regions(read)
        self.nbytes = sum(_region_bytes(g, dtype.itemsize) for g in self.regions)
        self.direct = None if local else _contiguous_destination(read, targets, dtype, whole=False)
        self.buffer: Optional[torch.Tensor] = None
        self.work = None

    def copy_shared(self, attached: "shm.Attached") -> None:
        self.work.wait()
        memory, offset = attached.locate(self.buffer)
        t, read = self.transfer, self.read
        copy_out(read, memoryview(memory[offset + read.start - t.start:offset + read.end - t.start].numpy()),
                 self.targets, self.dtype)

    def complete(self) -> None:
        self.work.wait()
        slots, at = {}, 0
        for region in self.regions:
            n = _region_bytes(region, self.dtype.itemsize)
            slots[region] = self.buffer[at:at + n]
            at += n
        for copy in self.read.copies:
            target = self.targets[copy.target]
            src = slots[copy.region].view(self.dtype).view(copy.region[1])
            sub_view(target.local, target.offsets, copy.region).copy_(src)


class _Ring:
    """Reusable memory for the ranges a load reads or receives before copying them out.

    Ranges are taken in order and retired oldest first (`retire` waits until a range is copied
    out and sent), so memory stays bounded and is touched once: fresh memory for every range of a
    1 GiB resharded load cost 2-5 s of page faults here, and twice its bytes in memory.
    """

    BYTES = 64 << 20  # unless one range needs more
    ALIGN = hostmem.PAGE  # ranges start page aligned: reads into them can bypass the page cache

    def __init__(self, sizes: Sequence[int], memory: Optional[torch.Tensor] = None):
        """`memory` (at least `size_for(sizes)` bytes, page aligned): the ring's, else allocated."""
        self.size = self.size_for(sizes)
        self.memory = memory if memory is not None or not self.size else aligned_empty(self.size)
        self.entries: deque = deque()  # (start, end, retire) in taking order

    @classmethod
    def size_for(cls, sizes: Sequence[int]) -> int:
        need = max([0] + [align_up(n, cls.ALIGN) for n in sizes])
        return max(need, min(cls.BYTES, sum(align_up(n, cls.ALIGN) for n in sizes)))

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
