"""What saves and loads return: SaveInfo, LoadResult, and the SaveHandle of an in-flight save."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from .telemetry import RankTelemetry, metrics, summary


@dataclass
class SaveInfo:
    """What a save did, on this rank: bytes, the plan's balance, collectives, timings (s)."""
    rank_bytes: int = 0
    total_bytes: int = 0
    balance: float = 1.0  # max/mean bytes written per rank
    plan_cached: bool = False
    collectives: int = 0  # foreground (planning) collectives of this save
    timings: Dict[str, float] = field(default_factory=dict)  # seconds per phase (wall), and the stall
    telemetry: Optional[RankTelemetry] = None  # this rank's phases
    ranks: List[RankTelemetry] = field(default_factory=list)  # every rank's, on the coordinating rank
    files: Dict[str, int] = field(default_factory=dict)  # the files this rank wrote, with their sizes

    def summary(self) -> Dict[str, object]:
        """The whole save's figures (on the coordinating rank; elsewhere this rank's view)."""
        return summary(self.ranks, self.total_bytes)

    def metrics(self) -> Dict[str, float]:
        """The scalars loggers plot: ckpt/stall_s, ckpt/commit_s, ckpt/save_gbps, ..."""
        return metrics(self.summary())


@dataclass
class LoadResult:
    missing_keys: List[str] = field(default_factory=list)
    unexpected_keys: List[str] = field(default_factory=list)
    kept_per_rank: List[str] = field(default_factory=list)  # per-rank objects no rank like ours saved
    read_bytes: int = 0  # bytes this rank read from storage
    unverified_bytes: int = 0  # of those, what no checksum covered (a foreign checkpoint's)
    verified_bytes: int = 0  # with verify=True: the live bytes compared with what was loaded
    step: Optional[int] = None  # the step a CheckpointManager loaded
    source: str = ""  # where it came from: "storage" or "memory" (the memory tier)
    collectives: int = 0
    telemetry: Optional[RankTelemetry] = None  # this rank's phases
    ranks: List[RankTelemetry] = field(default_factory=list)  # every rank's, on the coordinating rank


class SaveHandle:
    """An in-flight save. `wait_snapshot()` before mutating the saved state; `wait()` for the commit."""

    def __init__(self, path: str):
        self.path = path
        self.info = SaveInfo()
        self._snapshot = threading.Event()
        self._done = threading.Event()
        self._error: Optional[BaseException] = None

    def snapshot_taken(self) -> None:
        self._snapshot.set()

    def succeed(self) -> None:
        self._done.set()

    def fail(self, exc: BaseException) -> None:
        self._error = self._error or exc
        self._snapshot.set()
        self._done.set()

    def wait_snapshot(self) -> None:
        """Block until the saved tensors have been copied; then training may modify them."""
        self._snapshot.wait()
        if self._error is not None and not self._done.is_set():
            raise self._error

    def wait_snapshot_quietly(self) -> None:
        """Block until the snapshot is over, taken or failed, leaving a failure to `wait()`."""
        self._snapshot.wait()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: Optional[float] = None) -> SaveInfo:
        """Block until committed; raises the save's error (on every rank, naming the failing ranks)."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"save to {self.path} still running after {timeout} s")
        if self._error is not None:
            raise self._error
        return self.info

    def wait_quietly(self) -> None:
        """Wait, leaving the error to the handle's own `wait()` (a later save to the same path
        must not start under this one)."""
        self._done.wait()


def take_finished(pending: list) -> List[SaveInfo]:
    """The SaveInfo of every finished save in `pending` (SaveInfos, and SaveHandles of async
    saves), removed from it, for a logger that reports each save once. Failed saves are dropped:
    they logged their failure, and their handle's wait() raises it to whoever waits."""
    done = []
    for item in [p for p in pending if not isinstance(p, SaveHandle) or p.done()]:
        pending.remove(item)
        if isinstance(item, SaveInfo):
            done.append(item)
        elif item._error is None:
            done.append(item.info)
    return done
