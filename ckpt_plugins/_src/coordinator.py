"""The one place where ranks talk: planning, commits, load agreement and the read-once exchange.

Every step where ranks depend on each other carries each rank's success or failure (`agree`), so
a failure anywhere reaches every rank as one exception naming the failing ranks. A rank that is
gone (killed) breaks the group's sockets: the collective that notices asks the job's store which
ranks still answer and names the others, instead of waiting for the group's timeout. Works the
same with no process group (one process). Objects exchanged here are our own plans, results and
failures, never checkpoint content.
"""
from __future__ import annotations

import functools
import pickle
from datetime import timedelta
from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist

from .errors import CheckpointError, PeerLost
from .failure import RankFailure, collect, failure_error
from .packing import FRAME, frame_bytes, framed, gathered, unframed

GRACE = timedelta(seconds=2)  # how long survivors wait for each other to say they are alive
BROADCAST_BYTES = 4096  # a broadcast's first collective carries this much: a save's outcome fits
# What the first all-gather of a gather moves to each rank in all: a rank's head of it holds small
# messages whole (a tiny job's plans, requests and telemetry), so one collective does; from 4,096
# ranks on a head is 16 bytes, what a gather of the lengths alone moves.
HEADS_BYTES = 64 << 10
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in 2.13


def _talks(method):
    """A collective: a broken connection becomes PeerLost naming the ranks that are gone (any
    other error, with every rank still answering, stays what it was)."""
    @functools.wraps(method)
    def wrapper(self: "Coordinator", *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except (RuntimeError, dist.DistError) as exc:
            lost = self.lost(exc)
            if lost is None:
                raise
            raise lost from None
    return wrapper


class Coordinator:
    """Rank 0 of `group` coordinates; `collectives` counts calls (tests assert on it)."""

    def __init__(self, group: Optional[dist.ProcessGroup] = None):
        self.active = dist.is_available() and dist.is_initialized()
        self.group = group
        self.rank = dist.get_rank(group) if self.active else 0
        self.world_size = dist.get_world_size(group) if self.active else 1
        self.collectives = 0
        self.operation = 0  # counts saves and loads: the same on every rank

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    def begin(self) -> None:
        """A new save or load starts (every rank calls it in the same order)."""
        self.operation += 1

    def _root(self) -> int:
        return dist.get_global_rank(self.group, 0) if self.group is not None else 0

    @_talks
    def all_gather_bytes(self, data: Optional[bytes]) -> Optional[bytearray]:
        """Every rank's `data`, not pickled, in one buffer (`packing.gathered`: a frame per rank,
        each padded to the largest); None on every rank where some rank had none (`data` None:
        it failed). One all-gather into one tensor where every message fits in its head
        (`head_bytes`), a second for the whole messages where one does not: torch's object
        collectives spend seconds per call at 100,000 ranks on a tensor view and an unpickling
        per rank."""
        if self.world_size == 1:
            return None if data is None else gathered([data])
        self.collectives += 1
        heads, longest, failed = self._heads(data)
        if failed or heads is not None:
            return heads
        stride = frame_bytes(longest)
        buffer = bytearray(stride * self.world_size)
        _all_gather_single(torch.frombuffer(buffer, dtype=torch.uint8),
                           torch.frombuffer(framed(data, stride), dtype=torch.uint8), group=self.group)
        return buffer

    def all_gather(self, obj: Any) -> List[Any]:
        if self.world_size == 1:
            return [obj]
        return _unpickled(self.all_gather_bytes(pickle.dumps(obj)), self.world_size)

    @_talks
    def gather_bytes(self, data: bytes) -> Optional[bytearray]:
        """Every rank's `data` on the coordinator, as `all_gather_bytes` gives it; None elsewhere."""
        if self.world_size == 1:
            return gathered([data])
        self.collectives += 1
        heads, longest, _ = self._heads(data)
        if heads is not None:
            return heads if self.is_coordinator else None
        stride = frame_bytes(longest)
        mine = torch.frombuffer(framed(data, stride), dtype=torch.uint8)
        if not self.is_coordinator:
            dist.gather(mine, None, dst=self._root(), group=self.group)
            return None
        buffer = bytearray(stride * self.world_size)
        parts = list(torch.frombuffer(buffer, dtype=torch.uint8).view(self.world_size, stride).unbind(0))
        dist.gather(mine, parts, dst=self._root(), group=self.group)
        return buffer

    def gather(self, obj: Any) -> Optional[List[Any]]:
        """Everyone's `obj` on the coordinator, None elsewhere."""
        if self.world_size == 1:
            return [obj]
        buffer = self.gather_bytes(pickle.dumps(obj))
        return None if buffer is None else _unpickled(buffer, self.world_size)

    @_talks
    def scatter(self, objs: Optional[List[Any]]) -> Any:
        """Element `rank` of the coordinator's list, on every rank."""
        if self.world_size == 1:
            return objs[0]
        self.collectives += 1
        buffer = gathered([pickle.dumps(o) for o in objs]) if self.is_coordinator else None
        stride = torch.tensor([len(buffer) // self.world_size if buffer is not None else 0], dtype=torch.int64)
        dist.broadcast(stride, src=self._root(), group=self.group)
        out = bytearray(int(stride.item()))
        parts = (list(torch.frombuffer(buffer, dtype=torch.uint8).view(self.world_size, len(out)).unbind(0))
                 if buffer is not None else None)
        dist.scatter(torch.frombuffer(out, dtype=torch.uint8), parts, src=self._root(), group=self.group)
        return _unpickled(out, 1)[0]

    @_talks
    def broadcast(self, obj: Any) -> Any:
        """The coordinator's `obj`, on every rank: one broadcast of `BROADCAST_BYTES` holding its
        length and its start, and a second for the rest only when it is longer (torch's
        `broadcast_object_list` always makes two, the length's and the data's)."""
        if self.world_size == 1:
            return obj
        self.collectives += 1
        data = bytearray(pickle.dumps(obj)) if self.is_coordinator else bytearray()
        room = BROADCAST_BYTES - FRAME
        head = bytearray(BROADCAST_BYTES)  # the whole message's length, then as much of it as fits
        head[:FRAME] = len(data).to_bytes(FRAME, "little")
        head[FRAME:FRAME + min(len(data), room)] = data[:room]
        dist.broadcast(torch.frombuffer(head, dtype=torch.uint8), src=self._root(), group=self.group)
        size = int.from_bytes(head[:FRAME], "little")
        if not self.is_coordinator:
            data = bytearray(size)
            data[:room] = head[FRAME:FRAME + min(size, room)]
        if size > room:
            dist.broadcast(torch.frombuffer(memoryview(data)[room:], dtype=torch.uint8), src=self._root(),
                           group=self.group)
        return obj if self.is_coordinator else pickle.loads(data)

    @_talks
    def all_flags(self, flag: int) -> List[int]:
        """Every rank's small integer (a tensor collective: no pickling)."""
        if self.world_size == 1:
            return [flag]
        self.collectives += 1
        out = torch.empty(self.world_size, dtype=torch.int64)
        _all_gather_single(out, torch.tensor([flag], dtype=torch.int64), group=self.group)
        return out.tolist()

    def _heads(self, data: Optional[bytes]) -> Tuple[Optional[bytearray], int, bool]:
        """One all-gather of every rank's head: a frame of `head_bytes` holding its message's
        length (-1: it failed) and as much of the message as fits. Returns the gathered frames
        where every message fitted whole (None otherwise), the longest message, and whether some
        rank failed. An all-gather, not an all-reduce of the lengths: every rank hears at once
        from a rank that is gone (gloo's all-reduce passes around a ring, where a rank waits on a
        neighbor that already gave up)."""
        stride = head_bytes(self.world_size)
        mine = framed(b"" if data is None else data[:stride - FRAME], stride)
        mine[:FRAME] = (-1 if data is None else len(data)).to_bytes(FRAME, "little", signed=True)
        buffer = bytearray(stride * self.world_size)
        _all_gather_single(torch.frombuffer(buffer, dtype=torch.uint8), torch.frombuffer(mine, dtype=torch.uint8),
                           group=self.group)
        sizes = np.frombuffer(buffer, dtype="<i8")[::stride // 8]
        longest, failed = int(sizes.max()), bool((sizes < 0).any())
        return (buffer if longest <= stride - FRAME and not failed else None), longest, failed

    @_talks
    def any_flags(self, flags: Sequence[int], meanwhile: Optional[Callable[[], None]] = None) -> List[int]:
        """Each flag's maximum over the ranks (one all-reduce); `meanwhile()` runs while it is
        in flight."""
        values = torch.tensor(list(flags), dtype=torch.int64)
        work = None
        if self.world_size > 1:
            self.collectives += 1
            work = dist.all_reduce(values, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        try:
            if meanwhile is not None:
                meanwhile()
        finally:
            if work is not None:
                work.wait()
        return [int(v) for v in values.tolist()]

    def agreed(self, fn: Callable[[], Any], *, what: str, then: str = "", default=CheckpointError) -> List[Any]:
        """Every rank's `fn()`, once each rank has run it; if any raised, every rank raises the
        same exception naming the failing ranks (with their tracebacks). The one way a step every
        rank depends on is run (DCP's `_DistWrapper` does the same)."""
        failure, payload = self._outcome(fn)
        return self.agree(failure, payload, what=what, then=then, default=default)

    def agreed_steps(self, steps: Sequence[Callable[[], Any]], *, what: str, then: str = "",
                     default=CheckpointError) -> None:
        """`agreed` for steps run in order, where a step may run collectives of its own (a load's
        last step, ZeRO-3's gather of its parameters): before each step after the first, one small
        collective tells every rank whether any has failed, and then none goes on, so no rank
        waits in a collective that a failed rank never joins. The steps return nothing, so the
        end is one more such flag, and which ranks failed and why travel only when one did."""
        failure, failed = None, False
        for i, step in enumerate(steps):
            if i and any(self.all_flags(int(failure is not None))):
                failed = True
                break
            failure, _ = self._outcome(step)
        if failed or any(self.all_flags(int(failure is not None))):
            self.agree(failure, what=what, then=then, default=default)

    def agreed_bytes(self, fn: Callable[[], bytes], *, what: str, then: str = "",
                     default=CheckpointError) -> bytearray:
        """`agreed` for a message of plain bytes: every rank's `fn()` in one buffer, not pickled
        (`all_gather_bytes`); if any rank raised, every rank raises naming them."""
        failure, payload = self._outcome(fn)
        buffer = self.all_gather_bytes(payload)
        if buffer is None:  # some rank failed: every rank learns which, and raises
            self.agree(failure, what=what, then=then, default=default)
        return buffer

    def _outcome(self, fn: Callable[[], Any]) -> Tuple[Optional[RankFailure], Any]:
        """`fn()`'s result, or this rank's failure (and no result)."""
        try:
            return None, fn()
        except Exception as exc:
            return RankFailure.of(self.rank, exc), None

    def agree(self, failure: Optional[RankFailure], payload: Any = None, *, what: str, then: str = "",
              default=CheckpointError) -> List[Any]:
        """Everyone's `payload`, once every rank has said whether it failed; if any did, every
        rank raises the same exception naming them all."""
        gathered = self.all_gather((failure, payload))
        failures = collect(g[0] for g in gathered)
        if failures:
            raise failure_error(failures, what, then, default)
        return [g[1] for g in gathered]

    # ------------------------------------------------------------ the read-once exchange

    def isend(self, tensor: torch.Tensor, dst: int, tag: int):
        return dist.isend(tensor, group=self.group, group_dst=dst, tag=tag)

    def irecv(self, tensor: torch.Tensor, src: int, tag: int):
        return dist.irecv(tensor, group=self.group, group_src=src, tag=tag)

    # ------------------------------------------------------------ lost ranks

    def lost(self, exc: BaseException) -> Optional[PeerLost]:
        """`exc` broke a collective: ask the job's store which ranks still answer (every survivor
        says so and waits `GRACE` for the others) and name the rest; None when all answer."""
        gone, note = self._silent_ranks()
        if not gone and not note:
            return None
        who = (f"rank {gone[0]} is gone" if len(gone) == 1 else f"ranks {', '.join(map(str, gone))} are gone"
               ) if gone else note
        error = PeerLost(f"{who} (killed, or its host lost): the checkpoint's process group broke "
                         f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}). "
                         "This job cannot continue; restart it and load the latest committed checkpoint")
        error.failures = [RankFailure(r, "PeerLost", "stopped answering") for r in gone]
        return error

    def _silent_ranks(self) -> Tuple[List[int], str]:
        try:
            store = dist.distributed_c10d._get_default_store()
        except Exception:  # no default group: nothing to ask
            return [], "a rank stopped answering"
        name = getattr(self.group, "group_name", "world") if self.group is not None else "world"
        keys = [f"ckpt_plugins/{name}/{self.operation}/alive/{r}" for r in range(self.world_size)]
        try:
            store.set(keys[self.rank], b"1")
            try:
                store.wait(keys, GRACE)
            except Exception:
                pass  # some rank did not say it is alive in time
            alive = [r for r, key in enumerate(keys) if store.check([key])]
            # the survivors also wait for each other's verdict: the store's host (often rank 0)
            # must not exit before the others have read theirs
            store.set(f"{keys[self.rank]}/seen", b"1")
            try:
                store.wait([f"{keys[r]}/seen" for r in alive], GRACE)
            except Exception:
                pass
            return [r for r in range(self.world_size) if r not in alive], ""
        except Exception:
            return [], "the job's store is unreachable: the process that hosts it (rank 0, or the launcher) is gone"


def checkpoint_groups(process_group, timeout: timedelta) -> Tuple[Coordinator, Coordinator]:
    """Two coordinators on gloo groups of their own over the ranks of `process_group`: the
    foreground one (planning and loads, in the caller's thread) and the background one (commits),
    so checkpoint traffic never interleaves with the training job's collectives or with itself."""
    base = Coordinator(process_group)
    if not base.active or base.world_size == 1:
        return base, Coordinator(process_group)
    ranks = dist.get_process_group_ranks(process_group or dist.group.WORLD)
    # Locally synchronised groups are named from the count of groups each rank is in, which differs
    # across ranks once a framework has made subgroups (Megatron): they would never meet. Over the
    # whole world, plain groups (named by a count every rank keeps) are safe.
    local = len(ranks) != dist.get_world_size()
    fg, bg = (dist.new_group(ranks, backend="gloo", timeout=timeout, use_local_synchronization=local)
              for _ in range(2))
    return Coordinator(fg), Coordinator(bg)


def head_bytes(world: int) -> int:
    """Each rank's frame in a gather's first all-gather: its length and at least 8 bytes."""
    return max(2 * FRAME, HEADS_BYTES // world // 8 * 8)


def _unpickled(buffer: bytearray, ranks: int) -> List[Any]:
    """Every rank's object in a gathered buffer (our own messages: plans, results, failures)."""
    view = memoryview(buffer)
    return [pickle.loads(view[a:a + n]) for a, n in zip(*(x.tolist() for x in unframed(buffer, ranks)))]
