"""The load side of execution: one rank's reads and copies, and its part of the read-once
exchange. What to read and who reads it was decided by `plan`.

Three stages run at once, each on its own threads (a small load's, one after the other on the
calling thread: `ReadExchange._serial`):
1. read and verify: this rank's reads (its own, and the shared ranges it reads for others), in
   pieces on a thread pool, into their destination or into ring memory, checksummed;
2. serve: once a read is whole, copy it into this rank's destinations and pass it on to the other
   needers through a channel (`channels`: over the process group, or shared memory on one host);
3. receive: the shared ranges other ranks read for this one, in the transfers' order.

Failures never strand another rank: every send and receive this rank promised is posted and
completed even after a read, a checksum or a copy failed here; what is sent is then garbage, and
the load fails on every rank when the ranks agree on its outcome. Only a rank that is gone breaks
that promise, and the group then fails at once.
"""
from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import torch

from .. import hostmem, own_threads, shm
from ..format import dtype_from_name
from ..fragment import Fragment
from ..hostmem import DIRECT_MIN, align_up
from ..plan import ReadItem
from ..read_once import Transfer
from ..storage import Storage
from ..telemetry import Recorder
from .channels import Failures, GroupChannel, Incoming, SharedMemoryChannel
from .read import contiguous_destination, copy_out, needs_packing, payload_bytes, read_checked, region_view
from .ring import Ring

READ_PIECE = 8 << 20  # a big stored range is read as pieces of this size in parallel
ANNOUNCE_BYTES = 8 << 20  # a reader announces its shared ranges to its host's needers per pass of this much
SERIAL_BYTES = READ_PIECE  # a rank reading less than this in all runs its stages one after the other

log = logging.getLogger("ckpt_plugins")


@dataclass
class ReadWork:
    """What one rank's load reads and where it goes: `reads` (its own, then those it reads only
    to pass on), `transfers` (the shared ones among them, and those it needs from other ranks, by
    position in `reads`), its destination fragments, each stored key's dtype, the checksum chunk
    size, every rank's host (None: no shared memory), and a delta checkpoint's base (`delta.Base`)."""
    reads: Sequence[ReadItem]
    targets: Sequence[Fragment]
    dtypes: Dict[str, str]
    chunk: int
    transfers: Dict[int, Transfer] = field(default_factory=dict)
    hosts: Optional[Sequence[Optional[str]]] = None
    base: Any = None


def read_items(storage: Storage, work: ReadWork, coord=None, threads: int = 2,
               recorder: Optional[Recorder] = None) -> int:
    """Run this rank's reads and its part of the exchange over `coord` (a Coordinator); returns
    the bytes read from storage. `recorder` gets the reads, checksums, receives (from shared
    memory and from the group) and copies into the destinations."""
    return ReadExchange(storage, work, coord, recorder or Recorder("load", "", 0, enabled=False)).run(threads)


class _Here:
    """An executor that runs each task at once on the calling thread: a serial load's stages."""

    def submit(self, fn, *args) -> Future:
        done: Future = Future()
        try:
            done.set_result(fn(*args))
        except BaseException as exc:
            done.set_exception(exc)
        return done

    def __enter__(self) -> "_Here":
        return self

    def __exit__(self, *_) -> None:
        pass


class Batch:
    """The reads of one pass over a reader's ring that ranks on its host copy out (`Ring.passes`):
    announced to them together once all are served, and retired together once acknowledged."""

    def __init__(self):
        self.jobs: List["ReadJob"] = []
        self.left = 0  # not yet served
        self.retired = False

    def add(self, job: "ReadJob") -> None:
        self.jobs.append(job)
        self.left += 1
        job.batch = self

    def served(self) -> bool:
        """One more served (on the serving thread); whether it was the last."""
        self.left -= 1
        return self.left == 0


class ReadJob:
    """One read of this rank: split into pieces that run in parallel; the last to land hands it to
    the serving stage, which copies it into its destination and passes it on to the other needers."""

    def __init__(self, storage: Storage, read: ReadItem, transfer: Optional[Transfer], targets: Sequence[Fragment],
                 dtype: torch.dtype, chunk: int):
        self.storage, self.read, self.transfer, self.targets, self.dtype = storage, read, transfer, targets, dtype
        self.start, self.end = (transfer.start, transfer.end) if transfer else (read.start, read.end)
        own = (self.start, self.end) == (read.start, read.end)
        self.dest = contiguous_destination(read, targets, dtype) if own else None
        step = max(chunk, READ_PIECE // chunk * chunk)  # pieces start on checksum chunks
        self.pieces = [(s, min(s + step, self.end)) for s in range(self.start, self.end, step)]
        self.left = len(self.pieces)
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.failed = False  # a piece failed: nothing is copied to this rank's destination
        self.works: list = []  # sends and acknowledgements to wait for before the range is reused
        self.keep: list = []  # what those works send from or receive into
        self.memory: Optional[torch.Tensor] = None  # ring memory, when the read lands there
        self.batch: Optional[Batch] = None  # when ranks on this host copy it out
        self.route([], [])

    def route(self, local: List[int], remote: list) -> None:
        """Who gets the bytes: `local` needers copy them out of shared memory, `remote` ones
        ((rank, regions) pairs) get them sent; that decides where the read lands."""
        self.local, self.remote = local, remote
        # Straight into the destination, unless staging in page-aligned memory lets the read
        # bypass the page cache (a destination is rarely page aligned itself), or ranks on this
        # host copy from the shared ring: then the serving stage copies it there.
        align = self.storage.direct_alignment
        bounce = (self.dest is not None and bool(align) and (self.read.stored.offset + self.start) % align == 0
                  and self.dest.data_ptr() % align != 0 and self.end - self.start >= DIRECT_MIN)
        self.direct = None if bounce or self.local else self.dest
        self.data = None if self.direct is None else memoryview(self.direct.numpy())
        # payloads to pack, one per distinct region list among the needers on other hosts
        self.packed: Dict[tuple, Optional[torch.Tensor]] = {
            g: None for _, g in self.remote if needs_packing(self.read.stored.lengths, g)}
        self.ring_bytes = ((align_up(self.end - self.start, Ring.ALIGN) if self.direct is None else 0)
                           + sum(align_up(payload_bytes(regions, self.dtype.itemsize), Ring.ALIGN)
                                 for regions in self.packed))

    def take(self, memory: torch.Tensor) -> None:
        """Place the read bytes (unless they go to the destination) and the packed payloads."""
        at = 0
        if self.direct is None:
            self.memory = memory
            self.data = memoryview(memory[:self.end - self.start].numpy())
            at = align_up(self.end - self.start, Ring.ALIGN)
        for regions in self.packed:
            n = payload_bytes(regions, self.dtype.itemsize)
            self.packed[regions] = memory[at:at + n]
            at = align_up(at + n, Ring.ALIGN)

    @property
    def send_bytes(self) -> int:
        """What goes to needers on other hosts (those on this host copy from shared memory)."""
        return sum(payload_bytes(g, self.dtype.itemsize) for _, g in self.remote)

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

    def retire(self, failures: Failures) -> None:
        """Wait until the range is copied out and every send and acknowledgement is through.
        Never raises (a ring calls it): a broken send is recorded."""
        self.done.wait()
        while self.works:  # each once: waiting twice on a finished gloo work blocks forever
            failures.attempt(self.works.pop().wait)


class ReadExchange:
    """One rank's reads, serving and receiving for one load (see the module docstring)."""

    def __init__(self, storage: Storage, work: ReadWork, coord, recorder: Recorder):
        self.storage, self.work, self.coord, self.recorder = storage, work, coord, recorder
        self.rank = coord.rank if coord is not None else 0
        self.failures = Failures()
        hosts = work.hosts
        self.ready = [True] * len(hosts or ())  # readers whose ring is shared
        transfers = work.transfers
        order = sorted(range(len(work.reads)), key=lambda p: (0, transfers[p].tag) if p in transfers else (1, p))
        self.jobs = [ReadJob(storage, work.reads[p], transfers.get(p), work.targets,
                             dtype_from_name(work.dtypes[work.reads[p].key]), work.chunk)
                     for p in order if p not in transfers or transfers[p].reader == self.rank]
        self._route()
        self.segment: Optional[shm.Segment] = None
        self.send_lock = threading.Lock()  # one thread at a time posts sends on the group

    def shares(self, reader: int, needer: int) -> bool:
        """Whether `needer` copies what `reader` reads out of the reader's shared ring."""
        hosts = self.work.hosts
        return (hosts is not None and reader != needer and hosts[reader] is not None
                and hosts[reader] == hosts[needer] and self.ready[reader])

    def _route(self) -> None:
        for job in self.jobs:
            t = job.transfer
            if t is not None:
                job.route([r for r in t.needers if self.shares(self.rank, r)],
                          [(r, g) for r, g in zip(t.needers, t.wants) if r != self.rank and not self.shares(self.rank, r)])

    def _serial(self) -> bool:
        """Whether the stages run one after the other on the calling thread: this rank reads less
        than `SERIAL_BYTES` in all, so threads and hand-offs would cost more than the reads, and its
        ring holds every read at once, so no read waits for a range to retire (which waits for
        other ranks' receives) before this rank has served them all and begins to receive."""
        sizes = [job.ring_bytes for job in self.jobs]
        return sum(job.end - job.start for job in self.jobs) < SERIAL_BYTES and Ring.size_for(sizes) >= sum(
            align_up(n, Ring.ALIGN) for n in sizes)

    def run(self, threads: int) -> int:
        if self.work.hosts is not None:
            self._share_memory()
        try:
            return self._exchange(0 if self._serial() else max(1, threads))
        finally:
            if self.segment is not None:
                self.segment.unlink()

    def _share_memory(self) -> None:
        """Every rank: a shared-memory segment for the ring of a rank that reads for others on its
        host, and which readers have one (a reader without one serves its host over the group)."""
        try:
            if any(job.local for job in self.jobs):
                self.segment = shm.Segment.create(Ring.size_for([job.ring_bytes for job in self.jobs]))
        except OSError as exc:
            log.warning("no shared memory for this load (%s): ranks on this host exchange over the group", exc)
        try:
            ok = self.segment is not None or not any(job.local for job in self.jobs)
            self.ready[:] = [bool(f) for f in self.coord.all_flags(int(ok))]
        except BaseException:
            if self.segment is not None:
                self.segment.unlink()
            raise
        if not all(self.ready):
            self._route()

    def _batch(self) -> None:
        """The reads this rank serves to ranks on its host, grouped by pass over its ring (a read
        of nothing joins the pass before it)."""
        taking = [job for job in self.jobs if job.ring_bytes]
        passes = dict(zip(map(id, taking), self.read_ring.passes([job.ring_bytes for job in taking], ANNOUNCE_BYTES)))
        batches: Dict[int, Batch] = {}
        current = 0
        for job in self.jobs:
            current = passes.get(id(job), current)
            if job.local:
                batches.setdefault(current, Batch()).add(job)

    # ------------------------------------------------------------ the stages

    def _exchange(self, threads: int) -> int:
        work, failures = self.work, self.failures
        self.group = GroupChannel(self.coord, failures)
        self.shared = SharedMemoryChannel(self.coord, failures, self.segment)
        incoming = [Incoming(work.reads[p], t, work.targets, dtype_from_name(work.dtypes[work.reads[p].key]),
                             self.shares(t.reader, self.rank))
                    for p, t in sorted(work.transfers.items(), key=lambda pt: pt[1].tag) if t.reader != self.rank]
        self.read_ring = Ring([job.ring_bytes for job in self.jobs],
                              memory=self.segment.tensor if self.segment is not None else None)
        self._batch()
        self.unacked = {r for job in self.jobs for r in job.local}  # ranks that have not attached the segment yet
        nbytes = 0
        # Read threads only read and verify, keeping the device's queue full; one serving thread
        # sends and copies what they read (copying on the read threads left the device idle here).
        pools = ((_Here(), _Here()) if not threads else
                 (own_threads.executor(threads, "ckpt-read"), own_threads.executor(1, "ckpt-copy")))
        with pools[0] as self.pool, pools[1] as self.server:
            self.futures: list = []
            dispatcher = None
            if threads:
                dispatcher = own_threads.thread(self._dispatch, "ckpt-read-dispatch")
                dispatcher.start()
            else:  # every read served before the first receive: the other ranks wait for them
                self._dispatch()
            try:
                self._receive(incoming)
            finally:
                if dispatcher is not None:
                    dispatcher.join()
                for future in self.futures:
                    nbytes += future.result()
            self.read_ring.drain()
            for job in self.jobs:  # the ring retired those it held; the others were read into their destinations
                self._retire(job)
        failures.raise_first()
        return nbytes

    def _dispatch(self) -> None:
        """Stage 1's feeder: in the transfers' order, ring space for each read (waiting for the
        oldest to retire as needed), then its pieces to the read pool."""
        for job in self.jobs:
            if job.ring_bytes:
                try:
                    job.take(self.read_ring.take(job.ring_bytes, lambda job=job: self._retire(job)))
                except BaseException as exc:  # e.g. no memory for the ring: nothing is read, but its
                    self.failures.record(exc)  # pieces still hand it on, and what was promised is sent
                    job.failed = True
            self.futures.extend(self.pool.submit(self._read_piece, job, s, e) for s, e in job.pieces)
            if not job.pieces:  # nothing to read (an empty range) still completes its transfer
                self.server.submit(self._serve, job)

    def _read_piece(self, job: ReadJob, start: int, end: int) -> int:
        """Stage 1: read and verify one piece; the last piece of a read hands it to stage 2."""
        try:
            if not self.failures:  # after a failure, only the promised sends still go out
                stored = job.read.stored
                read_checked(self.storage, job.read.key, stored, start, end, self.work.chunk,
                             buffer=job.data[start - job.start:end - job.start], recorder=self.recorder,
                             base=self.work.base)
                return end - start
            job.failed = True
            return 0
        except BaseException as exc:
            self.failures.record(exc)
            job.failed = True
            return 0
        finally:
            with job.lock:
                job.left -= 1
                last = job.left == 0
            if last:
                self.server.submit(self._serve, job)

    def _serve(self, job: ReadJob) -> None:
        """Stage 2: copy the bytes read into this rank's destination and pass them on. The sends
        go out whatever happened before: other ranks wait for them."""
        recorder, attempt = self.recorder, self.failures.attempt
        try:
            if job.dest is not None and job.direct is None and not job.failed:
                with recorder.phase("copy", job.end - job.start):
                    attempt(lambda: hostmem.copy(job.dest.data_ptr(), job.memory.data_ptr(), job.end - job.start))
            if job.transfer is not None:
                with self.send_lock, recorder.phase("send", job.send_bytes):
                    self.group.serve(job, job.transfer.tag)
                    if job.batch is not None and job.batch.served():
                        self.shared.announce(job.batch.jobs, into=job)
            if job.dest is None and not job.failed:
                with recorder.phase("copy", job.read.end - job.read.start):
                    attempt(lambda: copy_out(job.read, job.data[job.read.start - job.start:job.read.end - job.start],
                                             job.targets, job.dtype))
        except BaseException as exc:
            self.failures.record(exc)
        finally:
            job.done.set()

    def _receive(self, incoming: List[Incoming]) -> None:
        """Stage 3 (this thread): the shared ranges other ranks read for this one, in the
        transfers' order; buffered payloads take receive-ring space, which completes the oldest."""
        for item in incoming:  # straight-to-destination payloads: posted at once
            if item.local:
                self.shared.post(item)
            elif item.direct is not None:
                self.group.post(item)
        self.shared.listen()
        receive_ring = Ring([i.nbytes for i in incoming if i.direct is None and not i.local])
        for item in incoming:
            if item.local:
                self.shared.receive(item, self.recorder)
            elif item.direct is None:
                buffer = receive_ring.take(item.nbytes, lambda i=item: self.group.complete(i, self.recorder))
                self.group.post_into(item, buffer)
        receive_ring.drain()
        for item in incoming:
            if item.direct is not None and not item.local:
                self.group.wait_direct(item, self.recorder)
        self.shared.wait_acks()

    def _retire(self, job: ReadJob) -> None:
        """Its ring memory may be reused once this returns: a read of a batch waits for the
        whole batch's acknowledgements."""
        jobs = [job]
        if job.batch is not None:  # retired together, once (the ring's thread, then this one)
            if job.batch.retired:
                return
            jobs, job.batch.retired = job.batch.jobs, True
        for each in jobs:
            each.retire(self.failures)
        for each in jobs:
            self.unacked.difference_update(each.local)
        if self.segment is not None and not self.unacked:  # every rank attached: the name can go
            self.segment.unlink()
