"""Telemetry: per-rank, per-phase seconds and bytes of every save and load.

Each rank records its own phases (`Recorder`, thread-safe: writers, readers and the copier add to
it); the records travel on the gathers the commit and the load already make, so recording adds
no collective. The coordinator keeps a save's records beside the checkpoint (`telemetry.json`,
never read by a load) and a run's history under the CheckpointManager root (`telemetry.jsonl`).
"""
from __future__ import annotations

import json
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

TELEMETRY_FILE = "telemetry.json"
HISTORY_FILE = "telemetry.jsonl"
FORMAT = "ckpt_plugins-telemetry"
# Phases spent waiting for other ranks: where a straggler's delay shows up on everyone else, so
# they never name the straggler themselves.
WAITING = ("commit_wait", "agree")
VERSION = 1


@dataclass
class Phase:
    """One phase on one rank: wall-clock start and end (a timeline), busy seconds (summed over
    the threads that worked in it: may exceed end - start), bytes, and how many pieces."""
    name: str
    start: float
    end: float
    seconds: float = 0.0
    bytes: int = 0
    count: int = 0
    info: Dict[str, Any] = field(default_factory=dict)

    @property
    def wall(self) -> float:
        return self.end - self.start


@dataclass
class RankTelemetry:
    """What one rank did in one save or load."""
    op: str  # save | load
    rank: int
    local_rank: int
    host: str
    backend: str  # the storage: local, s3, ...
    start: float
    end: float = 0.0
    phases: List[Phase] = field(default_factory=list)
    info: Dict[str, Any] = field(default_factory=dict)  # mode, plan cached, ...

    def phase(self, name: str) -> Optional[Phase]:
        return next((p for p in self.phases if p.name == name), None)

    def seconds(self, name: str) -> float:
        """How long the phase held this rank up: its wall time, or its busy time when that is
        shorter (planning that let an async save's copy run inside it); 0 when it did not run."""
        p = self.phase(name)
        return min(p.wall, p.seconds) if p is not None else 0.0

    def to_dict(self) -> Dict[str, Any]:
        """The record as plain data for encoding, sharing its `info` dicts (`asdict`'s deep copy
        of every phase cost each commit more than the file's write)."""
        return {**vars(self), "phases": [dict(vars(p)) for p in self.phases]}

    @classmethod
    def from_dict(cls, data: Dict[str, Any]) -> "RankTelemetry":
        phases = [Phase(**p) for p in data.get("phases", [])]
        return cls(**{**data, "phases": phases})


class Recorder:
    """Collects one rank's phases of one save or load. `enabled=False` records nothing (the
    overhead benchmark's baseline)."""

    def __init__(self, op: str, backend: str, rank: int, enabled: bool = True):
        self.enabled = enabled
        self.record = RankTelemetry(op, rank, int(os.environ.get("LOCAL_RANK", rank)), socket.gethostname(),
                                    backend, time.time())
        self._lock = threading.Lock()
        self._by_name: Dict[str, Phase] = {}

    def add(self, name: str, start: float, end: float, nbytes: int = 0, busy: Optional[float] = None,
            **info) -> None:
        """Count [start, end) (wall clock) and `nbytes` into phase `name`; `busy` defaults to end - start."""
        if not self.enabled:
            return
        with self._lock:
            p = self._by_name.get(name)
            if p is None:
                p = self._by_name[name] = Phase(name, start, end)
                self.record.phases.append(p)
            p.start, p.end = min(p.start, start), max(p.end, end)
            p.seconds += (end - start) if busy is None else busy
            p.bytes += nbytes
            p.count += 1
            for key, value in info.items():  # counts add up; anything else is the latest word
                summed = isinstance(value, (int, float)) and not isinstance(value, bool)
                p.info[key] = p.info.get(key, 0) + value if summed else value

    def phase(self, name: str, nbytes: int = 0, **info) -> "_Timed":
        """`with recorder.phase("snapshot", nbytes): ...` records the block."""
        return _Timed(self, name, nbytes, info)

    def finish(self) -> RankTelemetry:
        self.record.end = time.time()
        return self.record


class _Timed:
    def __init__(self, recorder: Recorder, name: str, nbytes: int, info: Dict[str, Any]):
        self.recorder, self.name, self.nbytes, self.info = recorder, name, nbytes, info

    def __enter__(self) -> "_Timed":
        self.start = time.time()
        return self

    def __exit__(self, *exc) -> None:
        self.recorder.add(self.name, self.start, time.time(), self.nbytes, **self.info)


def backend_of(storage) -> str:
    name = type(storage).__name__
    return "local" if name == "LocalStorage" else getattr(storage, "protocol", name)


def checkpoint_file(ranks: List[RankTelemetry], op: str, path: str, step: Optional[int],
                    extra: Optional[Dict[str, Any]] = None) -> bytes:
    """The side file's bytes: every rank's record of one save."""
    return json.dumps({"format": FORMAT, "version": VERSION, "op": op, "path": path, "step": step,
                       **(extra or {}), "ranks": [r.to_dict() for r in ranks]}).encode()


def read_records(data: bytes) -> Dict[str, Any]:
    """A side file's content, checked; ValueError naming what is wrong otherwise."""
    try:
        doc = json.loads(data)
    except ValueError as exc:
        raise ValueError(f"not valid telemetry JSON: {exc}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ValueError("not a ckpt_plugins telemetry file")
    if doc.get("version") != VERSION:
        raise ValueError(f"telemetry version {doc.get('version')} is not {VERSION}")
    try:
        doc["ranks"] = [RankTelemetry.from_dict(r) for r in doc["ranks"]]
    except (KeyError, TypeError) as exc:
        raise ValueError(f"malformed telemetry record: {exc}") from None
    return doc


def summary(ranks: List[RankTelemetry], total_bytes: int) -> Dict[str, Any]:
    """One save's figures for loggers and the run's history: the whole save, the stall, the
    commit, throughput, and its slowest rank and phase (zeros when nothing was recorded)."""
    if not ranks:
        return {"step": None, "seconds": 0.0, "stall": 0.0, "commit": 0.0, "bytes": total_bytes, "gbps": 0.0,
                "ranks": 0, "slowest_rank": None, "slowest_phase": None, "slowest_seconds": 0.0}
    start = min(r.start for r in ranks)
    end = max(r.end for r in ranks)
    stalls = [r.info.get("stall") or (r.end - r.start) for r in ranks]  # a sync save stalls throughout
    commit = max((p.end for r in ranks for p in r.phases), default=end) - start
    slow_rank, slow_phase, slow_seconds = None, None, 0.0
    for r in ranks:
        for p in r.phases:
            if p.name not in WAITING and r.seconds(p.name) > slow_seconds:
                slow_rank, slow_phase, slow_seconds = r.rank, p.name, r.seconds(p.name)
    return {"step": ranks[0].info.get("step"), "seconds": round(end - start, 6), "stall": round(max(stalls), 6),
            "commit": round(commit, 6),
            "bytes": total_bytes, "gbps": round(total_bytes / commit / 1e9, 4) if commit > 0 else 0.0,
            "ranks": len(ranks), "slowest_rank": slow_rank, "slowest_phase": slow_phase,
            "slowest_seconds": round(slow_seconds, 6)}


def metrics(summary: Dict[str, Any]) -> Dict[str, float]:
    """A save's summary as the scalars loggers plot (TensorBoard, W&B, DeepSpeed's monitor)."""
    return {"ckpt/stall_s": float(summary["stall"]), "ckpt/commit_s": float(summary["commit"]),
            "ckpt/save_gbps": float(summary["gbps"]), "ckpt/save_gib": summary["bytes"] / 2**30,
            "ckpt/slowest_rank": float(summary["slowest_rank"] if summary["slowest_rank"] is not None else -1),
            **({"ckpt/step": float(summary["step"])} if summary.get("step") is not None else {})}


def append_history(storage, row: Dict[str, Any]) -> None:
    """Add one line to the run's history under a CheckpointManager root (any storage backend:
    rewritten whole, it is one short line per save)."""
    old = storage.read_bytes(HISTORY_FILE) if storage.exists(HISTORY_FILE) else b""
    storage.put_atomic(HISTORY_FILE, old + json.dumps(row).encode() + b"\n")
