"""Coordination between ranks: the few object collectives planning and commit need.

Works the same with no process group (a single process). Objects exchanged here are our own
in-memory plans and results, never checkpoint content.
"""
from __future__ import annotations

from typing import Any, List, Optional

import torch.distributed as dist


class Coordinator:
    """Rank 0 of `group` coordinates; `collectives` counts calls (tests assert on it)."""

    def __init__(self, group: Optional[dist.ProcessGroup] = None):
        self.active = dist.is_available() and dist.is_initialized()
        self.group = group
        self.rank = dist.get_rank(group) if self.active else 0
        self.world_size = dist.get_world_size(group) if self.active else 1
        self.collectives = 0

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    def all_gather(self, obj: Any) -> List[Any]:
        if self.world_size == 1:
            return [obj]
        self.collectives += 1
        out: List[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def gather(self, obj: Any) -> Optional[List[Any]]:
        """Everyone's `obj` on the coordinator, None elsewhere."""
        if self.world_size == 1:
            return [obj]
        self.collectives += 1
        out: Optional[List[Any]] = [None] * self.world_size if self.is_coordinator else None
        dst = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        dist.gather_object(obj, out, dst=dst, group=self.group)
        return out

    def scatter(self, objs: Optional[List[Any]]) -> Any:
        """Element `rank` of the coordinator's list, on every rank."""
        if self.world_size == 1:
            return objs[0]
        self.collectives += 1
        out: List[Any] = [None]
        src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        dist.scatter_object_list(out, objs if self.is_coordinator else None, src=src, group=self.group)
        return out[0]

    def broadcast(self, obj: Any) -> Any:
        """The coordinator's `obj`, on every rank."""
        if self.world_size == 1:
            return obj
        self.collectives += 1
        box = [obj]
        src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        dist.broadcast_object_list(box, src=src, group=self.group)
        return box[0]
