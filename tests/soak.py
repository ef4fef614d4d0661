"""A randomized fault soak. A training job saves every step, sync, async, overlapped and to the
memory tier, mixed, to local disk or to an S3 server (SeaweedFS, reached through a proxy that can
cut its connections). A seeded schedule injects one fault per life of the job, at a random phase:
- `kill`: SIGKILL of a random rank while it plans, snapshots, writes or commits a save;
- `disk_full`: a rank's writes fail with ENOSPC;
- `s3_cut`: the S3 connections cut mid-transfer;
- `corrupt`: a byte of the newest committed checkpoint flipped before the job resumes;
- `freeze`: a rank stopped for seconds;
- `host_lost`: a host's ranks killed and its memory tier gone.

An agent restarts the job as torchrun's elastic agent would: it hosts the rendezvous store, and
a new life may have fewer ranks. After every life it checks the invariants:
- the newest committed checkpoint loads with verify=True and equals the state the run had at that
  step. The job's updates are elementwise and deterministic, so any rank count computes the same
  bits: the reference is the same updates run in one process;
- nothing partial is ever committed or picked: every committed directory is whole, and no step
  the job saw fail is committed;
- no exchange segment, save lock, thread or open checkpoint file is left behind;
- no rank waits for a group timeout: every life ends well inside it.

`bench/soak.py` runs it long; `tests/test_soak.py` runs a short one.
"""
from __future__ import annotations

import errno
import faulthandler
import glob
import json
import os
import random
import shutil
import signal
import threading
import time
import traceback
from collections import Counter
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import ckpt_plugins as cp
from distributed import rank_context

ROWS, COLS = 24, 64  # 24 rows: every rank count here divides them
KINDS = ("kill", "disk_full", "s3_cut", "corrupt", "freeze", "host_lost")
MODES = ("sync", "async", "overlap", "memory")
KEEP = 3  # committed checkpoints kept per root
# seconds; a life longer than LIFE_LIMIT counts as a rank waiting for the group's timeout. Above
# botocore's own 60 s read timeout: an S3 server that stops answering is the storage's to time out.
GROUP_TIMEOUT = 300
LIFE_LIMIT = 150
S3_ROOT = "s3://ckpt/soak"
S3_ENV = "FSSPEC_S3_ENDPOINT_URL"  # set (to the proxy) when the soak has an S3 server


@dataclass
class Fault:
    kind: str
    rank: int = 0
    save: int = 0  # which of the life's saves it hits
    phase: str = ""  # kill: plan, snapshot, write or commit
    after: float = 0.0  # freeze and host_lost: seconds after `rank` starts save `save`
    seconds: float = 0.0  # freeze: how long


@dataclass
class Life:
    number: int
    hosts: List[str]  # each rank's host
    modes: List[str]  # one save per step, in order
    root: str  # where durable saves go: "local" or "s3"
    fault: Fault

    @property
    def world(self) -> int:
        return len(self.hosts)


@dataclass
class Report:
    """What the soak saw: events survived, by fault kind; what broke an invariant."""
    seed: int
    lives: int = 0
    events: Counter = field(default_factory=Counter)
    detected: Counter = field(default_factory=Counter)  # faults a rank saw as an error
    resumed_from: Counter = field(default_factory=Counter)  # memory, local, s3, fresh
    missed: int = 0  # lives whose fault found the job already done (not counted as events)
    restarts: int = 0  # times the S3 server stopped answering and was restarted on its data
    violations: List[str] = field(default_factory=list)
    seconds: float = 0.0

    def lines(self) -> List[str]:
        kinds = ", ".join(f"{k} {self.events[k]} ({self.detected[k]} seen as errors)" for k in KINDS if self.events[k])
        return [f"soak seed {self.seed}: {sum(self.events.values())} events in {self.lives} lives "
                f"({self.missed} whose fault came too late), {self.seconds:.0f} s: {kinds}",
                f"S3 server restarted {self.restarts} times after it stopped answering",
                "resumed from: " + ", ".join(f"{k} {n}" for k, n in sorted(self.resumed_from.items())),
                f"invariants broken: {len(self.violations)}"] + [f"  {v}" for v in self.violations]


# ------------------------------------------------------------------ the job


def _build(mesh):
    torch.manual_seed(0)
    model = nn.Module()
    model.w = nn.Parameter(torch.randn(ROWS, COLS))
    model.b = nn.Parameter(torch.randn(COLS))
    if mesh is not None:
        # every rank holds the whole value: no collective (training needs none; only saves notice a death)
        model.w = nn.Parameter(distribute_tensor(model.w.data, mesh, [Shard(0)], src_data_rank=None))
        model.b = nn.Parameter(distribute_tensor(model.b.data, mesh, [Replicate()], src_data_rank=None))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)


def _advance(model, opt, step: int, mesh) -> None:
    """One deterministic, elementwise update: the same bits on any number of ranks."""
    g = torch.Generator().manual_seed(step)
    for p in (model.w, model.b):
        full = torch.randn(tuple(p.shape), generator=g)
        p.grad = full if mesh is None else distribute_tensor(full, mesh, p.placements, src_data_rank=None)
    opt.step()
    opt.zero_grad()


def _full(model, opt) -> Dict[str, torch.Tensor]:
    def whole(t):
        return t.full_tensor() if hasattr(t, "full_tensor") else t
    out = {n: whole(p.detach()) for n, p in (("w", model.w), ("b", model.b))}
    for n, p in (("w", model.w), ("b", model.b)):
        for k, v in opt.state.get(p, {}).items():
            out[f"{n}/{k}"] = whole(v)
    return out


def reference(step: int) -> Dict[str, torch.Tensor]:
    """The state the run has after `step` steps, computed in one process."""
    model, opt = _build(None)
    for s in range(1, step + 1):
        _advance(model, opt, s, None)
    return _full(model, opt)


def _on_host(workdir: str, host: str) -> None:
    from ckpt_plugins._src import shm
    os.environ[shm.HOST_ENV] = host
    os.environ[shm.SHM_DIR_ENV] = os.path.join(workdir, "hosts", host)
    os.makedirs(os.environ[shm.SHM_DIR_ENV], exist_ok=True)


def _open_files() -> List[str]:
    """This process's open regular files (sockets, pipes and the like left out)."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("/") and not target.startswith(("/dev/", "/proc/")):
            out.append(target)
    return sorted(out)


def rank_main(rank: int, life: Life, workdir: str, port: int, env: Dict[str, str]) -> None:
    """One rank of one life: resume, train and save, then report (`workdir/reports`) and exit
    without an orderly teardown (it would wait for dead peers)."""
    os.environ.update(env, OMP_NUM_THREADS="1")
    _on_host(workdir, life.hosts[rank])
    stacks = open(os.path.join(workdir, "reports", f"{life.number}-{rank}.stacks"), "w")
    faulthandler.dump_traceback_later(LIFE_LIMIT - 10, file=stacks)  # where a rank hangs, for the report
    report: Dict[str, object] = {"rank": rank, "saves": {}, "t": [time.time()]}
    code = 0
    try:
        store = dist.TCPStore("127.0.0.1", port, life.world, is_master=False, timeout=timedelta(seconds=30))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=life.world,
                                timeout=timedelta(seconds=GROUP_TIMEOUT))
        report["t"].append(time.time())
        _job(rank, life, workdir, report)
    except Exception as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"
        if not isinstance(exc, cp.CheckpointError):
            report["unexpected"] = traceback.format_exc()
            code = 1
    path = os.path.join(workdir, "reports", f"{life.number}-{rank}.json")
    with open(path + ".tmp", "w") as f:  # whole or absent: a lost host's rank may die while writing it
        json.dump(report, f)
    os.replace(path + ".tmp", path)
    os._exit(code)


def _job(rank: int, life: Life, workdir: str, report: dict) -> None:
    from torch.distributed.device_mesh import DeviceMesh

    from faults import Armed, Case, FaultyStorage, Hook, arm

    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")  # the job's group: no other to create
    model, opt = _build(mesh)
    extra = {"step": 0}
    armed = Armed()
    state = {"model": model, "optim": opt, "extra": extra, "hook": Hook(armed)}
    local = f"faulty://{workdir}/local"
    roots = {"local": cp.CheckpointManager(local, keep_last=KEEP)}
    if S3_ENV in os.environ:
        roots["s3"] = cp.CheckpointManager(S3_ROOT, keep_last=KEEP)
    tier = cp.CheckpointManager(local, keep_last=KEEP, memory_every=1, persist_every=2)
    report["t"].append(time.time())
    step = _resume(state, roots, tier, report)
    report["t"].append(time.time())
    got = _full(model, opt)
    if rank == 0:
        want = reference(step)
        report["equal"] = extra["step"] == step and got.keys() == want.keys() and all(
            torch.equal(got[k], want[k]) for k in want)

    pending: Optional[tuple] = None  # (step, handle) of the last save still in flight
    for i, mode in enumerate(life.modes):
        s = step + 1 + i
        if pending is not None:
            pending[1].wait_snapshot()  # an overlapped snapshot finishes before the step changes the state
        _advance(model, opt, s, mesh)
        extra["step"] = s
        fault = life.fault
        _mark(workdir, life, rank, f"save{i}")  # the agent's faults aim at it
        undo = []
        if fault.save == i and fault.rank == rank and fault.kind == "kill":
            undo = arm(Case(fault.phase, "kill", rank, "sync"), rank, life.world, armed, "",
                       os.path.join(workdir, "reports", f"{life.number}-{rank}.killed"))
        if fault.save == i and fault.rank == rank and fault.kind == "disk_full":
            def full(writer, data):
                raise OSError(errno.ENOSPC, "No space left on device (injected)")
            FaultyStorage.FAULTS["write"] = full
            undo = [lambda: FaultyStorage.FAULTS.pop("write", None)]
        pending = _finished(pending, report)
        try:
            # a step saved again after a resume from an older one replaces it, as Megatron's and DCP's do
            if mode == "memory":
                handle = tier.save_async(s, state, overwrite=True)
            elif mode == "sync":
                roots[life.root].save(s, state, overwrite=True)
                handle = None
                report["saves"][str(s)] = "committed"
            else:
                handle = roots[life.root].save_async(s, state, overwrite=True, overlap=mode == "overlap")
        except cp.CheckpointError as exc:
            report["saves"][str(s)] = f"failed: {exc}"
            if _group_broke(exc):
                raise
            handle = None
        pending = (s, handle) if handle is not None else None
        if undo:  # a fault lasts for its save: wait for it before disarming
            pending = _finished(pending, report)
            for u in undo:
                u()
        if i == 0:  # what a steady state holds (storage clients' pools are made by the first use)
            pending = _finished(pending, report)
            threads, files = {t.name for t in threading.enumerate()}, _open_files()
    _finished(pending, report)
    report["t"].append(time.time())
    cp.checkpointer().close()
    report["threads"] = sorted({t.name for t in threading.enumerate()} - threads)
    report["files"] = sorted(set(_open_files()) - set(files))


def _reset(state: dict) -> None:
    """The state a fresh run starts from (a failed load may have written part of it)."""
    model, opt = _build(state["model"].w.device_mesh)
    state["model"].load_state_dict(model.state_dict())
    state["optim"].state.clear()
    state["extra"]["step"] = 0


def _mark(workdir: str, life: Life, rank: int, what: str) -> None:
    with open(os.path.join(workdir, "reports", f"{life.number}-{rank}.{what}"), "w"):
        pass


def _finished(pending: Optional[tuple], report: dict) -> None:
    """Wait for the save in flight; record its outcome. A lost peer ends the life."""
    if pending is None:
        return None
    step, handle = pending
    try:
        handle.wait()
        report["saves"][str(step)] = "committed"
    except cp.CheckpointError as exc:
        report["saves"][str(step)] = f"failed: {exc}"
        if _group_broke(exc):
            raise
    return None


def _group_broke(exc: cp.CheckpointError) -> bool:
    """A rank is gone: the job cannot continue (what a training script does: exit, be restarted)."""
    return isinstance(exc, cp.PeerLost) or any(f.kind == "PeerLost" for f in getattr(exc, "failures", ()))


def _resume(state: dict, roots: dict, tier, report: dict) -> int:
    """Load the newest step in memory or on either root, with verify=True; a corrupt checkpoint
    is reported and the next older one taken. Returns the step (0: nothing to resume)."""
    committed = sorted(((s, name) for name, m in roots.items() for s in m.steps()), reverse=True)
    try:
        found = tier.tier.locate(committed[0][0] if committed else None)
    except cp.NotACheckpointError:
        report["resumed"] = "fresh"
        return 0
    try:
        if found.source == "memory":
            tier.checkpointer.load(found.storage, state, verify=True)
            report["resumed"] = "memory"
            return found.step
        for step, name in committed:
            if step > found.step:
                continue
            try:
                roots[name].load(state, step=step, verify=True)
                report["resumed"] = name
                return step
            except cp.CorruptCheckpointError as exc:
                report.setdefault("corrupt", []).append(f"{name} step {step}: {exc}")
        report["resumed"] = "fresh"  # every checkpoint was corrupt: the run starts again
        _reset(state)
        return 0
    finally:
        tier.tier.settle(found)


# ------------------------------------------------------------------ the agent


def plan(rng: random.Random, number: int, generation: int, kind: str, quick: bool = False) -> Life:
    """Life `number`, with a fault of `kind` (host b in its `generation`); `quick`: 2 saves."""
    world = rng.choice((4, 4, 4, 3, 2))
    b = f"b{generation}"
    hosts = {4: ["a", "a", b, b], 3: ["a", "a", b], 2: ["a", b]}[world]
    modes = [rng.choice(MODES) for _ in range(2 if quick else rng.randint(2, 4))]
    root = "s3" if kind == "s3_cut" else rng.choice(("local", "s3")) if S3_ENV in os.environ else "local"
    fault = Fault(kind, rank=rng.randrange(world), save=rng.randrange(len(modes)))
    if kind == "kill":
        fault.phase = rng.choice(("plan", "snapshot", "write", "commit"))
        if fault.phase in ("write", "commit"):  # through the faulty local storage; rank 0 commits
            root, modes[fault.save] = "local", rng.choice(("sync", "async", "overlap"))
            fault.rank = 0 if fault.phase == "commit" else fault.rank
    if kind == "disk_full":
        modes[fault.save] = rng.choice(("sync", "async", "overlap"))
    if kind == "disk_full":
        root = "local"
    if kind in ("freeze", "host_lost"):
        fault.save = 0 if quick else fault.save  # with two short saves, a later one may be over already
        fault.after = rng.uniform(0.0, 0.03)
        fault.seconds = rng.uniform(0.5, 1.0) if quick else rng.uniform(1.0, 3.0)
    return Life(number, hosts, modes, root, fault)


def _kind(rng: random.Random, order: List[str], s3: bool, committed: bool) -> str:
    """The next fault: each kind once first (in a seeded order), then at random."""
    allowed = [k for k in KINDS if (s3 or k != "s3_cut") and (committed or k != "corrupt")]
    for kind in order:
        if kind in allowed:
            order.remove(kind)
            return kind
    return rng.choice(allowed)


def soak(events: int, seed: int, workdir: str, s3: bool = True, quick: bool = False, server=None,
         log=print) -> Report:
    """Run lives until `events` faults were injected (the first lives draw each kind once);
    returns what was seen. `quick`: two saves per life and shorter freezes. `server`: a running
    S3 server to use (else, with `s3`, one is started and stopped)."""
    import s3_server
    rng = random.Random(seed)
    report = Report(seed)
    os.makedirs(os.path.join(workdir, "reports"), exist_ok=True)
    own = s3 and server is None
    proxy, watchdog, env, saved = None, None, {}, dict(os.environ)
    if s3:
        server = s3_server.start(os.path.join(workdir, "s3")) if own else server
        proxy = s3_server.CuttingProxy(server.port)
        watchdog = Watchdog(server, proxy, report, log)
        env = server.env(f"http://127.0.0.1:{proxy.port}")
        os.environ.update(env)  # the agent lists the S3 root too
    t0, generation, commits = time.time(), 0, {}
    order = rng.sample([k for k in KINDS if s3 or k != "s3_cut"], len(KINDS) - (not s3))
    try:
        while sum(report.events.values()) < events:
            kind = _kind(rng, order, s3, any(commits.values()))
            life = plan(rng, report.lives, generation, kind, quick)
            if life.fault.kind == "corrupt":
                _patiently(watchdog, lambda: _corrupt(workdir, s3))
            cuts = rng.randint(1, 3)
            if life.fault.kind == "s3_cut":
                proxy.sent, proxy.after, proxy.cuts = 0, rng.randint(2_000, 20_000), cuts
            before = _patiently(watchdog, lambda: _commits(workdir, s3)) if life.fault.kind == "corrupt" else commits
            outcome = _run(life, workdir, env)
            if life.fault.kind == "s3_cut":
                outcome["injected"], proxy.cuts = proxy.cuts < cuts, 0
            commits = _patiently(watchdog, lambda: _commits(workdir, s3))
            broken = len(report.violations)

            def check():
                del report.violations[broken:]  # an attempt cut short by the store leaves none behind
                _check(life, outcome, workdir, before, commits, report)
            _patiently(watchdog, check)
            for violation in report.violations[broken:]:  # as they come: a run cut short still says
                log(f"  broken: {violation}")
            report.events[life.fault.kind] += outcome["injected"]
            report.missed += not outcome["injected"]
            report.lives += 1
            if life.fault.kind == "host_lost":
                shutil.rmtree(os.path.join(workdir, "hosts", f"b{generation}"), ignore_errors=True)
                generation += 1
            late = "" if outcome["injected"] else " (late)"
            log(f"life {life.number}: {life.world} ranks, {asdict(life.fault)}{late}, saves {life.modes} to "
                f"{life.root}: {outcome['summary']}")
    finally:
        os.environ.clear()
        os.environ.update(saved)
        if proxy is not None:
            watchdog.close()
            proxy.close()
        if own:
            s3_server.stop(server)
        report.seconds = time.time() - t0
    return report


class Watchdog:
    """The operator's health check on the S3 server: a probe every `every` s, straight to the
    server; after `misses` unanswered in a row (SeaweedFS can stop answering while its port stays
    open), the server restarts on its data and the proxy points at it. Within about 20 s of a
    hang: the storage's retries (60 s) carry the jobs, and the agent's own listings, over it."""

    def __init__(self, server, proxy, report: Report, log, every: float = 2.0, timeout: float = 3.0,
                 misses: int = 2):
        self.server, self.proxy, self.report, self.log = server, proxy, report, log
        self.every, self.timeout, self.misses = every, timeout, misses
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        import s3_server
        unanswered = 0
        while not self.stopped.wait(self.every):
            unanswered = 0 if s3_server.answers(self.server, self.timeout) else unanswered + 1
            if unanswered >= self.misses and not self.stopped.is_set():
                self.log(f"S3 server on port {self.server.port} did not answer {unanswered} probes: restarting it")
                t0 = time.time()
                s3_server.restart(self.server)
                self.proxy.upstream = self.server.port
                self.log(f"S3 server restarted in {time.time() - t0:.1f} s, on port {self.server.port}")
                self.report.restarts += 1
                unanswered = 0

    def close(self) -> None:
        self.stopped.set()
        self.thread.join()


def _patiently(watchdog: Optional[Watchdog], look, wait: float = 300.0):
    """The agent's own look at the roots (not the job's): with an S3 server, it waits out an
    outage the watchdog is mending, up to `wait` s."""
    deadline = time.time() + wait
    while True:
        try:
            return look()
        except Exception as exc:
            if watchdog is None or time.time() > deadline:
                raise
            watchdog.log(f"the agent's look at the roots failed ({type(exc).__name__}: {str(exc)[:200]}); again in 5 s")
            time.sleep(5)


def _run(life: Life, workdir: str, env: Dict[str, str]) -> dict:
    """Start the life's ranks around a store the agent hosts, apply the agent's part of its fault,
    and wait for them (killing any left at the limit)."""
    store = dist.TCPStore("127.0.0.1", 0, life.world, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=30))
    ctx = rank_context()  # fresh processes, forked from one that imported torch once
    procs = [ctx.Process(target=rank_main, args=(r, life, workdir, store.port, env)) for r in range(life.world)]
    for p in procs:
        p.start()
    t0, fault, killed, waited, injected = time.time(), life.fault, set(), [], False
    if fault.kind in ("freeze", "host_lost"):  # at a random point of the chosen save
        mark = os.path.join(workdir, "reports", f"{life.number}-{fault.rank}.save{fault.save}")
        while time.time() - t0 < LIFE_LIMIT and not os.path.exists(mark) and procs[fault.rank].is_alive():
            time.sleep(0.005)
        time.sleep(fault.after)
        if fault.kind == "freeze" and procs[fault.rank].is_alive():
            os.kill(procs[fault.rank].pid, signal.SIGSTOP)
            injected = True
            time.sleep(fault.seconds)
            os.kill(procs[fault.rank].pid, signal.SIGCONT)
        if fault.kind == "host_lost":
            for r, host in enumerate(life.hosts):
                if host != "a" and procs[r].is_alive():
                    os.kill(procs[r].pid, signal.SIGKILL)
                    killed.add(r)
                    injected = True
    for p in procs:
        p.join(max(0.1, LIFE_LIMIT - (time.time() - t0)))
    for r, p in enumerate(procs):
        if p.is_alive():
            waited.append(r)
            p.kill()
            p.join()
    del store
    killed |= {r for r in range(life.world) if os.path.exists(os.path.join(workdir, "reports",
                                                                            f"{life.number}-{r}.killed"))}
    reports = {}
    for r in range(life.world):
        path = os.path.join(workdir, "reports", f"{life.number}-{r}.json")
        if os.path.exists(path):
            with open(path) as f:
                reports[r] = json.load(f)
    codes = [p.exitcode for p in procs]
    if fault.kind == "kill":
        injected = bool(killed)
    elif fault.kind in ("disk_full", "corrupt"):
        injected = True  # the save it hits runs, the byte is flipped
    summary = f"{time.time() - t0:.1f} s, exit codes {codes}"
    return {"reports": reports, "codes": codes, "killed": sorted(killed), "waited": waited, "summary": summary,
            "injected": injected, "pids": [p.pid for p in procs]}


def _committed(workdir: str, s3: bool) -> Dict[int, str]:
    """Committed steps under a root: step -> path."""
    root = S3_ROOT if s3 else f"{workdir}/local"
    if not s3 and not os.path.isdir(root):
        return {}
    manager = cp.CheckpointManager(root)
    return {s: manager.path(s) for s in manager.steps()}


def _corrupt(workdir: str, s3: bool) -> None:
    """Flip a byte of the weights of the newest committed checkpoint on disk or S3."""
    import fsspec
    found = [(step, path) for on_s3 in ((False, True) if s3 else (False,))
             for step, path in _committed(workdir, on_s3).items()]
    path = max(found)[1]
    box = cp.read_metadata(path).tensors["model/w"].boxes[0]
    with fsspec.open(f"{path}/{box.file}", "rb") as f:
        data = bytearray(f.read())
    data[box.offset + 7] ^= 0x5A
    with fsspec.open(f"{path}/{box.file}", "wb") as f:
        f.write(bytes(data))


def _commits(workdir: str, s3: bool) -> Dict[str, Dict[int, bytes]]:
    """Each root's committed steps, with their metadata bytes."""
    from ckpt_plugins._src.storage import storage_for
    out = {}
    for name, on_s3 in (("local", False), ("s3", True)) if s3 else (("local", False),):
        out[name] = {}
        for step, path in _committed(workdir, on_s3).items():
            try:
                out[name][step] = storage_for(path).read_bytes("metadata.json")
            except OSError:  # retention removed it meanwhile
                pass
    return out


def _check(life: Life, outcome: dict, workdir: str, before: Dict[str, Dict[int, bytes]],
           after: Dict[str, Dict[int, bytes]], report: Report) -> None:
    """The invariants after one life (see the module docstring)."""
    from ckpt_plugins._src.committed import check_files
    from ckpt_plugins._src.storage import storage_for
    bad = report.violations.append
    where = f"life {life.number} ({life.fault.kind})"
    reports, killed = outcome["reports"], set(outcome["killed"])
    for r in outcome["waited"]:
        with open(os.path.join(workdir, "reports", f"{life.number}-{r}.stacks")) as f:
            stacks = f.read()
        bad(f"{where}: rank {r} still running after {LIFE_LIMIT} s (waiting for a timeout); its threads:\n{stacks}")
    for r, rep in reports.items():
        if "unexpected" in rep:
            bad(f"{where}: rank {r} raised {rep['unexpected'][-600:]}")
        for name in ("threads", "files"):  # after a lost peer, until the exit that follows: collectives given up on
            if rep.get(name):
                bad(f"{where}: rank {r} left {name} behind: {rep[name]}")
    first = reports.get(0, {})
    if "equal" in first:
        report.resumed_from[first["resumed"]] += 1
        if not first["equal"]:
            bad(f"{where}: the state resumed from {first['resumed']} differs from the run's at that step")
    elif 0 not in killed:
        bad(f"{where}: rank 0 did not resume: {first.get('error', 'no report')[:300]}")
    if "corrupt" in first:
        report.detected["corrupt"] += 1
    survivors = {r: rep for r, rep in reports.items() if r not in killed}
    if any("error" in rep or any(not v.startswith("committed") for v in rep["saves"].values())
           for rep in survivors.values()):
        report.detected[life.fault.kind] += 1
    for r, rep in survivors.items():
        if "error" in rep and not (killed and rep["error"].startswith(("SaveError", "PeerLost"))):
            bad(f"{where}: rank {r} raised {rep['error'][:300]}")
    if life.fault.kind == "freeze" and any(v != "committed" for rep in survivors.values()
                                          for v in rep["saves"].values()):
        bad(f"{where}: a frozen rank made a save fail: {[rep['saves'] for rep in survivors.values()]}")
    # nothing partial committed: every commit whole; a save every survivor saw fail changed no commit
    for root, steps in after.items():
        for step in [s for s, meta in steps.items() if before.get(root, {}).get(s) != meta]:  # new commits
            path = f"{S3_ROOT if root == 's3' else workdir + '/local'}/step_{step}"
            try:
                storage = storage_for(path)
                check_files(storage, cp.read_metadata(storage))
            except (cp.CheckpointError, OSError) as exc:
                if step in _committed(workdir, root == "s3"):  # not removed by retention since
                    bad(f"{where}: committed {path} is not whole: {exc}")
    outcomes: Dict[str, List[str]] = {}
    for rep in survivors.values():
        for step, outcome_text in rep["saves"].items():
            outcomes.setdefault(step, []).append(outcome_text)
    for step, seen in outcomes.items():  # a save that lost a rank after its commit may be committed
        if survivors and len(seen) == len(survivors) and all("Nothing was committed" in o for o in seen):
            for root, steps in after.items():
                if int(step) in steps and steps[int(step)] != before.get(root, {}).get(int(step)):
                    bad(f"{where}: step {step} failed on every rank, yet {root} holds a new commit of it")
    _leftovers(life, workdir, outcome, bad, where)


def _leftovers(life: Life, workdir: str, outcome: dict, bad, where: str) -> None:
    segments = [p for p in glob.glob(os.path.join(workdir, "hosts", "*", "ckpt_plugins-*"))
                if "-tier-" not in os.path.basename(p)]
    if segments:
        bad(f"{where}: shared-memory segments left behind: {segments}")
        for p in segments:
            os.unlink(p)
    for lock in glob.glob(os.path.join(workdir, "local", "*", "save.lock")):  # a killed rank's may stay
        with open(lock) as f:
            owner = json.load(f).get("pid")
        if owner in [pid for r, pid in enumerate(outcome["pids"]) if r not in outcome["killed"]]:
            bad(f"{where}: a rank that lived left its save lock behind: {lock}")
