"""What one rank tells the others before a load's data moves (`LoadRequest`), sent as plain bytes,
and every rank's joined on every rank in one pass on arrays (`LoadRequests`): see `packing`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import List, Optional, Sequence

import numpy as np

from .packing import Joined, aligned, padded, spans
from .read_once import RankReads
from .runs import DIGEST_BYTES, Run, RunGroups

_FIELDS = 6  # the header: runs, wanted keys, bytes of missing keys, host, path, reads (-1: none)


@dataclass
class LoadRequest:
    """One rank's: the stored keys it uses (int32 indices into `stored_keys`) and those it misses;
    its read requests' runs (`runs_of`: replicas' alike runs), and the requests themselves where
    the job is small enough to send them at once (`loading.INLINE_READS`); its host (ranks of
    one host exchange through shared memory); the checkpoint it loads (the same on every rank)."""
    wanted: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))
    missing: List[str] = field(default_factory=list)
    runs: List[Run] = field(default_factory=list)
    reads: Optional[RankReads] = None
    host: Optional[str] = None
    path: str = ""

    def packed(self) -> bytes:
        missing = json.dumps(self.missing).encode() if self.missing else b""
        host = None if self.host is None else self.host.encode()
        path, reads = self.path.encode(), None if self.reads is None else self.reads.packed()
        header = [len(self.runs), len(self.wanted), len(missing), -1 if host is None else len(host), len(path),
                  -1 if reads is None else len(reads)]
        return aligned(np.array(header, dtype=np.int64).tobytes(), np.array([r.count for r in self.runs], dtype=np.int64)
                       .tobytes(), b"".join(r.digest for r in self.runs), self.wanted.astype(np.int32).tobytes(),
                       missing, host or b"", path) + (reads or b"")


@dataclass
class LoadRequests:
    """Every rank's `LoadRequest`, joined: their runs grouped, every key some rank uses (`used`:
    indices, repeated), every key some rank misses, each rank's host, the distinct paths, and
    every rank's read requests one rank after the other where every rank sent them."""
    runs: RunGroups
    used: np.ndarray
    missing: List[str]
    hosts: List[Optional[str]]
    paths: List[str]
    reads: Optional[RankReads]

    @classmethod
    def of(cls, blobs: Sequence[bytes]) -> "LoadRequests":
        joined = Joined(blobs, "a load request")
        runs, wanted, missing, host, path, reads = joined.header(_FIELDS).T
        at = joined.start + 8 * _FIELDS  # each section's first byte, rank by rank
        counts, at = at, at + 8 * runs
        digests, at = at, at + padded(DIGEST_BYTES * runs)
        indices, at = at, at + padded(4 * wanted)
        missed, at = at, at + padded(missing)
        hosts, at = at, at + padded(np.maximum(host, 0))
        paths, at = at, at + padded(path)
        wrong = np.flatnonzero(at + np.maximum(reads, 0) != joined.start + joined.size)
        if len(wrong):
            raise ValueError(f"rank {wrong[0]} sent {joined.size[wrong[0]]} bytes that do not hold its load request")
        names = joined.strings(hosts, np.maximum(host, 0)).tolist()
        groups = RunGroups.of(joined.bytes[spans(digests, DIGEST_BYTES * runs)].view(f"S{DIGEST_BYTES}"),
                              joined.longs[spans(counts // 8, runs)], runs)
        held = np.bincount(groups.rank, weights=groups.count, minlength=len(runs)).astype(np.int64)
        return cls(
            runs=groups, used=joined.words[spans(indices // 4, wanted)],
            missing=sorted({k for r in np.flatnonzero(missing).tolist()
                            for k in json.loads(joined.buffer[missed[r]:missed[r] + missing[r]])}),
            hosts=[None if n < 0 else name.decode() for n, name in zip(host.tolist(), names)],
            paths=sorted({p.decode() for p in joined.strings(paths, path).tolist()}),
            reads=None if (reads < 0).any() else RankReads.unpacked(joined, at, reads, held))
