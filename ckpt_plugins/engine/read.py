"""The load side of execution: run a load plan's reads and copies, and this rank's part of the
read-once exchange. What to read and who reads it was decided by `plan`.

Failures never strand another rank: every send and receive this rank promised (a shared range it
reads for others, an acknowledgement it owes a reader) is posted and completed even after a read,
a checksum or a copy failed here; what is sent is then garbage, and the load fails on every rank
when the ranks agree on its outcome. Only a rank that is gone breaks that promise, and the group
then fails at once.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Dict, List, Optional, Sequence

import torch

from ..errors import CorruptCheckpointError
from ..format import chunk_checksums, dtype_from_name
from .. import hostmem, shm
from ..fragment import Fragment, flat_offset, sub_view
from ..plan import ReadItem, Transfer, read_regions
from ..hostmem import align_up
from ..storage import Storage
from ..telemetry import Recorder
from .ring import Ring

READ_PIECE = 8 << 20  # a big stored range is read as pieces of this size in parallel

log = logging.getLogger("ckpt_plugins")


def read_checked(storage: Storage, key: str, file: str, offset: int, nbytes: int, start: int, end: int,
                 crc32c: Sequence[int], chunk: int, buffer=None, recorder: Optional[Recorder] = None) -> bytearray:
    """Bytes [start, end) of an item stored at `offset`, verified against its chunk checksums."""
    buffer = bytearray(end - start) if buffer is None else buffer
    t0 = time.time()
    storage.read_into(file, offset + start, buffer)
    t1 = time.time()
    expected = crc32c[start // chunk:start // chunk + len(range(start, end, chunk))]
    sums = chunk_checksums(buffer, chunk)
    if recorder is not None:
        recorder.add("read", t0, t1, end - start)
        recorder.add("checksum", t1, time.time(), end - start)
    if sums != list(expected):
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


def _payload_bytes(regions, itemsize: int) -> int:
    """Bytes of the regions packed one after the other."""
    return sum(_region_bytes(g, itemsize) for g in regions)


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
               transfers: Optional[Dict[int, Transfer]] = None, coord=None,
               hosts: Optional[Sequence[Optional[str]]] = None, recorder: Optional[Recorder] = None) -> int:
    """Run this rank's reads (and its part of the read-once exchange over `coord`, a
    Coordinator); returns bytes read from storage.

    Reads run on a thread pool; each verified range is copied into its destination views by a
    copier thread (read straight into the destination when it is one contiguous view the device
    can fill directly). `transfers` maps a read's position to its shared read: its reader reads
    the union range once. Needers on the reader's host (`hosts`: one `shm.host_key` per rank,
    given to every rank or none) copy their regions out of the reader's read ring in shared
    memory, told where by a header; the reader sends every other needer only the regions it
    wants, packed (a contiguous region goes as a view), which lands straight in the needer's
    destination when that is one contiguous view. Ranges that need a buffer take it from a
    `Ring`, one for reads (and packing) and one for receives, both in the transfers' order, so
    the oldest transfer can always finish. `recorder` gets the reads, checksums, receives (bytes
    from shared memory and from the group) and copies into the destinations.
    """
    transfers = transfers or {}
    recorder = recorder or Recorder("load", "", 0, enabled=False)
    rank = coord.rank if coord is not None else 0
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
            segment = shm.Segment.create(Ring.size_for(sizes)) if any(job.local for job in jobs) else None
        except OSError as exc:
            log.warning("no shared memory for this load (%s): ranks on this host exchange over the group", exc)
        try:
            ready[:] = [bool(f) for f in coord.all_flags(int(segment is not None or not any(j.local for j in jobs)))]
        except BaseException:
            if segment is not None:
                segment.unlink()
            raise
        if not all(ready):  # a reader without a segment sends to its host over the group
            jobs = _read_jobs(storage, reads, targets, dtypes, chunk, transfers, rank, order, shares)
    try:
        return _run_reads(storage, jobs, reads, targets, dtypes, chunk, transfers, coord, shares, segment, threads,
                          recorder)
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
        self.ring_bytes = ((align_up(self.end - self.start, Ring.ALIGN) if self.direct is None else 0)
                           + sum(align_up(_payload_bytes(regions, dtype.itemsize), Ring.ALIGN)
                                 for regions in self.packed))
        step = max(chunk, READ_PIECE // chunk * chunk)  # pieces start on checksum chunks
        self.pieces = [(s, min(s + step, self.end)) for s in range(self.start, self.end, step)]
        self.left = len(self.pieces)
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.failed = False  # a piece failed: nothing is copied to this rank's destination
        self.works: list = []  # sends and acknowledgements to wait for before the range is reused
        self.keep: list = []  # what those works send from or receive into

    def take(self, memory: torch.Tensor) -> None:
        """Place the read bytes (unless they go to the destination) and the packed payloads."""
        at = 0
        if self.direct is None:
            self.memory = memory
            self.data = memoryview(memory[:self.end - self.start].numpy())
            at = align_up(self.end - self.start, Ring.ALIGN)
        for regions in self.packed:
            n = _payload_bytes(regions, self.dtype.itemsize)
            self.packed[regions] = memory[at:at + n]
            at = align_up(at + n, Ring.ALIGN)

    @property
    def send_bytes(self) -> int:
        """What goes to needers on other hosts (those on this host copy from shared memory)."""
        return sum(_payload_bytes(g, self.dtype.itemsize) for _, g in self.remote)

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

    def retire(self, failed: List[BaseException]) -> None:
        """Wait until the range is copied out and every send and acknowledgement is through.
        Never raises (a ring calls it): a broken send is recorded in `failed`."""
        self.done.wait()
        while self.works:  # each once: waiting twice on a finished gloo work blocks forever
            try:
                self.works.pop().wait()
            except BaseException as exc:
                failed.append(exc)


def _read_jobs(storage, reads, targets, dtypes, chunk, transfers, rank, order, shares) -> List[_Job]:
    return [_Job(storage, reads[p], transfers.get(p), targets, dtype_from_name(dtypes[reads[p].key]), chunk, rank, shares)
            for p in order if p not in transfers or transfers[p].reader == rank]


def _run_reads(storage, jobs, reads, targets, dtypes, chunk, transfers, coord, shares, segment, threads,
               recorder: Recorder) -> int:
    rank = coord.rank if coord is not None else 0
    send_lock = threading.Lock()  # one thread at a time posts sends on the group
    failed: List[BaseException] = []  # this rank's failures; the exchange goes on regardless

    def run_piece(job: _Job, start: int, end: int) -> int:
        try:
            if not failed:  # after a failure, only the promised sends still go out
                stored = job.read.stored
                read_checked(storage, job.read.key, stored.file, stored.offset, stored.nbytes, start, end,
                             stored.crc32c, chunk, buffer=job.data[start - job.start:end - job.start],
                             recorder=recorder)
                return end - start
            job.failed = True
            return 0
        except BaseException as exc:
            failed.append(exc)
            job.failed = True
            return 0
        finally:
            with job.lock:
                job.left -= 1
                last = job.left == 0
            if last:
                copier.submit(finish, job)

    def finish(job: _Job) -> None:
        """Copy the bytes read into the destination and pass them on (on the copier thread).
        The sends go out whatever happened before: other ranks wait for them."""
        try:
            if job.dest is not None and job.direct is None and not job.failed:
                with recorder.phase("copy", job.end - job.start):
                    attempt(lambda: hostmem.copy(job.dest.data_ptr(), job.memory.data_ptr(), job.end - job.start))
            if job.transfer is not None:
                with send_lock, recorder.phase("send", job.send_bytes):
                    send(job, job.transfer.tag)
            if job.dest is None and not job.failed:
                with recorder.phase("copy", job.read.end - job.read.start):
                    attempt(lambda: copy_out(job.read, job.data[job.read.start - job.start:job.read.end - job.start],
                                             targets, job.dtype))
        except BaseException as exc:
            failed.append(exc)
        finally:
            job.done.set()

    def send(job: _Job, tag: int) -> None:
        for r, g in job.remote:
            payload = None if job.failed else attempt(lambda: job.payload(g))
            if payload is None:  # garbage of the promised size: the load fails anyway
                payload = torch.zeros(_payload_bytes(g, job.dtype.itemsize), dtype=torch.uint8)
            post(job.works, coord.isend, payload, r, tag)
        if job.local:
            offset = 0 if job.memory is None else job.memory.data_ptr() - segment.tensor.data_ptr()
            header, acks = segment.header(offset), [torch.empty(1, dtype=torch.int64) for _ in job.local]
            job.keep = [header, acks]
            for r, ack in zip(job.local, acks):
                post(job.works, coord.isend, header, r, tag)
                post(job.works, coord.irecv, ack, r, tag)

    def attempt(fn: Callable[[], object]):
        """fn()'s result, or None with its exception recorded."""
        try:
            return fn()
        except BaseException as exc:
            failed.append(exc)
            return None

    def post(works: list, fn, *args) -> None:
        """Post a send or receive; a rank that is gone makes it fail at once (recorded)."""
        work = attempt(lambda: fn(*args))
        if work is not None:
            works.append(work)

    receiving = [_Receive(reads[p], t, targets, dtype_from_name(dtypes[reads[p].key]), shares(t.reader, rank))
                 for p, t in sorted(transfers.items(), key=lambda pt: pt[1].tag) if t.reader != rank]
    read_ring = Ring([job.ring_bytes for job in jobs], memory=segment.tensor if segment is not None else None)
    receive_ring = Ring([r.nbytes for r in receiving if r.direct is None and not r.local])
    attached, acks, ack = shm.Attached(), [], torch.zeros(1, dtype=torch.int64)
    unacked = {r for job in jobs for r in job.local}  # ranks that have not attached the segment yet

    def retire(job: _Job) -> None:
        job.retire(failed)
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
            for job in jobs:
                if job.ring_bytes:
                    try:
                        job.take(read_ring.take(job.ring_bytes, lambda job=job: retire(job)))
                    except BaseException as exc:  # e.g. no memory for the ring: nothing is read,
                        failed.append(exc)       # but its pieces still hand it to the copier,
                        job.failed = True        # which sends what was promised
                futures.extend(pool.submit(run_piece, job, s, e) for s, e in job.pieces)
                if not job.pieces:  # nothing to read (an empty range) still completes its transfer
                    copier.submit(finish, job)

        dispatcher = threading.Thread(target=dispatch, name="ckpt-read-dispatch", daemon=True)
        dispatcher.start()
        try:
            for receive in receiving:  # headers and straight-to-destination payloads: posted at once
                if receive.local or receive.direct is not None:
                    receive.buffer = torch.empty(shm.HEADER_BYTES, dtype=torch.uint8) if receive.local else receive.direct
                    receive.work = attempt(lambda r=receive: coord.irecv(r.buffer, r.transfer.reader, r.transfer.tag))
            for receive in receiving:  # in the transfers' order
                if receive.local:
                    with recorder.phase("receive", receive.nbytes, shm_bytes=receive.nbytes):
                        receive.copy_shared(attached, failed)
                    post(acks, coord.isend, ack, receive.transfer.reader, receive.transfer.tag)
                elif receive.direct is None:  # taking ring space completes the oldest receives
                    receive.buffer = receive_ring.take(receive.nbytes, lambda r=receive: r.complete(failed, recorder))
                    receive.work = attempt(lambda r=receive: coord.irecv(r.buffer, r.transfer.reader, r.transfer.tag))
            receive_ring.drain()
            for receive in receiving:
                if receive.direct is not None and receive.work is not None:
                    with recorder.phase("receive", receive.nbytes, group_bytes=receive.nbytes):
                        attempt(receive.work.wait)
            for work in acks:
                attempt(work.wait)
        finally:
            dispatcher.join()
            for future in futures:
                nbytes += future.result()
        read_ring.drain()
        for job in jobs:  # the ring retired those it held; the others were read into their destinations
            retire(job)
    if failed:
        raise failed[0]
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
        self.nbytes = _payload_bytes(self.regions, dtype.itemsize)
        self.direct = None if local else _contiguous_destination(read, targets, dtype, whole=False)
        self.buffer: Optional[torch.Tensor] = None
        self.work = None

    def copy_shared(self, attached: "shm.Attached", failed: List[BaseException]) -> None:
        """Copy out of the reader's segment (never raises: the reader waits for our ack)."""
        try:
            if self.work is None:  # posting it failed (recorded)
                return
            self.work.wait()
            if failed:
                return
            memory, offset = attached.locate(self.buffer)
            t, read = self.transfer, self.read
            copy_out(read, memoryview(memory[offset + read.start - t.start:offset + read.end - t.start].numpy()),
                     self.targets, self.dtype)
        except BaseException as exc:
            failed.append(exc)

    def complete(self, failed: List[BaseException], recorder: Recorder) -> None:
        """Copy a received payload out of its ring buffer (never raises: a ring calls it)."""
        try:
            with recorder.phase("receive", self.nbytes, group_bytes=self.nbytes):
                if self.work is not None:
                    self.work.wait()
                if self.work is not None and not failed:
                    self._copy()
        except BaseException as exc:
            failed.append(exc)

    def _copy(self) -> None:
        slots, at = {}, 0
        for region in self.regions:
            n = _region_bytes(region, self.dtype.itemsize)
            slots[region] = self.buffer[at:at + n]
            at += n
        for copy in self.read.copies:
            target = self.targets[copy.target]
            src = slots[copy.region].view(self.dtype).view(copy.region[1])
            sub_view(target.local, target.offsets, copy.region).copy_(src)
