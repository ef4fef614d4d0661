"""A first save's one-time costs, paid ahead in the background beside the first training steps."""
from __future__ import annotations

import logging
import os
import threading
from typing import Any, Dict, Optional

from .coordinator import Coordinator
from .failure import RankFailure
from .plan_cache import PlanCache
from .saving import Contents
from .staging import StagingPool

log = logging.getLogger("ckpt_plugins")


class WarmUp:
    """The save plan (cached for the next save of the same structure) and a staging slot of the
    size that save needs, allocated and touched: faulting in fresh memory was most of a first save
    (bench/save_load.py). The state is read now, in the caller's thread (the only one that may
    read a framework's state); `run` plans (collectively) and stages. A failure only logs: the
    first save then does the work itself."""

    def __init__(self, state: Dict[str, Any], coord: Coordinator, pool: StagingPool, cache: PlanCache, base=None):
        self.coord, self.pool, self.cache = coord, pool, cache
        coord.begin()
        self.failure: Optional[RankFailure] = None
        self.contents = Contents(coord.rank)
        try:  # passed on by the plan's agreement: every rank must learn of it
            self.contents = Contents.of(state, base, None, coord.rank)
            self.contents.check_casts()  # here: the training steps beside `run` change the weights
        except Exception as exc:
            self.failure = RankFailure.of(coord.rank, exc)

    def run(self, background: bool) -> None:
        if background:  # a thread's own niceness on Linux: training keeps the cores it needs
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
            except (AttributeError, OSError):
                pass
        try:
            contents = self.contents
            agreed = self.cache.plan(self.coord, contents.structure, self.failure, "checkpoint warm-up")
            job = contents.staged(None, agreed.plan).job
            self.pool.acquire(job.nbytes, pin=job.pinned).release()
        except Exception as exc:
            log.warning("checkpoint warm-up failed (the first save will plan and stage itself): %s: %s",
                        type(exc).__name__, exc)
