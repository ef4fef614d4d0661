"""What one rank tells the others before a load's data moves (`LoadRequest`), and in a second
message where the job is too big to send its reads at once (`ShareRequests`: its share of what
the ranks alike to it hold); each sent as plain bytes, every rank's joined on every rank in one
pass on arrays (`LoadRequests`, `ShareRequests.of`): see `packing`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import List, Optional, Sequence

import numpy as np

from .packing import Joined, aligned, padded, spans
from .read_once import RankReads, reads_share
from .runs import DIGEST_BYTES, Run, RunGroups, packed_runs, runs_of

_FIELDS = 7  # the header: runs, key runs, wanted keys, bytes of missing keys, host, path, reads (-1: none)


@dataclass
class LoadRequest:
    """One rank's: the stored keys it uses (`wanted`: int32 indices into `stored_keys`, with
    their `key_runs`: `runs_of` them, a run per top-level key) and those it misses; its read
    requests' runs (`runs_of`: replicas' alike runs), and the requests themselves where the job
    is small enough to send them at once (`loading.INLINE_READS`); its host (ranks of one host
    exchange through shared memory); the checkpoint it loads (the same on every rank). The keys
    it uses go with its reads; without them, only their runs: replicas use the same model keys,
    which they send in shares, in `ShareRequests`. The key runs go in either case: one rank
    with too many reads to send at once sends every rank down that path."""
    wanted: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))
    key_runs: List[Run] = field(default_factory=list)
    missing: List[str] = field(default_factory=list)
    runs: List[Run] = field(default_factory=list)
    reads: Optional[RankReads] = None
    host: Optional[str] = None
    path: str = ""

    def packed(self) -> bytes:
        missing = json.dumps(self.missing).encode() if self.missing else b""
        host = None if self.host is None else self.host.encode()
        path, reads = self.path.encode(), None if self.reads is None else self.reads.packed()
        header = [len(self.runs), len(self.key_runs), len(self.wanted), len(missing), -1 if host is None else len(host),
                  len(path), -1 if reads is None else len(reads)]
        return aligned(np.array(header, dtype=np.int64).tobytes(), *packed_runs(self.runs),
                       *packed_runs(self.key_runs), b"" if reads is None else self.wanted.astype(np.int32).tobytes(),
                       missing, host or b"", path) + (reads or b"")


def key_runs(keys: Sequence[str], wanted: np.ndarray) -> List[Run]:
    """`LoadRequest.key_runs` of the stored keys `wanted` (indices into `keys`)."""
    wanted = wanted.tolist()
    return runs_of([keys[i] for i in wanted], wanted)


@dataclass
class LoadRequests:
    """Every rank's `LoadRequest`, joined: their runs and key runs grouped; where every rank sent
    its reads, every key some rank uses (`used`: indices, repeated) and every rank's read requests
    one rank after the other (else both None: see `ShareRequests`); every key some rank misses,
    each rank's host, the distinct paths."""
    runs: RunGroups
    key_runs: RunGroups
    used: Optional[np.ndarray]
    missing: List[str]
    hosts: List[Optional[str]]
    paths: List[str]
    reads: Optional[RankReads]

    @classmethod
    def of(cls, joined: Joined) -> "LoadRequests":
        """Every rank's `packed` request, in `joined`."""
        runs, runs_k, wanted, missing, host, path, reads = joined.header(_FIELDS).T
        at = joined.start + 8 * _FIELDS  # each section's first byte, rank by rank
        counts, at = at, at + 8 * runs
        digests, at = at, at + padded(DIGEST_BYTES * runs)
        counts_k, at = at, at + 8 * runs_k
        digests_k, at = at, at + padded(DIGEST_BYTES * runs_k)
        indices, at = at, at + np.where(reads < 0, 0, padded(4 * wanted))
        missed, at = at, at + padded(missing)
        hosts, at = at, at + padded(np.maximum(host, 0))
        paths, at = at, at + padded(path)
        wrong = np.flatnonzero(at + np.maximum(reads, 0) != joined.start + joined.size)
        if len(wrong):
            raise ValueError(f"rank {wrong[0]} sent {joined.size[wrong[0]]} bytes that do not hold its load request")
        names = joined.strings(hosts, np.maximum(host, 0)).tolist()

        groups = RunGroups.unpacked(joined, counts, digests, runs)
        inline = not (reads < 0).any()
        return cls(
            runs=groups, key_runs=RunGroups.unpacked(joined, counts_k, digests_k, runs_k, wanted),
            used=joined.words[spans(indices // 4, wanted)] if inline else None,
            missing=sorted({k for r in np.flatnonzero(missing).tolist()
                            for k in json.loads(joined.buffer[missed[r]:missed[r] + missing[r]])}),
            hosts=[None if n < 0 else name.decode() for n, name in zip(host.tolist(), names)],
            paths=_distinct(joined.strings(paths, path)),
            reads=RankReads.unpacked(joined, at, reads, groups.held()) if inline else None)


def _distinct(names: np.ndarray) -> List[str]:
    """The distinct strings of a bytes array, sorted; mostly one, every rank's (decoded only where
    they differ from the first rank's)."""
    if not len(names):
        return []
    return sorted({n.decode() for n in names[names != names[0]].tolist()} | {names[0].decode()})


@dataclass
class ShareRequests:
    """What one rank sends in a load's second all-gather, where the first did not hold its reads
    (`LoadRequests.reads` None): its share of the keys in its key runs (`RunGroups.share`), and its
    `reads_share`. Joined (`of`): every key some rank uses (indices, repeated), and every rank's
    shares of the reads one rank after the other."""
    keys: np.ndarray
    reads: RankReads

    @classmethod
    def mine(cls, request: LoadRequest, reads: RankReads, every: LoadRequests, rank: int) -> "ShareRequests":
        """`rank`'s, whose `request` and read requests `reads` every rank's joined in `every`."""
        return cls(request.wanted[every.key_runs.share(rank)], reads_share(reads, every.runs, rank))

    def packed(self) -> bytes:
        return aligned(self.keys.astype(np.int32).tobytes()) + self.reads.packed()

    @classmethod
    def of(cls, joined: Joined, every: LoadRequests) -> "ShareRequests":
        """Every rank's `packed` message, in `joined`."""
        keys = every.key_runs.share_counts()
        skip = padded(4 * keys)
        short = np.flatnonzero(joined.size < skip)
        if len(short):
            raise ValueError(f"rank {short[0]} sent {joined.size[short[0]]} bytes, short of the {skip[short[0]]} bytes "
                             f"of its {keys[short[0]]} key indices")
        reads = RankReads.unpacked(joined, joined.start + skip, joined.size - skip, every.runs.share_counts())
        return cls(joined.words[spans(joined.start // 4, keys)], reads)
