"""Where the memory tier keeps what, and which step a restarted job recovers: pure functions of
the ranks' host keys and of what each host holds (no processes, no I/O)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple


@dataclass(frozen=True)
class Hosts:
    """The job's ranks grouped by host (`shm.host_key` per rank). Hosts are ordered by their
    lowest rank; that rank is the host's leader, which writes what the host holds once."""
    keys: Tuple[str, ...]

    @property
    def groups(self) -> List[List[int]]:
        order: Dict[str, List[int]] = {}
        for rank, key in enumerate(self.keys):
            order.setdefault(key, []).append(rank)
        return list(order.values())

    def leader(self, rank: int) -> bool:
        return self.keys.index(self.keys[rank]) == rank

    def replica_of(self, rank: int) -> Optional[int]:
        """The rank on the next host that keeps `rank`'s replica (the i-th rank of a host sends to
        the i-th rank of the next, modulo its size); None with one host, where there is no other."""
        groups = self.groups
        if len(groups) < 2:
            return None
        h = next(i for i, g in enumerate(groups) if rank in g)
        nxt = groups[(h + 1) % len(groups)]
        return nxt[groups[h].index(rank) % len(nxt)]

    def replicas_for(self, rank: int) -> List[int]:
        """The ranks whose replicas `rank` keeps."""
        return [r for r in range(len(self.keys)) if self.replica_of(r) == rank]


@dataclass
class StepFiles:
    """What one host holds of one memory step."""
    present: Dict[str, int] = field(default_factory=dict)  # file -> size
    required: Optional[Dict[str, int]] = None  # the files its metadata names (None: no metadata here)
    objects: Tuple[str, ...] = ()  # the files holding its objects (every loading rank reads them)


@dataclass
class HostReport:
    """One rank's view before recovery: its host's memory steps and the newest durable step."""
    steps: Dict[int, StepFiles]
    durable: Optional[int]


@dataclass
class Choice:
    """The step a restarted job loads, from `source` "memory" or "storage" (None: nothing)."""
    step: Optional[int]
    source: str
    sizes: Dict[str, int] = field(default_factory=dict)  # memory: every file of the step
    holders: Dict[str, Tuple[int, ...]] = field(default_factory=dict)  # memory: the ranks that can read each
    small: Dict[str, int] = field(default_factory=dict)  # memory: metadata and object files -> the rank sharing it
    why: str = ""  # what was found, for the log


def choose(hosts: Hosts, reports: Sequence[HostReport], metadata_file: str) -> Choice:
    """The newest memory step complete on the surviving hosts (every file its metadata names
    present, whole, on some host), when it is at least as new as the newest durable step (rank 0's
    view, so every rank agrees); else the newest durable step."""
    per_host = {g[0]: reports[g[0]].steps for g in hosts.groups}
    durable = reports[0].durable
    notes = []
    for step in sorted({s for steps in per_host.values() for s in steps}, reverse=True):
        if durable is not None and step < durable:
            break
        found = {leader: steps[step] for leader, steps in per_host.items() if step in steps}
        described = next((f for f in found.values() if f.required is not None), None)
        if described is None:
            notes.append(f"step {step}: no surviving host has its metadata (its save never committed)")
            continue
        required = dict(described.required)
        required[metadata_file] = max(f.present.get(metadata_file, 0) for f in found.values())
        holders: Dict[str, Tuple[int, ...]] = {}
        for name, size in required.items():
            holders[name] = tuple(r for g in hosts.groups if g[0] in found
                                  and found[g[0]].present.get(name) == size for r in g)
        missing = sorted(n for n, h in holders.items() if not h)
        if missing:
            notes.append(f"step {step}: {len(missing)} of its {len(required)} files are on no surviving host "
                         f"(e.g. {missing[0]})")
            continue
        small = {n: holders[n][0] for n in (metadata_file, *described.objects)}
        return Choice(step, "memory", required, holders, small, "; ".join(notes))
    if durable is not None:
        return Choice(durable, "storage", why="; ".join(notes))
    return Choice(None, "", why="; ".join(notes) or "no step in memory or storage")
