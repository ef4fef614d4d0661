"""How a shared read's bytes reach the ranks that need them (the read-once exchange), behind one
interface: a reader serves its needers, a needer receives. Two channels:
- `GroupChannel`, over the process group: the reader sends each needer only the regions it wants,
  packed (a contiguous region goes as a view of the bytes read); a needer receives straight into
  its destination when that is one contiguous view, else into ring memory it copies out of.
- `SharedMemoryChannel`, between ranks of one host: the reader reads into a shared-memory ring and,
  once a pass over it is read (`exchange.Batch`), announces to each needer where its ranges lie,
  in one small message for up to `shm.ANNOUNCED` of them; a needer copies its regions out and
  acknowledges the pass, after which the reader may reuse its memory. Two messages per pass and
  needer, not two per range: a small load shares dozens of ranges, each message costing about as
  much as reading one.

Every send and receive a rank promised is posted even after its own part failed (garbage of the
promised size is sent then): the other ranks never wait for one that does not come.
"""
from __future__ import annotations

from collections import deque
from typing import Callable, Deque, Dict, List, Optional, Sequence

import torch

from .. import shm
from ..fragment import Fragment, sub_view
from ..plan import ReadItem
from ..read_once import Transfer, read_regions
from ..telemetry import Recorder
from .read import contiguous_destination, copy_out, payload_bytes, region_bytes


class Failures:
    """This rank's failures during an exchange: recorded and passed over, so every promised send
    and receive still goes out; the first is raised once the exchange is through."""

    def __init__(self):
        self.errors: List[BaseException] = []

    def __bool__(self) -> bool:
        return bool(self.errors)

    def record(self, exc: BaseException) -> None:
        self.errors.append(exc)

    def attempt(self, fn: Callable[[], object]):
        """fn()'s result, or None with its exception recorded."""
        try:
            return fn()
        except BaseException as exc:
            self.record(exc)
            return None

    def post(self, works: list, fn, *args) -> None:
        """Post a send or receive; a rank that is gone makes it fail at once (recorded)."""
        work = self.attempt(lambda: fn(*args))
        if work is not None:
            works.append(work)

    def raise_first(self) -> None:
        if self.errors:
            raise self.errors[0]


class Incoming:
    """A shared read another rank reads, which this rank needs: the regions it wants, packed in
    the order of `read_regions`, landing straight in the destination when that is one contiguous
    view (`direct`), else in `buffer` (ring memory; shared memory's needers copy from the reader's)."""

    def __init__(self, read: ReadItem, transfer: Transfer, targets: Sequence[Fragment], dtype: torch.dtype,
                 local: bool):
        self.read, self.transfer, self.targets, self.dtype, self.local = read, transfer, targets, dtype, local
        self.regions = read_regions(read)
        self.nbytes = payload_bytes(self.regions, dtype.itemsize)
        self.direct = None if local else contiguous_destination(read, targets, dtype, whole=False)
        self.buffer: Optional[torch.Tensor] = None
        self.work = None

    def copy_from_buffer(self) -> None:
        slots, at = {}, 0
        for region in self.regions:
            n = region_bytes(region, self.dtype.itemsize)
            slots[region] = self.buffer[at:at + n]
            at += n
        for copy in self.read.copies:
            target = self.targets[copy.target]
            src = slots[copy.region].view(self.dtype).view(copy.region[1])
            sub_view(target.local, target.offsets, copy.region).copy_(src)


class Channel:
    """One way a shared read's bytes travel; `coord` is the load's Coordinator."""

    def __init__(self, coord, failures: Failures):
        self.coord, self.failures = coord, failures


class GroupChannel(Channel):
    """Needers on other hosts, over the process group."""

    def serve(self, job, tag: int) -> None:
        """On the reader: send each needer of `job` (an `exchange.ReadJob`) its regions; the works
        go to `job.works`, to be waited for before the range is reused."""
        for rank, regions in job.remote:
            payload = None if job.failed else self.failures.attempt(lambda: job.payload(regions))
            if payload is None:  # garbage of the promised size: the load fails anyway
                payload = torch.zeros(payload_bytes(regions, job.dtype.itemsize), dtype=torch.uint8)
            self.failures.post(job.works, self.coord.isend, payload, rank, tag)

    def post(self, incoming: Incoming) -> None:
        """On a needer: the receive straight into the destination (one contiguous view)."""
        incoming.buffer = incoming.direct
        incoming.work = self.failures.attempt(
            lambda: self.coord.irecv(incoming.buffer, incoming.transfer.reader, incoming.transfer.tag))

    def post_into(self, incoming: Incoming, buffer: torch.Tensor) -> None:
        """Into `buffer` (ring memory), copied out by `complete`."""
        incoming.buffer = buffer
        incoming.work = self.failures.attempt(
            lambda: self.coord.irecv(buffer, incoming.transfer.reader, incoming.transfer.tag))

    def complete(self, incoming: Incoming, recorder: Recorder) -> None:
        """Wait for a buffered payload and copy it out (never raises: a ring calls it)."""
        try:
            with recorder.phase("receive", incoming.nbytes, group_bytes=incoming.nbytes):
                if incoming.work is not None:
                    incoming.work.wait()
                if incoming.work is not None and not self.failures:
                    incoming.copy_from_buffer()
        except BaseException as exc:
            self.failures.record(exc)

    def wait_direct(self, incoming: Incoming, recorder: Recorder) -> None:
        if incoming.work is not None:
            with recorder.phase("receive", incoming.nbytes, group_bytes=incoming.nbytes):
                self.failures.attempt(incoming.work.wait)


class SharedMemoryChannel(Channel):
    """Needers on the reader's host, through its shared-memory ring."""

    def __init__(self, coord, failures: Failures, segment: Optional[shm.Segment]):
        super().__init__(coord, failures)
        self.segment = segment
        self.attached = shm.Attached()
        self.acks: list = []  # this rank's acknowledgements, waited for at the end
        self.ack = torch.zeros(1, dtype=torch.int64)
        self.queues: Dict[int, Deque[Incoming]] = {}  # by reader: the ranges not yet announced
        self.listening: Dict[int, tuple] = {}  # by reader: the announcement posted for (buffer, work)
        self.located: Dict[int, tuple] = {}  # by tag: (segment path, offset) of an announced range
        self.acks_due: Dict[int, int] = {}  # by tag: the acknowledgement due once that range is copied

    def announce(self, jobs: Sequence, into) -> None:
        """On the reader: tell each needer where its ranges among `jobs` (a pass, every one
        served) lie, and post the receive of its acknowledgement; the works and buffers go to
        `into`, a job of the pass, retired with the others."""
        base = self.segment.tensor.data_ptr()
        for rank in sorted({r for job in jobs for r in job.local}):
            mine = [job for job in jobs if rank in job.local]
            for at in range(0, len(mine), shm.ANNOUNCED):
                part = mine[at:at + shm.ANNOUNCED]
                message = self.segment.announcement([0 if j.memory is None else j.memory.data_ptr() - base
                                                     for j in part], final=at + shm.ANNOUNCED >= len(mine))
                into.keep.append(message)
                self.failures.post(into.works, self.coord.isend, message, rank, part[0].transfer.tag)
            ack = torch.empty(1, dtype=torch.int64)
            into.keep.append(ack)
            self.failures.post(into.works, self.coord.irecv, ack, rank, part[0].transfer.tag)

    def post(self, incoming: Incoming) -> None:
        """Queue the range under its reader; the first of each reader's announcements is posted
        by `listen`."""
        self.queues.setdefault(incoming.transfer.reader, deque()).append(incoming)

    def listen(self) -> None:
        """Post the receive of each reader's next announcement (after `post` of every range)."""
        for reader, queue in self.queues.items():
            if queue and reader not in self.listening:
                buffer = torch.empty(shm.ANNOUNCE_BYTES, dtype=torch.uint8)
                self.listening[reader] = (buffer, self.failures.attempt(
                    lambda: self.coord.irecv(buffer, reader, queue[0].transfer.tag)))

    def receive(self, incoming: Incoming, recorder: Recorder) -> None:
        """Copy out of the reader's segment once announced, then acknowledge the pass if this
        range ends it (the reader waits for that: posted whatever happened)."""
        tag = incoming.transfer.tag
        if tag not in self.located and incoming.transfer.reader in self.listening:
            self._announced(incoming.transfer.reader)
        with recorder.phase("receive", incoming.nbytes, shm_bytes=incoming.nbytes):
            self._copy(incoming, self.located.pop(tag, None))
        if tag in self.acks_due:
            self.failures.post(self.acks, self.coord.isend, self.ack, incoming.transfer.reader,
                               self.acks_due.pop(tag))

    def _announced(self, reader: int) -> None:
        """Take the reader's next announcement: where its next ranges lie. Only a rank that is
        gone (the receive failed) leaves them unlocated."""
        buffer, work = self.listening.pop(reader)
        try:
            if work is None:  # posting it failed (recorded)
                return
            work.wait()
            said = shm.Announcement.parse(buffer)
        except BaseException as exc:
            self.failures.record(exc)
            return
        queue = self.queues[reader]
        ranges = [queue.popleft() for _ in range(min(len(said.offsets), len(queue)))]
        for item, offset in zip(ranges, said.offsets):
            self.located[item.transfer.tag] = (said.path, offset)
        if said.final and ranges:
            self.acks_due[ranges[-1].transfer.tag] = ranges[0].transfer.tag
        self.listen()

    def _copy(self, incoming: Incoming, where: Optional[tuple]) -> None:
        try:
            if where is None or self.failures:  # not announced (recorded), or failed before
                return
            path, offset = where
            memory = self.attached.memory(path)
            t, read = incoming.transfer, incoming.read
            copy_out(read, memoryview(memory[offset + read.start - t.start:offset + read.end - t.start].numpy()),
                     incoming.targets, incoming.dtype)
        except BaseException as exc:
            self.failures.record(exc)

    def wait_acks(self) -> None:
        for work in self.acks:
            self.failures.attempt(work.wait)
