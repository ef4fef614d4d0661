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
from datetime import timedelta
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .errors import CheckpointError, PeerLost
from .failure import RankFailure, collect, failure_error

GRACE = timedelta(seconds=2)  # how long survivors wait for each other to say they are alive


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
    def all_gather(self, obj: Any) -> List[Any]:
        if self.world_size == 1:
            return [obj]
        self.collectives += 1
        out: List[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    @_talks
    def gather(self, obj: Any) -> Optional[List[Any]]:
        """Everyone's `obj` on the coordinator, None elsewhere."""
        if self.world_size == 1:
            return [obj]
        self.collectives += 1
        out: Optional[List[Any]] = [None] * self.world_size if self.is_coordinator else None
        dist.gather_object(obj, out, dst=self._root(), group=self.group)
        return out

    @_talks
    def scatter(self, objs: Optional[List[Any]]) -> Any:
        """Element `rank` of the coordinator's list, on every rank."""
        if self.world_size == 1:
            return objs[0]
        self.collectives += 1
        out: List[Any] = [None]
        dist.scatter_object_list(out, objs if self.is_coordinator else None, src=self._root(), group=self.group)
        return out[0]

    @_talks
    def broadcast(self, obj: Any) -> Any:
        """The coordinator's `obj`, on every rank."""
        if self.world_size == 1:
            return obj
        self.collectives += 1
        box = [obj]
        dist.broadcast_object_list(box, src=self._root(), group=self.group)
        return box[0]

    @_talks
    def all_flags(self, flag: int) -> List[int]:
        """Every rank's small integer (a tensor collective: no pickling)."""
        if self.world_size == 1:
            return [flag]
        self.collectives += 1
        out = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        dist.all_gather(out, torch.tensor([flag], dtype=torch.int64), group=self.group)
        return [int(t.item()) for t in out]

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
        failure, payload = None, None
        try:
            payload = fn()
        except Exception as exc:
            failure = RankFailure.of(self.rank, exc)
        return self.agree(failure, payload, what=what, then=then, default=default)

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

