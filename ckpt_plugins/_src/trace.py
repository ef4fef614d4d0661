"""`bcp trace`: what a save's (or a load's) telemetry says: a text report naming the slowest rank
of each phase and what bound the operation, a ranks x phases heatmap (PNG, matplotlib), a
Perfetto / Chrome trace (one track per rank), and a run's history (stall, commit time, size and
throughput per step)."""
from __future__ import annotations

import json
import statistics
from typing import Any, Dict, List, Sequence, Tuple

from .optional import require
from .telemetry import TELEMETRY_FILE, WAITING, RankTelemetry, read_records

SAVE_PHASES = ("plan", "lock", "staging", "snapshot", "write", "checksum", "metadata_write", "commit_wait")
LOAD_PHASES = ("metadata", "plan", "agree", "read", "checksum", "receive", "send", "copy", "objects", "finish")
HOST_ROWS = 64  # above this many ranks the heatmap shows one row per host (its slowest rank)


def phases_of(ranks: Sequence[RankTelemetry]) -> List[str]:
    """The phases the records hold, in the order a save or load runs them."""
    seen = {p.name for r in ranks for p in r.phases}
    order = SAVE_PHASES if ranks and ranks[0].op == "save" else LOAD_PHASES
    return [p for p in order if p in seen] + sorted(seen - set(order))


def seconds_table(ranks: Sequence[RankTelemetry], phases: Sequence[str]) -> List[List[float]]:
    """Busy seconds per rank and phase (summed over the phase's threads on that rank)."""
    out = []
    for r in ranks:
        by = {p.name: p.seconds for p in r.phases}
        out.append([by.get(name, 0.0) for name in phases])
    return out


def report(doc: Dict[str, Any]) -> str:
    """The text report of one save or load: per phase, the slowest rank against the median, with
    the throughput it saw; what bound the operation; for loads, how well reads were shared."""
    ranks: List[RankTelemetry] = sorted(doc["ranks"], key=lambda r: r.rank)
    op = ranks[0].op if ranks else doc.get("op", "save")
    phases = phases_of(ranks)
    table = seconds_table(ranks, phases)
    lines = [f"{op} of {doc.get('path')} (step {doc.get('step')}): {len(ranks)} ranks on "
             f"{len({r.host for r in ranks})} hosts, storage {ranks[0].backend if ranks else '?'}"]
    if doc.get("summary"):
        s = doc["summary"]
        lines.append(f"  whole save {s['seconds']:.3f} s, stall {s['stall']:.3f} s, to commit {s['commit']:.3f} s, "
                     f"{s['bytes'] / 2**30:.3f} GiB, {s['gbps']:.3f} GB/s")
    lines.append(f"  {'phase':<15}{'slowest rank':>13}{'busy s':>10}{'median':>10}{'x median':>10}  throughput")
    stragglers = []
    for j, name in enumerate(phases):
        column = [row[j] for row in table]
        worst = max(range(len(ranks)), key=lambda i: column[i])
        median = statistics.median(column)
        phase = ranks[worst].phase(name)
        speed = (f"{phase.bytes / phase.wall / 1e9:.3f} GB/s" if phase is not None and phase.bytes and phase.wall > 0
                 else "")
        ratio = column[worst] / median if median > 0 else float("inf") if column[worst] > 0 else 1.0
        shown = f"{ratio:>10.2f}" if median > 0 else f"{'-':>10}"  # a phase of one rank (the coordinator's)
        lines.append(f"  {name:<15}{ranks[worst].rank:>13}{column[worst]:>10.3f}{median:>10.3f}{shown}  {speed}")
        if len(ranks) > 1 and name not in WAITING and column[worst] > 0.05 and ratio >= 1.5:
            stragglers.append((column[worst] - median, ranks[worst].rank, name, column[worst], median))
    for _, rank, name, worst, median in sorted(stragglers, reverse=True)[:3]:
        lines.append(f"straggler: rank {rank} in {name}: {worst:.3f} s against a median of {median:.3f} s "
                     f"(host {next(r.host for r in ranks if r.rank == rank)})")
    if not stragglers:
        lines.append("straggler: none (no rank took 1.5x the median of any phase it worked in)")
    lines.append(_bound(ranks, op))
    if op == "load":
        lines.append(_read_once(ranks))
    return "\n".join(lines)


def _longest(ranks: Sequence[RankTelemetry], name: str) -> Tuple[float, int]:
    return max(((r.seconds(name), r.rank) for r in ranks), default=(0.0, 0))


def _bound(ranks: Sequence[RankTelemetry], op: str) -> str:
    """Which limit bound the operation: the longest of its copy, storage and coordination parts
    (each its slowest rank's wall time)."""
    if op == "save":
        parts = {"snapshot copy": _longest(ranks, "snapshot"), "storage (writes)": _longest(ranks, "write"),
                 "coordination (planning, commit)": max(_longest(ranks, "plan"), _longest(ranks, "metadata_write"))}
    else:
        parts = {"storage (reads)": _longest(ranks, "read"), "copies into the model": _longest(ranks, "copy"),
                 "exchange between ranks": max(_longest(ranks, "receive"), _longest(ranks, "send")),
                 "coordination (metadata, planning, agreement)": max(_longest(ranks, "metadata"),
                                                                     _longest(ranks, "plan"), _longest(ranks, "agree"))}
    what, (seconds, rank) = max(parts.items(), key=lambda kv: kv[1][0])
    others = ", ".join(f"{k} {v[0]:.3f} s" for k, v in parts.items() if k != what)
    return f"bound by: {what}, {seconds:.3f} s on rank {rank} (then {others})"


def _read_once(ranks: Sequence[RankTelemetry]) -> str:
    stored = max((r.info.get("checkpoint_bytes", 0) for r in ranks), default=0)
    read = sum(r.phase("read").bytes for r in ranks if r.phase("read") is not None)
    shm = sum(r.phase("receive").info.get("shm_bytes", 0) for r in ranks if r.phase("receive") is not None)
    group = sum(r.phase("receive").info.get("group_bytes", 0) for r in ranks if r.phase("receive") is not None)
    ratio = read / stored if stored else 0.0
    return (f"read once: {read / 2**20:.1f} MiB read from storage for a {stored / 2**20:.1f} MiB checkpoint "
            f"({ratio:.2f}x), {(shm + group) / 2**20:.1f} MiB from other ranks ({shm / 2**20:.1f} through "
            f"shared memory, {group / 2**20:.1f} over the group)")


def _pyplot():
    """matplotlib's pyplot, drawing to files (the only part of `bcp trace` that needs it)."""
    matplotlib = require("matplotlib", "bcp trace's plots")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def heatmap(ranks: Sequence[RankTelemetry], out_png: str, title: str = "") -> None:
    """Ranks x phases, busy seconds as colour; above HOST_ROWS ranks, one row per host (the
    slowest of its ranks), labelled with the host and its rank range."""
    plt = _pyplot()
    ranks = sorted(ranks, key=lambda r: r.rank)
    phases = phases_of(ranks)
    table = seconds_table(ranks, phases)
    labels = [f"rank {r.rank}" for r in ranks]
    if len(ranks) > HOST_ROWS:
        groups: Dict[str, List[int]] = {}
        for i, r in enumerate(ranks):
            groups.setdefault(r.host, []).append(i)
        table = [[max(table[i][j] for i in members) for j in range(len(phases))] for members in groups.values()]
        labels = [f"{host} (ranks {ranks[m[0]].rank}-{ranks[m[-1]].rank})" for host, m in groups.items()]
    rows = len(table)
    height = min(16.0, 1.5 + (0.28 if rows <= 32 else 0.11) * rows)
    fig, ax = plt.subplots(figsize=(1.2 + 1.1 * len(phases), height))
    image = ax.imshow(table, aspect="auto", cmap="viridis", interpolation="nearest")
    ax.set_xticks(range(len(phases)), phases, rotation=30, ha="right")
    step = max(1, rows // 48)  # at most ~48 row labels stay readable
    ax.set_yticks(range(0, rows, step), labels[::step], fontsize=8 if rows > 16 else 10)
    fig.colorbar(image, ax=ax, label="seconds (busy)")
    if rows <= 16 and len(phases) <= 12:
        peak = max((v for row in table for v in row), default=0.0)
        for i, row in enumerate(table):
            for j, v in enumerate(row):
                ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7,
                        color="black" if peak and v > 0.6 * peak else "white")
    ax.set_title(title or f"{ranks[0].op if ranks else ''}: seconds per rank and phase")
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)


def chrome_trace(ranks: Sequence[RankTelemetry]) -> Dict[str, Any]:
    """A Chrome / Perfetto trace: one process track per rank, each phase a slice (µs from the
    earliest start). Opens in ui.perfetto.dev and chrome://tracing."""
    t0 = min((r.start for r in ranks), default=0.0)
    events: List[Dict[str, Any]] = []
    for r in sorted(ranks, key=lambda r: r.rank):
        events.append({"ph": "M", "name": "process_name", "pid": r.rank, "tid": 0,
                       "args": {"name": f"rank {r.rank} ({r.host})"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": r.rank, "tid": 0, "args": {"sort_index": r.rank}})
        for p in r.phases:
            events.append({"ph": "X", "name": p.name, "pid": r.rank, "tid": 0, "ts": (p.start - t0) * 1e6,
                           "dur": max(p.wall, 0.0) * 1e6,
                           "args": {"bytes": p.bytes, "busy_s": round(p.seconds, 6), "count": p.count, **p.info}})
        for lane, f in enumerate(r.info.get("files", []), 1):  # each data file's write on a track of its own
            events.append({"ph": "X", "name": f"write {f['file']}", "pid": r.rank, "tid": lane,
                           "ts": (f["start"] - t0) * 1e6, "dur": max(f["end"] - f["start"], 0.0) * 1e6,
                           "args": {k: v for k, v in f.items() if k not in ("start", "end")}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def read_history(data: bytes) -> List[Dict[str, Any]]:
    rows = []
    for n, line in enumerate(data.decode(errors="replace").splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except ValueError:
                raise ValueError(f"line {n} of the history is not JSON") from None
    return rows


def history_table(rows: Sequence[Dict[str, Any]]) -> str:
    lines = [f"{'step':>8}{'op':>6}{'stall s':>10}{'commit s':>10}{'GiB':>9}{'GB/s':>8}  slowest"]
    for row in rows:
        lines.append(f"{row.get('step')!s:>8}{row.get('op', 'save'):>6}{row.get('stall', 0):>10.3f}"
                     f"{row.get('commit', row.get('seconds', 0)):>10.3f}{row.get('bytes', 0) / 2**30:>9.3f}"
                     f"{row.get('gbps', 0):>8.3f}  rank {row.get('slowest_rank')} {row.get('slowest_phase')}")
    return "\n".join(lines)


def history_plot(rows: Sequence[Dict[str, Any]], out_png: str) -> None:
    plt = _pyplot()
    saves = [r for r in rows if r.get("op", "save") == "save"]
    steps = [r.get("step") for r in saves]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    top.plot(steps, [r.get("stall", 0) for r in saves], marker="o", label="stall")
    top.plot(steps, [r.get("commit", 0) for r in saves], marker="o", label="time to commit")
    top.set_ylabel("seconds")
    top.legend()
    bottom.plot(steps, [r.get("gbps", 0) for r in saves], marker="o", color="tab:green")
    bottom.set_ylabel("GB/s to commit")
    bottom.set_xlabel("step")
    fig.suptitle("checkpoint saves over the run")
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)


def load_telemetry(storage) -> Dict[str, Any]:
    """A checkpoint's telemetry file, checked."""
    return read_records(storage.read_bytes(TELEMETRY_FILE))
