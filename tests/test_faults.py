"""The fault matrix: every fault (an exception, a storage error, a corrupt byte, a killed process)
in every phase of a save (plan, snapshot, write, commit) and a load (metadata, load plan, a rank's
own read, a read others wait for, the exchange, a handler's finish), in sync, async and overlapped
saves, with shared memory on and off, on 2 and 3 ranks (on 3, the reader runs its load's stages on
threads, the needers one after the other: `exchange.SERIAL_BYTES`; on 2, every rank one after the
other, as a state this small loads). Every rank must raise the same error,
naming the failing rank and the cause, within 5 s; nothing is committed and the previous
checkpoint stays latest and loads; no /dev/shm segment, lock file or thread is left behind; and
the same processes save and load again once the fault is gone. Killed ranks get their own runs:
the survivors must name them within 5 s.

Faults that do not exist in a phase are left out (a corrupt byte while snapshotting; a storage
error in planning, which reads no storage; a corrupt byte at commit, which reads nothing)."""
from __future__ import annotations

import glob
import json
import os
import threading
import time
from typing import Dict, List, Optional, Tuple

import pytest
import torch
import torch.distributed as dist

import ckpt_plugins as cp
from ckpt_plugins._src.manager import CheckpointManager
from distributed import run_ranks, run_ranks_until
from faults import LOAD_PHASES, SAVE_PHASES, Armed, Case, arm, local_path, report, state, values

FAULTS = {"plan": ("exception",), "snapshot": ("exception",), "write": ("exception", "storage"),
          "commit": ("exception", "storage"), "metadata": ("exception", "storage", "corrupt"),
          "load_plan": ("exception",), "own_read": ("exception", "storage", "corrupt"),
          "shared_read": ("storage", "corrupt"), "exchange": ("exception",), "finish": ("exception",)}
MODES = ("sync", "async", "overlap")
RUNS = [(2, True), (3, False), (3, True), (2, False)]  # (ranks, shared memory) of each process group
LIMIT = 5.0  # seconds from the failing call to every rank's error


def faulty_rank(phase: str, world: int, i: int) -> int:
    if phase in ("commit", "shared_read"):
        return 0  # the coordinator writes the metadata; rank 0 reads the replicated tensor
    return 1 + i % (world - 1)  # a needer in the exchange (rank 0 is the reader)


def matrix():
    """Non-kill cases, spread over RUNS: every save phase in every mode, every load phase with
    shared memory on and off, every (phase, fault) pair at least once, 2 and 3 ranks."""
    runs = {run: [] for run in RUNS}
    i = 0
    for phase in SAVE_PHASES:
        for m, mode in enumerate(MODES):
            run = RUNS[i % len(RUNS)]
            runs[run].append(Case(phase, FAULTS[phase][m % len(FAULTS[phase])], faulty_rank(phase, run[0], i), mode))
            i += 1
    for phase in LOAD_PHASES:
        for fault in FAULTS[phase]:
            for shm_on in (True, False):
                run = [r for r in RUNS if r[1] == shm_on][i % 2]
                runs[run].append(Case(phase, fault, faulty_rank(phase, run[0], i)))
                i += 1
    return runs


def _leftovers(pids) -> list:
    return [p for pid in pids for p in glob.glob(f"/dev/shm/ckpt_plugins-{pid}-*")]


def _threads() -> list:
    return sorted(t.name for t in threading.enumerate())


def _same_error_everywhere(error: Optional[Exception], case: Case, world: int, problems: List[str]) -> str:
    head = str(error).split(". On rank")[0]
    heads = [None] * world
    dist.all_gather_object(heads, (type(error).__name__, head))
    if not all(h == heads[0] for h in heads):
        problems.append(f"the ranks raised different errors: {heads}")
    if f"rank {case.rank}" not in head or case.cause not in head:
        problems.append(f"the error does not name rank {case.rank} and {case.cause!r}: {head}")
    return head


def _run_case(manager, case: Case, rank: int, world: int, armed: Armed, good: int, step: int, out: str):
    """The faulty call; (its error, seconds)."""
    dist.barrier()
    undo = arm(case, rank, world, armed, manager.path(good), f"{out}/died")
    dist.barrier()
    t0, error = time.time(), None
    try:
        if case.phase not in SAVE_PHASES:
            manager.load(state(rank, world, 0, armed)[0])
        elif case.mode == "sync":
            manager.save(step, state(rank, world, step, armed)[0])
        else:
            manager.save_async(step, state(rank, world, step, armed)[0], overlap=case.mode == "overlap").wait()
    except cp.CheckpointError as exc:
        error = exc
    elapsed = time.time() - t0
    dist.barrier()
    for u in undo:
        u()
    dist.barrier()
    return error, elapsed


def _check(manager, case: Case, rank: int, world: int, error, elapsed: float, good: int, step: int, pids,
           baseline) -> Tuple[List[str], str]:
    """What is wrong with the outcome on this rank (every collective runs whatever it finds)."""
    problems: List[str] = []
    if error is None:
        problems.append("no error")
    if elapsed >= LIMIT:
        problems.append(f"the error took {elapsed:.1f} s")
    head = _same_error_everywhere(error, case, world, problems)
    if case.phase in SAVE_PHASES:
        if not isinstance(error, cp.SaveError):
            problems.append(f"not a SaveError: {error!r}")
        if manager.latest() != good or cp.is_checkpoint(manager.path(step)):
            problems.append("a failed save changed the latest checkpoint")
        if os.path.exists(os.path.join(local_path(manager.path(step)), "save.lock")):
            problems.append("the save lock was left behind")
    elif case.phase in ("own_read", "shared_read", "exchange") and "may hold partly loaded data" not in str(error):
        problems.append(f"the error does not name the partly loaded tensors: {error}")
    if _leftovers(pids):
        problems.append(f"shared-memory segments left behind: {_leftovers(pids)}")
    if _threads() != baseline:
        problems.append(f"threads left behind: {sorted(set(_threads()) - set(baseline))}")
    return problems, head


def matrix_worker(rank, world, root, cases, shared_memory, out):
    """Every case of one process group in turn; each one's outcome is reported, not raised, so
    the next cases still run and each gets its own test."""
    from ckpt_plugins._src.engine import exchange
    if world == 3 and rank == 0:
        exchange.SERIAL_BYTES = 0
    ckpt = cp.Checkpointer(shared_memory=shared_memory)
    armed = Armed()
    manager = CheckpointManager(f"faulty://{root}/run", checkpointer=ckpt)
    pids = [None] * world
    dist.all_gather_object(pids, os.getpid())
    good = 1
    manager.save_async(0, state(rank, world, 0, armed)[0], overlap=True).wait()  # the Checkpointer's
    manager.save(good, state(rank, world, good, armed)[0])  # threads start, and stay until it is closed
    manager.load(state(rank, world, 0, armed)[0])  # the load path's threads come and go once
    baseline, seen = _threads(), {}
    for i, case in enumerate(cases):
        step = 100 + i
        error, elapsed = _run_case(manager, case, rank, world, armed, good, step, out)
        problems, head = _check(manager, case, rank, world, error, elapsed, good, step, pids, baseline)
        try:  # the fault is gone: the same processes save and load again
            fresh, (rep, own) = state(rank, world, 0, armed)
            manager.load(fresh)
            want_rep, want_own = values(rank, world, good)
            if not (torch.equal(rep, want_rep) and torch.equal(own, want_own)):
                problems.append("the previous checkpoint loads other values")
            if case.phase in SAVE_PHASES:
                manager.save(step, state(rank, world, step, armed)[0])
                good = step
        except cp.CheckpointError as exc:  # every rank raises it alike
            problems.append(f"after the fault: {exc}")
        everyone = [None] * world
        dist.all_gather_object(everyone, problems)
        seen[str(case)] = dict(problems=[f"rank {r}: {p}" for r, ps in enumerate(everyone) for p in ps],
                               head=head, elapsed=round(elapsed, 2))
    if rank == 0:
        report(f"{out}/seen.json", seen=seen)


CASES = [(run, case) for run, cases in matrix().items() for case in cases]


def _case_id(run, case: Case) -> str:
    world, shared_memory = run
    mode = f"-{case.mode}" if case.phase in SAVE_PHASES else ""
    return f"{case.phase}-{case.fault}{mode}-{world}ranks-shm{'on' if shared_memory else 'off'}"


@pytest.fixture(scope="module")
def matrix_outcomes(tmp_path_factory):
    """Each process group's cases, run once (its processes serve all of them), by case."""
    done: Dict[tuple, dict] = {}

    def outcomes(run) -> dict:
        if run not in done:
            world, shared_memory = run
            root = tmp_path_factory.mktemp(f"faults{world}{int(shared_memory)}")
            run_ranks(world, matrix_worker, str(root), matrix()[run], shared_memory, str(root))
            done[run] = json.load(open(root / "seen.json"))["seen"]
        return done[run]
    return outcomes


@pytest.mark.parametrize("run,case", CASES, ids=[_case_id(run, case) for run, case in CASES])
def test_every_rank_raises_the_same_error_and_nothing_is_lost(matrix_outcomes, run, case):
    outcome = matrix_outcomes(run)[str(case)]
    print(f"{outcome['elapsed']:5.2f} s  {case}\n        {outcome['head'][:160]}")
    assert not outcome["problems"], outcome["problems"]


def test_the_matrix_covers_every_fault_in_every_phase_modes_and_shared_memory():
    cases = CASES
    assert {(c.phase, c.fault) for _, c in cases} == {(p, f) for p, fs in FAULTS.items() for f in fs}
    assert {(c.phase, c.mode) for _, c in cases if c.phase in SAVE_PHASES} == {
        (p, m) for p in SAVE_PHASES for m in MODES}
    assert {(c.phase, run[1]) for run, c in cases if c.phase in LOAD_PHASES} == {
        (p, s) for p in LOAD_PHASES for s in (True, False)}
    assert {run[0] for run, _ in cases} == {2, 3}
    assert len({_case_id(run, c) for run, c in cases}) == len(cases)


# ---------------------------------------------------------------------------- killed ranks

KILLS = [Case("plan", "kill", 1, "sync"), Case("snapshot", "kill", 1, "async"), Case("write", "kill", 2, "overlap"),
         Case("commit", "kill", 0, "async"), Case("metadata", "kill", 1), Case("load_plan", "kill", 2),
         Case("own_read", "kill", 1), Case("shared_read", "kill", 0), Case("exchange", "kill", 2),
         Case("finish", "kill", 1)]


def kill_worker(rank, world, root, case, shared_memory, out):
    ckpt = cp.Checkpointer(shared_memory=shared_memory)
    armed = Armed()
    manager = CheckpointManager(f"faulty://{root}/run", checkpointer=ckpt)
    manager.save(1, state(rank, world, 1, armed)[0])
    dist.barrier()
    arm(case, rank, world, armed, manager.path(1), f"{out}/died")
    t0 = time.time()
    try:
        if case.phase in SAVE_PHASES:
            if case.mode == "sync":
                manager.save(2, state(rank, world, 2, armed)[0])
            else:
                manager.save_async(2, state(rank, world, 2, armed)[0], overlap=case.mode == "overlap").wait()
        else:
            manager.load(state(rank, world, 0, armed)[0])
        outcome = dict(kind=None, message="no error")
    except cp.CheckpointError as exc:
        outcome = dict(kind=type(exc).__name__, message=str(exc))
    report(f"{out}/rank{rank}.json", elapsed=time.time() - t0, **outcome)
    os._exit(0)  # the group is broken: no orderly teardown


@pytest.mark.parametrize("case", KILLS, ids=[c.phase for c in KILLS])
def test_a_killed_rank_is_named_by_every_survivor_within_seconds(tmp_path, case):
    world = 3 if case.rank == 2 else 2
    shared_memory = KILLS.index(case) % 2 == 0
    codes = run_ranks_until(world, 90, kill_worker, str(tmp_path), case, shared_memory, str(tmp_path))
    died = [r for r, code in enumerate(codes) if code == -9]
    assert died == [case.rank], codes
    for r in range(world):
        if r in died:
            continue
        got = json.load(open(tmp_path / f"rank{r}.json"))
        assert got["kind"] == ("SaveError" if case.phase in SAVE_PHASES else "PeerLost"), got
        assert f"rank {case.rank}" in got["message"], got
        assert got["elapsed"] < LIMIT, got
        print(f"rank {r}: {got['elapsed']:.2f} s after the call: {got['message'][:200]}")
    assert os.path.exists(tmp_path / "died")
    # a killed reader cannot remove its segment: the survivors' failed load did
    assert all(os.path.exists(f"/proc/{p.split('-')[-2]}") for p in glob.glob("/dev/shm/ckpt_plugins-*-*"))
    manager = CheckpointManager(tmp_path / "run")
    assert manager.latest() == 1  # nothing committed; the previous checkpoint loads
    fresh, (rep, own) = state(0, world, 0, Armed())
    cp.Checkpointer().load(manager.path(1), {"rep": fresh["rep"], "own": cp.Ignore(), "hook": cp.Ignore()})
    assert torch.equal(fresh["rep"], values(0, world, 1)[0])
