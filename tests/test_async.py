"""The engine: async and overlapped saves, ordering, plan cache, staging cap, failures, read-once loads."""
import functools
import gc
import os
import threading
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

import ckpt_plugins as cp
from ckpt_plugins._src.storage import LocalStorage
from distributed import run_ranks


def make(seed=0, width=64, depth=6):
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])


def values(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def assert_loads_as(path, expected):
    model = make(seed=99)
    cp.load(path, {"model": model})
    for k, v in model.state_dict().items():
        assert torch.equal(v, expected[k]), k


def test_async_save_snapshots_before_returning(tmp_path):
    model = make()
    before = values(model)
    handle = cp.save_async(tmp_path / "a", {"model": model})
    assert isinstance(handle, cp.SaveHandle)
    with torch.no_grad():  # training mutates its tensors right away
        for p in model.parameters():
            p.add_(1.0)
    info = handle.wait()
    assert handle.done() and info.timings["stall"] > 0 and info.total_bytes >= sum(v.nbytes for v in before.values())
    assert_loads_as(tmp_path / "a", before)


def test_overlapped_save_returns_before_the_snapshot(tmp_path, monkeypatch):
    from ckpt_plugins._src.engine.write import StagedWrite
    gate = threading.Event()
    original = StagedWrite.snapshot
    monkeypatch.setattr(StagedWrite, "snapshot", lambda self, buf, **kw: (gate.wait(), original(self, buf, **kw)))
    model = make()
    before = values(model)
    handle = cp.Checkpointer().save_async(tmp_path / "o", {"model": model}, overlap=True)
    assert not handle._snapshot.is_set()  # returned while the copy has not even started
    gate.set()
    handle.wait_snapshot()  # what the training loop calls before its next optimizer step
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-1.0)
    handle.wait()
    assert_loads_as(tmp_path / "o", before)


def test_overlapped_saves_copy_on_the_checkpointers_own_thread_not_one_started_per_save(tmp_path, monkeypatch):
    model, ckpt = make(), cp.Checkpointer()
    ckpt.save_async(tmp_path / "a", {"model": model}, overlap=True).wait()  # its threads start
    started, start, caller = [], threading.Thread.start, threading.current_thread()
    monkeypatch.setattr(threading.Thread, "start", lambda self: (
        threading.current_thread() is caller and started.append(self.name)) or start(self))
    before = values(model)
    handle = ckpt.save_async(tmp_path / "b", {"model": model}, overlap=True)
    handle.wait_snapshot()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-1.0)
    handle.wait()
    assert started == []  # by the caller: a thread's start waits for the thread to run
    assert_loads_as(tmp_path / "b", before)
    ckpt.close()


class Finalised:
    """A framework object in a reference cycle whose finaliser waits for the last save, as
    DeepSpeed's engine does: its `__del__` calls the `destroy` the hook wrapped (`committed_first`)."""

    def __init__(self, ckpt, ran):
        from ckpt_plugins.ext import committed_first
        self.cycle = self
        self.destroy = committed_first(lambda: ran.append(threading.current_thread().name), ckpt)

    def __del__(self):
        self.destroy()


def test_a_teardown_collected_on_a_thread_a_save_runs_on_does_not_wait_for_that_save(tmp_path, monkeypatch):
    """Garbage collection runs a finaliser on whichever thread allocates: the commit thread
    waited for its own commit there, forever (and so would a caller mid-snapshot)."""
    from ckpt_plugins.ext import SaveHooks
    from ckpt_plugins._src.engine.write import StagedWrite
    ckpt, ran, model = cp.Checkpointer(), [], make()

    def collect(*_):
        Finalised(ckpt, ran)  # garbage at once, which only the collector frees
        gc.collect()

    before = values(model)
    ckpt.save_async(tmp_path / "a", {"model": model}, hooks=SaveHooks(on_commit=collect)).wait(timeout=60)
    original = StagedWrite.snapshot
    monkeypatch.setattr(StagedWrite, "snapshot", lambda self, buf, **kw: (collect(), original(self, buf, **kw))[1])
    caller = threading.Thread(target=ckpt.save, args=(tmp_path / "b", {"model": model}), daemon=True)
    caller.start()
    caller.join(60)
    assert not caller.is_alive() and ran == ["ckpt-commit_0", caller.name]
    assert_loads_as(tmp_path / "a", before)
    assert_loads_as(tmp_path / "b", before)
    ckpt.close()


def test_a_captured_hook_runs_after_the_capture_and_what_it_raises_ends_the_save_with_nothing_written(tmp_path):
    """`SaveHooks.captured` (DeepSpeed's tag check waits there for its collective): it runs once
    the state is captured, in every mode, and its exception leaves nothing behind; the next save
    goes on as usual."""
    from ckpt_plugins.ext import SaveHooks
    from ckpt_plugins._src.state import ModuleHandler
    ckpt, model = cp.Checkpointer(), make()
    before, seen = values(model), []

    class Watched(ModuleHandler):
        def save_items(self, prefix):
            seen.append("capture")
            return super().save_items(prefix)

    def refuse():
        seen.append("hook")
        raise AssertionError("tags differ")
    for mode in ("sync", "async", "overlap"):
        seen.clear()
        save = ckpt.save if mode == "sync" else functools.partial(ckpt.save_async, overlap=mode == "overlap")
        with pytest.raises(AssertionError, match="tags differ"):
            save(tmp_path / mode, {"model": Watched(model)}, hooks=SaveHooks(captured=refuse))
        assert seen == ["capture", "hook"] and not (tmp_path / mode).exists(), mode
        done = save(tmp_path / mode, {"model": Watched(model)}, hooks=SaveHooks(captured=lambda: seen.append("hook")))
        if mode != "sync":
            done.wait(timeout=60)
        assert seen[2:] == ["capture", "hook"]
        assert_loads_as(tmp_path / mode, before)
    ckpt.close()


def held_snapshots(monkeypatch, seconds):
    """Snapshots start only `seconds` from now (as a slow copy would finish late)."""
    from ckpt_plugins._src.engine.write import StagedWrite
    go = threading.Event()
    threading.Timer(seconds, go.set).start()
    original = StagedWrite.snapshot
    monkeypatch.setattr(StagedWrite, "snapshot", lambda self, buf, **kw: (go.wait(), original(self, buf, **kw))[1])
    return go


def test_a_gated_optimizer_step_waits_for_the_overlapped_snapshot_and_the_backward_does_not(tmp_path, monkeypatch):
    from ckpt_plugins.ext import StepGate
    model = make()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    before = values(model)
    go = held_snapshots(monkeypatch, 0.5)
    gate = StepGate()
    gate.hold(cp.Checkpointer().save_async(tmp_path / "o", {"model": model}, overlap=True), opt)
    handle = gate._pending
    model(torch.ones(2, 64)).sum().backward()  # beside the snapshot
    assert not go.is_set()
    opt.step()  # waits for it
    assert handle._snapshot.is_set()
    handle.wait()
    assert_loads_as(tmp_path / "o", before)
    opt.step()  # later steps do not wait (nothing pending), and the wrapper is installed once
    assert gate._pending is None and opt._ckpt_plugins_gate is gate


def test_a_load_waits_for_an_overlapped_snapshot_of_the_state_it_fills(tmp_path, monkeypatch):
    model = make()
    before = values(model)
    cp.save(tmp_path / "other", {"model": make(seed=5)})
    ckpt = cp.Checkpointer()
    held_snapshots(monkeypatch, 0.5)
    handle = ckpt.save_async(tmp_path / "o", {"model": model}, overlap=True)
    ckpt.load(tmp_path / "other", {"model": model})
    handle.wait()
    assert_loads_as(tmp_path / "o", before)


@pytest.mark.parametrize("threads, room, compress", [(1, None, False), (3, None, False), (1, 16 << 10, False),
                                                    (3, 16 << 10, False), (3, None, True), (3, 16 << 10, True),
                                                    (3, 16 << 10, "auto")])
def test_snapshot_copies_every_kind_of_source_exactly(tmp_path, threads, room, compress, monkeypatch):
    """Host tensors go as memmove pieces on several threads, the rest on the caller's thread; the
    files hold each item's bytes at its offset whatever order the pieces finish in. `room`: a
    buffer smaller than the job, streamed through window by window: strided tensors, objects and
    host tensors are copied in parts. `compress`: the writers compress each tensor's chunks (of
    1 KiB here: whole ones from a piece, others gathered across pieces and windows) where the first
    pays, and each item reads back from where they say it went; "auto", onto slow storage: the
    file written as staged until its pace is known, then compressed."""
    from ckpt_plugins._src.engine import write as engine
    from ckpt_plugins._src.engine.read import read_checked
    from ckpt_plugins._src.staging import StagingPool
    monkeypatch.setattr(engine, "COPY_PIECE", 4096)  # many pieces per tensor, finishing out of order
    run = engine._Piece.run
    monkeypatch.setattr(engine._Piece, "run", lambda self: (time.sleep(0.002), run(self)))  # writers wait on it
    g = torch.Generator().manual_seed(0)
    sources = [torch.randn(5000, generator=g),                      # contiguous, several pieces
               torch.randn(40, 30, generator=g).t(),                # strided: copied by copy_
               torch.randn(3000, generator=g).to(torch.bfloat16),
               torch.randn(8, 8, generator=g)[2:5],                 # a contiguous view with an offset
               torch.empty(0),
               torch.arange(3000, dtype=torch.int16),                 # compresses well
               torch.randint(0, 256, (3000,), dtype=torch.uint8, generator=g),  # not at all
               b"encoded object bytes"]
    items, offsets = [], {"d/r0-0.bin": 0, "d/r0-1.bin": 0}
    for i, src in enumerate(sources):
        name = f"d/r0-{i % 2}.bin"
        items.append(engine.StageItem(name, offsets[name], src))
        offsets[name] += items[-1].nbytes + 64  # a gap, as alignment leaves
    storage = LocalStorage(str(tmp_path))
    if compress == "auto":  # storage's pace known after a piece (4 KiB here), slow
        from ckpt_plugins._src.engine import pace
        monkeypatch.setattr(pace, "MEASURED", 4096)
        monkeypatch.setattr(engine, "PIECE", 4096)
        slow_writes(monkeypatch, 0.01)
    job = engine.StagedWrite(storage, items, compress=compress)
    job.chunk = 1024
    buffer = StagingPool().acquire(job.nbytes).buffer if room is None else torch.zeros(room, dtype=torch.uint8)
    results = []
    writer = threading.Thread(target=lambda: results.append(job.write()))
    writer.start()  # the writers follow the snapshot's progress
    job.snapshot(buffer, threads=threads)
    writer.join()
    result, = results
    for item, src, out in zip(items, sources, result.items):
        data = bytes(read_checked(storage, "item", out, 0, item.nbytes, 1024))
        expected = src if isinstance(src, bytes) else src.contiguous().view(torch.uint8).numpy().tobytes()
        assert data == expected
        if not isinstance(src, torch.Tensor) or src.dtype in (torch.int16, torch.uint8) or not item.nbytes:
            assert (out.group > 0) == (bool(compress) and isinstance(src, torch.Tensor) and src.dtype == torch.int16), item
    if compress == "auto":  # begun before storage's pace was known: its first piece went as staged, and the rest
        assert result.items[0].group == 0 and result.items[0].offset == 0
    assert result.sizes == {name: os.path.getsize(tmp_path / name) for name in result.sizes}


def test_saves_commit_in_order_and_staging_is_reused(tmp_path):
    ckpt = cp.Checkpointer()
    model = make()
    expected, handles = [], []
    for i in range(4):
        with torch.no_grad():
            model[0].weight.fill_(float(i))
        expected.append(values(model))
        handles.append(ckpt.save_async(tmp_path / f"s{i}", {"model": model}, step=i))
    handles[-1].wait()
    assert all(h.done() for h in handles)  # an earlier save never commits after a later one
    mtimes = [os.stat(tmp_path / f"s{i}" / "metadata.json").st_mtime_ns for i in range(4)]
    assert mtimes == sorted(mtimes)
    for i in range(4):
        assert_loads_as(tmp_path / f"s{i}", expected[i])
        assert cp.read_metadata(tmp_path / f"s{i}").step == i
    assert ckpt.pool.allocated_bytes <= 2 * (handles[0].info.rank_bytes + 2 * 4096 + 4096)
    assert handles[0].info.plan_cached is False and all(h.info.plan_cached for h in handles[1:])


def slow_writes(monkeypatch, seconds):
    """Every write call of the local storage takes `seconds` longer (a snapshot that outran the
    writers would overwrite staged bytes not yet written)."""
    from ckpt_plugins._src.storage import local
    write = local._FileWriter.write
    monkeypatch.setattr(local._FileWriter, "write", lambda self, data: (time.sleep(seconds), write(self, data))[1])


@pytest.mark.parametrize("mode", ["sync", "async", "overlap"])
def test_a_save_bigger_than_the_host_memory_budget_streams_through_it(tmp_path, mode, monkeypatch):
    """A quarter and an eighth of the save's bytes: every mode commits what the state was when the
    call returned (async) or its snapshot ended (overlap), bit for bit, within the budget."""
    from ckpt_plugins._src import save_plan
    slow_writes(monkeypatch, 0.002)
    monkeypatch.setattr(save_plan, "SPREAD_BYTES", 0)  # two data files, however small the save
    model = make(width=512, depth=4)  # 4 MiB of weights: windows of 256 KiB per file at an eighth
    need = sum(v.nbytes for v in model.state_dict().values())
    for budget in (need // 4, need // 8):
        ckpt = cp.Checkpointer(host_memory=budget)
        before = values(model)
        path = tmp_path / f"{mode}{budget}"
        state = {"model": model, "epoch": 3}  # an object too: more data files than writer threads asked for
        if mode == "sync":
            ckpt.save(path, state)
        else:
            handle = ckpt.save_async(path, state, overlap=mode == "overlap")
            handle.wait_snapshot()
            with torch.no_grad():  # training goes on at once
                for p in model.parameters():
                    p.add_(1.0)
            handle.wait()
        assert 0 < ckpt.pool.allocated_bytes <= budget
        fresh = make(seed=99, width=512, depth=4)
        loaded = {"model": fresh, "epoch": None}
        cp.load(path, loaded, verify=True)
        assert all(torch.equal(v, before[k]) for k, v in fresh.state_dict().items()) and loaded["epoch"] == 3
        ckpt.close()


def test_host_memory_takes_sizes_with_units_and_a_budget_too_small_to_stream_is_a_clear_error(tmp_path):
    model = make()
    assert cp.Checkpointer(host_memory="1.5MiB").host_memory == 3 << 19
    with pytest.raises(ValueError, match=r"host_memory must be a positive number of bytes or a size such as '8GiB'"):
        cp.Checkpointer(host_memory="8G")
    with pytest.raises(cp.SaveError, match=r"a host-memory budget of 4096 bytes for staging is too small .* "
                                           r"give it at least 8192 bytes"):  # a page per half for its one file
        cp.Checkpointer(host_memory="4KiB").save(tmp_path / "x", {"model": model})
    # room for one slot only: saves still work, one at a time, never above the budget
    need = sum(v.nbytes for v in model.state_dict().values())
    ckpt = cp.Checkpointer(host_memory=need + need // 2 + 8192)
    handles = [ckpt.save_async(tmp_path / f"y{i}", {"model": model}) for i in range(3)]
    for h in handles:
        h.wait()
    assert ckpt.pool.allocated_bytes <= ckpt.host_memory
    assert_loads_as(tmp_path / "y2", values(model))


# ------------------------------------------------------------------ multi-process


def cache_worker(rank, world, root):
    ckpt = cp.Checkpointer()
    model = make(seed=rank)  # replicas differ only in values: structure is what the plan depends on
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(make(seed=0).state_dict()[[n for n, q in model.named_parameters() if q is p][0]])
    first = ckpt.save(f"{root}/c0", {"model": model})
    # the agreement all-reduce; run digests gathered, the runs to send scattered; specs gathered, plans scattered
    assert not first.plan_cached and first.collectives == 5
    second = ckpt.save(f"{root}/c1", {"model": model})
    assert second.plan_cached and second.collectives == 1  # the agreement check only
    # one rank's structure changes: every rank replans
    state = {"model": model, "extra": {"t": torch.ones(3)}} if rank == 1 else {"model": model, "extra": {}}
    third = ckpt.save(f"{root}/c2", state)
    assert not third.plan_cached and third.collectives == 5
    meta = cp.read_metadata(f"{root}/c2")
    assert "extra/t" in meta.tensors


def test_plan_cache_skips_planning_collectives(tmp_path):
    run_ranks(2, cache_worker, str(tmp_path))
    assert_loads_as(tmp_path / "c1", values(make(seed=0)))


class Unreadable:
    """An object whose state cannot be taken (a broken framework object)."""

    def state_dict(self):
        raise RuntimeError("this state cannot be read")

    def load_state_dict(self, state):
        pass


def warm_up_worker(rank, world, root):
    import logging
    model = make(seed=0)
    # one rank's warm-up fails: every rank learns of it in the background, logs it, and goes on
    ckpt = cp.Checkpointer()
    warnings = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("ckpt_plugins").addHandler(handler)
    ckpt.warm_up({"model": model, **({"broken": Unreadable()} if rank == 1 else {})})
    ckpt.load(f"{root}/before", {"model": make(seed=3)})  # waits for the warm-up: never interleaves with it
    assert any("warm-up failed" in w and "this state cannot be read" in w for w in warnings), warnings
    assert ckpt.pool.allocated_bytes == 0
    first = ckpt.save(f"{root}/cold", {"model": model})
    assert not first.plan_cached and first.telemetry.phase("staging").bytes > 0  # it did the work itself
    # a warm-up beside training: the first save then plans nothing and faults nothing in
    ckpt = cp.Checkpointer()
    ckpt.warm_up({"model": model})
    with torch.no_grad():
        model[0].weight.add_(1.0)  # training goes on meanwhile
    expected = values(model)
    info = ckpt.save(f"{root}/warm", {"model": model})
    assert info.plan_cached and info.collectives == 1 and info.telemetry.phase("staging").bytes == 0
    assert ckpt.pool.allocated_bytes >= info.rank_bytes
    torch.save(expected, f"{root}/expected.pt")


def test_warm_up_takes_the_first_saves_costs_and_its_failure_only_logs(tmp_path):
    cp.save(tmp_path / "before", {"model": make(seed=3)})
    run_ranks(2, warm_up_worker, str(tmp_path))
    assert_loads_as(tmp_path / "warm", torch.load(tmp_path / "expected.pt"))


def speculation_worker(rank, world, root):
    """An async save copies with its cached plan while the ranks agree on it, and copies again when
    another rank's structure made the plan stale."""
    from ckpt_plugins._src.engine import write as engine
    events = []
    snapshot, all_reduce = engine.StagedWrite.snapshot, dist.all_reduce

    class Logged:
        def __init__(self, work):
            self.work = work

        def wait(self):
            events.append("agreed")
            return self.work.wait()

    engine.StagedWrite.snapshot = lambda self, buf, **kw: (events.append("snapshot"), snapshot(self, buf, **kw))[1]
    dist.all_reduce = lambda *a, async_op=False, **kw: (Logged(all_reduce(*a, async_op=True, **kw)) if async_op
                                                         else all_reduce(*a, **kw))
    ckpt, model = cp.Checkpointer(), make()

    def save(name, state, expected):
        events.clear()
        handle = ckpt.save_async(f"{root}/{name}", state)
        with torch.no_grad():  # training goes on at once: the copy must already be whole
            for p in model.parameters():
                p.add_(1.0)
        handle.wait(timeout=60)
        assert events == expected, (name, events)
        return handle.info

    assert not save("s0", {"model": model}, ["agreed", "snapshot"]).plan_cached
    assert save("s1", {"model": model}, ["snapshot", "agreed"]).plan_cached
    # rank 1's structure changes; rank 0's cached plan still holds locally, so it copies early in vain
    state = {"model": model, "extra": {"t": torch.ones(3)}} if rank == 1 else {"model": model, "extra": {}}
    info = save("s2", state, ["snapshot", "agreed", "snapshot"] if rank == 0 else ["agreed", "snapshot"])
    assert not info.plan_cached
    ckpt.close()


def test_async_save_copies_while_the_ranks_agree_on_the_cached_plan(tmp_path):
    run_ranks(2, speculation_worker, str(tmp_path))
    expected = values(make())
    for name in ["s0", "s1"]:
        assert_loads_as(tmp_path / name, expected)
        expected = {k: v + 1.0 for k, v in expected.items()}  # as the worker added after each save
    model, extra = make(seed=99), {"t": torch.zeros(3)}
    cp.load(tmp_path / "s2", {"model": model, "extra": extra})
    assert torch.equal(extra["t"], torch.ones(3))
    for k, v in model.state_dict().items():
        assert torch.equal(v, expected[k]), k


class FailOnRank1(LocalStorage):
    def open_writer(self, name):
        time.sleep(0.2)
        raise OSError(5, "Input/output error")


def failure_worker(rank, world, root):
    model = make()
    storage = FailOnRank1(f"{root}/f") if rank == 1 else LocalStorage(f"{root}/f")
    handle = cp.save_async(storage, {"model": model})
    start = time.monotonic()
    with pytest.raises(cp.SaveError, match=r"rank 1: OSError: .*Input/output error "
                                           r"\(writing data/r1-0.bin"):
        handle.wait(timeout=60)
    assert time.monotonic() - start < 30
    assert not os.path.exists(f"{root}/f/metadata.json")
    # the group is still usable, and the next save works
    cp.save(f"{root}/g", {"model": model})


def test_a_failed_async_write_raises_on_every_rank_without_hanging(tmp_path):
    run_ranks(2, failure_worker, str(tmp_path))
    assert_loads_as(tmp_path / "g", values(make()))


def interleave_worker(rank, world, root):
    """Background commits run on their own group while training issues collectives."""
    model = make()
    handles = []
    for step in range(3):
        handles.append(cp.save_async(f"{root}/i{step}", {"model": model}))
        for _ in range(20):
            t = torch.ones(1000)
            dist.all_reduce(t)
            assert t[0].item() == world
    for h in handles:
        h.wait(timeout=60)


def test_background_commits_do_not_interleave_with_training_collectives(tmp_path):
    run_ranks(2, interleave_worker, str(tmp_path))
    assert_loads_as(tmp_path / "i2", values(make()))


def unplanned_worker(rank, world, root):
    """Rank 1 calls only once rank 0's overlapped save has returned (or after 10 s): the call
    must not wait for the other ranks, with whom it agrees on the plan in its snapshot thread."""
    model = make()
    ckpt = cp.Checkpointer()
    ckpt.coordinator()  # its groups, created (collectively) on first use
    returned = f"{root}/rank0-returned"
    waited = 0.0
    while rank == 1 and not os.path.exists(returned) and waited < 10:
        time.sleep(0.05)
        waited += 0.05
    handle = ckpt.save_async(f"{root}/o", {"model": model}, overlap=True)
    if rank == 0:
        open(returned, "w").close()
    # a component's collective right after the call (the memory tier's) waits for that agreement
    assert ckpt.coordinator().all_flags(rank + 1) == [1, 2]
    handle.wait_snapshot()  # the next optimizer step's wait
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    handle.wait(timeout=60)
    ckpt.close()
    assert rank == 0 or waited < 10, "rank 0's overlapped save waited for rank 1's call"


def test_an_overlapped_save_returns_before_the_ranks_agree_on_its_plan(tmp_path):
    run_ranks(2, unplanned_worker, str(tmp_path))
    assert_loads_as(tmp_path / "o", values(make()))


def read_once_worker(rank, world, path, totals_path, ring_bytes):
    from ckpt_plugins._src.engine.ring import Ring
    if ring_bytes == "1 on rank 0":
        ring_bytes = 1 if rank == 0 else None
    if ring_bytes is not None:  # each range then waits for the one before it to be retired
        Ring.BYTES = ring_bytes
    rings, init = [], Ring.__init__
    Ring.__init__ = lambda self, sizes, **kw: (init(self, sizes, **kw), rings.append(self.size))[0]
    threads, start = [], threading.Thread.start
    threading.Thread.start = lambda self: (threads.append(self.name), start(self))[1]
    model = make(seed=7, depth=DEPTH)
    result = cp.load(path, {"model": model})
    threading.Thread.start = start
    for k, v in model.state_dict().items():
        assert torch.equal(v, make(depth=DEPTH).state_dict()[k]), k
    totals = [None] * world
    dist.all_gather_object(totals, (result.read_bytes, rings, [t for t in threads if t.startswith("ckpt-read")]))
    if rank == 0:
        torch.save(totals, totals_path)


DEPTH = 72  # 144 ranges: each reader announces over 32 (`shm.ANNOUNCED`) to each other rank


# one pass; one range per pass; a few per pass; rank 0 one range per pass, the others one pass
@pytest.mark.parametrize("ring_bytes", [None, 1, 32 << 10, "1 on rank 0"])
def test_replicated_load_reads_each_byte_once(tmp_path, ring_bytes):
    """Each rank reads under `SERIAL_BYTES` (one piece): with its ring holding every read, its
    stages run one after the other on the loading thread, with none started; one that must
    reuse its ring reads on threads, and ranks of both kinds exchange alike."""
    cp.save(tmp_path / "r", {"model": make(depth=DEPTH)})
    run_ranks(4, read_once_worker, str(tmp_path / "r"), str(tmp_path / "totals"), ring_bytes)
    ranks = torch.load(tmp_path / "totals")
    totals = [t[0] for t in ranks]
    threaded = [bool(t[2]) for t in ranks]
    assert threaded == {None: [False] * 4, "1 on rank 0": [True] + [False] * 3}.get(ring_bytes, [True] * 4), ranks
    stored = sum(b.nbytes for t in cp.read_metadata(tmp_path / "r").tensors.values() for b in t.boxes)
    print(f"read-once load on 4 ranks: bytes read per rank {totals}, checkpoint tensors {stored}")
    assert sum(totals) == stored  # not 4x
    assert max(totals) < 0.4 * stored  # and spread over the ranks
    # the other ranks copy every replica out of its reader's shared memory: no receive buffers
    assert all(rings[1] == 0 for _, rings, _ in ranks)


def test_ring_reuses_memory_oldest_range_first(monkeypatch):
    from ckpt_plugins._src.engine.ring import Ring
    retired = []
    ring = Ring([100, 100, 100, 300])
    assert ring.size == 4 * 4096 and ring.memory.data_ptr() % 4096 == 0  # ranges start page aligned
    monkeypatch.setattr(Ring, "ALIGN", 64)  # small numbers below
    assert Ring([100, 100, 100, 300]).size == 704  # all of them (aligned): less than the bound
    monkeypatch.setattr(Ring, "BYTES", 256)
    assert Ring([100, 300]).size == 320  # the bound, or the largest range when that is bigger
    ring = Ring([100, 100, 100])
    assert ring.size == 256
    spans = []
    for i in range(5):
        t = ring.take(100, lambda i=i: retired.append(i))
        t.fill_(i)
        spans.append(t.data_ptr() - ring.memory.data_ptr())
        live = [(a, b) for a, b, _ in ring.entries]
        assert all(b1 <= a2 or b2 <= a1 for k, (a1, b1) in enumerate(live) for a2, b2 in live[k + 1:]), live
    assert spans == [0, 128, 0, 128, 0] and retired == [0, 1, 2]
    assert torch.equal(ring.memory[128:228], torch.full((100,), 3, dtype=torch.uint8))
    ring.drain()
    assert retired == [0, 1, 2, 3, 4] and not ring.entries


def test_ring_passes_end_before_a_range_that_would_retire_one_of_their_own(monkeypatch):
    from ckpt_plugins._src.engine.ring import Ring
    monkeypatch.setattr(Ring, "ALIGN", 64)
    monkeypatch.setattr(Ring, "BYTES", 256)
    ring = Ring([100, 100, 300])  # 320 bytes: the largest range
    assert ring.passes([100] * 5, limit=1000) == [0, 0, 1, 1, 2]  # two 128-byte ranges, then it wraps
    assert ring.passes([100, 300, 100], limit=1000) == [0, 1, 2]
    assert ring.passes([100] * 3, limit=256) == [0, 0, 1]  # past the limit
    assert ring.passes([300, 10], limit=128) == [0, 1]  # a first range bigger than the limit
    assert not ring.entries  # nothing taken


def split_save_worker(rank, world, path):
    import ckpt_plugins._src.save_plan as plan
    plan.SPLIT_BYTES = 4096  # make this small model's replicated boxes big enough to split
    info = cp.save(path, {"model": make(width=128, depth=4)})
    assert info.balance < 1.05


def test_split_replicated_boxes_round_trip(tmp_path):
    run_ranks(2, split_save_worker, str(tmp_path / "s"))
    meta = cp.read_metadata(tmp_path / "s")
    weight = meta.tensors["model/0.weight"]
    assert len(weight.boxes) == 2 and {b.file.split("-")[0] for b in weight.boxes} == {"data/r0", "data/r1"}
    model = make(seed=3, width=128, depth=4)
    cp.load(tmp_path / "s", {"model": model})
    for k, v in model.state_dict().items():
        assert torch.equal(v, make(width=128, depth=4).state_dict()[k]), k


def test_host_copies_are_exact_at_any_size_and_alignment():
    from ckpt_plugins._src import hostmem
    import platform
    if platform.machine() in ("x86_64", "AMD64"):
        assert hostmem.STREAMING == 1  # the install built the streaming-store helper
    src = torch.randint(0, 256, (1 << 16,), dtype=torch.uint8)
    for copy in (hostmem.stream_copy, hostmem.copy):
        for offset, size in ((0, 0), (0, 1), (3, 15), (1, 64), (5, 1000), (16, 4096), (7, 60001)):
            dst = torch.zeros(size + 64, dtype=torch.uint8)
            copy(dst.data_ptr() + offset, src.data_ptr() + 11, size)
            assert torch.equal(dst[offset:offset + size], src[11:11 + size]), (copy, offset, size)
            assert not dst[:offset].any() and not dst[offset + size:].any()  # nothing outside


def test_big_tensors_are_stored_page_aligned_and_loaded_through_direct_reads(tmp_path, monkeypatch):
    """Tensors of 1 MiB or more start on a page, so a load reads them with O_DIRECT into its
    aligned ring and copies them into the (unaligned) destination: values bit for bit."""
    from ckpt_plugins._src.storage import LocalStorage
    torch.manual_seed(0)
    big = {f"big{i}": torch.randn(700 + i, 513) for i in range(4)}  # sizes no multiple of a page
    state = {**big, "small": torch.randn(7)}
    cp.save(tmp_path / "b", {"model": state})
    boxes = {k: t.boxes[0] for k, t in cp.read_metadata(tmp_path / "b").tensors.items()}
    offsets = [boxes[f"model/{k}"].offset for k in big]
    assert all(o % 4096 == 0 for o in offsets) and max(offsets) > 0  # also those placed after another
    direct, read = [], LocalStorage._direct_read
    monkeypatch.setattr(LocalStorage, "_direct_read",
                        staticmethod(lambda path, offset, view: direct.append(len(view)) or read(path, offset, view)))
    # destinations 16 bytes past an allocation's start: never on a page, whatever the allocator does
    fresh = {k: torch.zeros(v.numel() + 4)[4:].view(v.shape) for k, v in state.items()}
    assert all(fresh[k].data_ptr() % 4096 for k in big)  # the copy out of the ring is needed
    cp.load(tmp_path / "b", {"model": fresh})
    assert all(torch.equal(fresh[k], state[k]) for k in state)
    assert sum(direct) >= sum(t.nbytes for t in big.values()) - len(big) * 4096  # all but the unaligned tails
