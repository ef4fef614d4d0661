"""How a shared read's bytes reach the ranks that need them (the read-once exchange), behind one
interface: a reader serves its needers, a needer receives. Two channels:
- `GroupChannel`, over the process group: the reader sends each needer only the regions it wants,
  packed (a contiguous region goes as a view of the bytes read); a needer receives straight into
  its destination when that is one contiguous view, else into ring memory it copies out of.
- `SharedMemoryChannel`, between ranks of one host: the reader reads into a shared-memory ring and
  sends a header saying where; a needer copies its regions out and acknowledges, after which the
  reader may reuse the range.

Every send and receive a rank promised is posted even after its own part failed (garbage of the
promised size is sent then): the other ranks never wait for one that does not come.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable, List, Optional, Sequence

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
    view (`direct`), else in `buffer` (ring memory, or a header for shared memory)."""

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


class Channel(ABC):
    """One way a shared read's bytes travel; `coord` is the load's Coordinator."""

    def __init__(self, coord, failures: Failures):
        self.coord, self.failures = coord, failures

    @abstractmethod
    def serve(self, job, tag: int) -> None:
        """On the reader: post everything promised to this channel's needers of `job` (a
        `exchange.ReadJob`); the works go to `job.works`, to be waited for before reuse."""

    @abstractmethod
    def post(self, incoming: Incoming) -> None:
        """On a needer: post the receive that can be posted at once (`incoming.work`)."""


class GroupChannel(Channel):
    """Needers on other hosts, over the process group."""

    def serve(self, job, tag: int) -> None:
        for rank, regions in job.remote:
            payload = None if job.failed else self.failures.attempt(lambda: job.payload(regions))
            if payload is None:  # garbage of the promised size: the load fails anyway
                payload = torch.zeros(payload_bytes(regions, job.dtype.itemsize), dtype=torch.uint8)
            self.failures.post(job.works, self.coord.isend, payload, rank, tag)

    def post(self, incoming: Incoming) -> None:
        """Straight into the destination (when it is one contiguous view)."""
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

    def serve(self, job, tag: int) -> None:
        if not job.local:
            return
        offset = 0 if job.memory is None else job.memory.data_ptr() - self.segment.tensor.data_ptr()
        header, acks = self.segment.header(offset), [torch.empty(1, dtype=torch.int64) for _ in job.local]
        job.keep = [header, acks]
        for rank, ack in zip(job.local, acks):
            self.failures.post(job.works, self.coord.isend, header, rank, tag)
            self.failures.post(job.works, self.coord.irecv, ack, rank, tag)

    def post(self, incoming: Incoming) -> None:
        """The header saying where the range lies."""
        incoming.buffer = torch.empty(shm.HEADER_BYTES, dtype=torch.uint8)
        incoming.work = self.failures.attempt(
            lambda: self.coord.irecv(incoming.buffer, incoming.transfer.reader, incoming.transfer.tag))

    def receive(self, incoming: Incoming, recorder: Recorder) -> None:
        """Copy out of the reader's segment, then acknowledge (the reader waits for it: posted
        whatever happened)."""
        with recorder.phase("receive", incoming.nbytes, shm_bytes=incoming.nbytes):
            self._copy(incoming)
        self.failures.post(self.acks, self.coord.isend, self.ack, incoming.transfer.reader, incoming.transfer.tag)

    def _copy(self, incoming: Incoming) -> None:
        try:
            if incoming.work is None:  # posting it failed (recorded)
                return
            incoming.work.wait()
            if self.failures:
                return
            memory, offset = self.attached.locate(incoming.buffer)
            t, read = incoming.transfer, incoming.read
            copy_out(read, memoryview(memory[offset + read.start - t.start:offset + read.end - t.start].numpy()),
                     incoming.targets, incoming.dtype)
        except BaseException as exc:
            self.failures.record(exc)

    def wait_acks(self) -> None:
        for work in self.acks:
            self.failures.attempt(work.wait)
