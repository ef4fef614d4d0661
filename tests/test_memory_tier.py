"""The memory tier with real processes on simulated hosts (a host key and a shared-memory
directory per group of ranks): recovery after losing a host, resharded to fewer ranks; a crash
during a memory save; both hosts lost; reads passed on from the only host holding a file."""
import io
import json
import logging
import os
import re
import shutil
import signal
import tempfile
import time

import pytest
import torch
import torch.distributed as dist

import ckpt_plugins as cp
from ckpt_plugins._src import shm
from ckpt_plugins._src.fragment import box_fragment
from ckpt_plugins._src.state import LoadItems, SaveItems
from ckpt_plugins._src.tier.layout import HostReport, Hosts, StepFiles, choose
from distributed import run_ranks, run_ranks_until
from hf_models import assert_same, batch, full_state

ROWS = 8  # global batch rows: every rank count here divides it, so a step's gradient is the same on 4 or 2 ranks


def on_host(hosts_dir: str, name: str) -> None:
    """Make this process a rank of simulated host `name`."""
    os.environ[shm.HOST_ENV] = name
    os.environ[shm.SHM_DIR_ENV] = os.path.join(hosts_dir, name)
    os.makedirs(os.environ[shm.SHM_DIR_ENV], exist_ok=True)


def step_loss(model, opt, step: int) -> float:
    ids = batch(step, ROWS)[dist.get_rank()::dist.get_world_size()]
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    total = loss.detach().reshape(1)
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def manager(root):
    return cp.CheckpointManager(root, memory_every=1, persist_every=3)


def first_run(rank, world, hosts_dir, root, out):
    """4 ranks on hosts a (0, 1) and b (2, 3): saves steps 1-4 (4 to memory only), trains 5 and
    6, and rank 3 dies while writing step 6's memory save."""
    on_host(hosts_dir, "a" if rank < 2 else "b")
    from test_hf_fsdp1 import make
    from ckpt_plugins._src.engine.write import StagedWrite
    model, opt = make("fsdp2", 0)
    mgr = manager(root)
    losses = {}
    for step in range(1, 7):
        losses[step] = step_loss(model, opt, step)
        if step in (3, 4):
            ref = full_state(model, opt)  # collective
            if rank == 0:
                torch.save(ref, os.path.join(out, f"ref{step}.pt"))
        if step <= 4:
            handle = mgr.save_async(step, {"model": model, "optim": opt})
            handle.wait()
    if rank == 0:
        torch.save(losses, os.path.join(out, "losses.pt"))
    dist.barrier()
    original = StagedWrite.write

    def dying(self, *args, **kwargs):
        if rank == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self, *args, **kwargs)
    StagedWrite.write = dying
    t = time.time()
    with pytest.raises(cp.SaveError) as err:
        mgr.save_async(6, {"model": model, "optim": opt}).wait()
    # every survivor raises at once; the coordinator names the dead rank (among any too slow to answer)
    assert time.time() - t < 30 and (rank != 0 or re.search(r"ranks? (\d+, )*3\b", str(err.value))), err.value
    torch.save(True, os.path.join(out, f"survived{rank}.pt"))


def restart(rank, world, hosts_dir, root, out, hosts, expect_step, expect_source, train):
    on_host(hosts_dir, hosts[rank])
    from test_hf_fsdp1 import make
    model, opt = make("fsdp2", 1)
    logs = io.StringIO()
    logging.getLogger("ckpt_plugins").addHandler(logging.StreamHandler(logs))
    logging.getLogger("ckpt_plugins").setLevel(logging.INFO)
    result = manager(root).load({"model": model, "optim": opt})
    assert (result.step, result.source) == (expect_step, expect_source)  # on every rank: agreed
    if rank == 0:
        assert f"recovery: loading step {expect_step} from {expect_source}" in logs.getvalue(), logs.getvalue()
    assert_same(torch.load(os.path.join(out, f"ref{expect_step}.pt")), full_state(model, opt))
    losses = torch.load(os.path.join(out, "losses.pt"))
    for step in range(expect_step + 1, expect_step + 1 + train):
        assert step_loss(model, opt, step) == pytest.approx(losses[step], rel=1e-5, abs=1e-6)


@pytest.fixture(scope="module")
def crashed_run():
    hosts_dir = tempfile.mkdtemp(prefix="ckpt-hosts-", dir=shm.SHM_DIR)
    root = tempfile.mkdtemp(prefix="ckpt-tier-")
    out = tempfile.mkdtemp(prefix="ckpt-tier-ref-")
    try:
        t = time.time()
        codes = run_ranks_until(4, 180, first_run, hosts_dir, root, out)
        assert codes[3] == -signal.SIGKILL and codes[:3] == [0, 0, 0], codes
        assert time.time() - t < 150  # the survivors learnt of the crash at once, not at a timeout
        yield hosts_dir, root, out
    finally:
        for path in (hosts_dir, root, out):
            shutil.rmtree(path, ignore_errors=True)


def tier_dirs(hosts_dir, host):
    base = os.path.join(hosts_dir, host)
    return [os.path.join(base, d) for d in os.listdir(base) if d.startswith("ckpt_plugins-tier-")]


def test_memory_steps_are_replicated_bounded_and_persisted(crashed_run):
    hosts_dir, root, _ = crashed_run
    mgr = cp.CheckpointManager(root)
    assert mgr.steps() == [3] and mgr.latest() == 3  # persist_every=3; step 6 never committed
    stored = cp.read_metadata(os.path.join(tier_dirs(hosts_dir, "a")[0], "step_4"))
    assert {f.split("-")[0] for f in stored.files} == {"data/r0", "data/r1", "data/r2", "data/r3"}
    for host in ("a", "b"):
        (tier,) = tier_dirs(hosts_dir, host)
        # older steps dropped as new ones committed: step 4, and the crashed save's partial step 6
        assert sorted(os.listdir(tier)) == ["step_4", "step_6"]
        step = os.path.join(tier, "step_4")
        # each host holds its own ranks' files and the other host's replicas: all of them, nothing more
        assert {f"data/{f}" for f in os.listdir(os.path.join(step, "data"))} == set(stored.files)
        assert all(os.path.getsize(os.path.join(step, f)) == n for f, n in stored.files.items())
        assert cp.read_metadata(step).files == stored.files
        assert not os.path.exists(os.path.join(tier, "step_6", "metadata.json"))
    on_disk = cp.read_metadata(os.path.join(root, "step_3"))
    assert stored.files.keys() == on_disk.files.keys()  # the same format in memory and on disk


def test_crash_during_a_memory_save_recovers_the_previous_step(crashed_run):
    hosts_dir, root, out = crashed_run
    run_ranks(4, restart, hosts_dir, root, out, ["a", "a", "b", "b"], 4, "memory", 0)
    for host in ("a", "b"):  # recovery dropped the partial step: the next saves start clean
        assert sorted(os.listdir(tier_dirs(hosts_dir, host)[0])) == ["step_4"]


def test_losing_a_host_recovers_from_memory_on_fewer_ranks(crashed_run):
    hosts_dir, root, out = crashed_run
    shutil.rmtree(os.path.join(hosts_dir, "b"))  # host b is gone, with its memory
    run_ranks(2, restart, hosts_dir, root, out, ["a", "a"], 4, "memory", 2)  # resharded 4 -> 2


def test_losing_both_hosts_recovers_the_newest_durable_step(crashed_run):
    hosts_dir, root, out = crashed_run
    shutil.rmtree(os.path.join(hosts_dir, "a"))
    run_ranks(2, restart, hosts_dir, root, out, ["c", "c"], 3, "storage", 2)


# ------------------------------------------------------------------ reads passed on between hosts


class Rows(cp.Handler):
    """This rank's equal share of the rows of `full`'s shape."""

    def __init__(self, tensor, shape, rank):
        self.tensor, self.shape, self.rank = tensor, shape, rank

    def _items(self, prefix, kind):
        return kind(fragments=[box_fragment(prefix, self.shape, (self.rank * self.tensor.shape[0], 0), self.tensor)])

    def save_items(self, prefix):
        return self._items(prefix, SaveItems)

    def load_items(self, prefix, metadata):
        return self._items(prefix, LoadItems)


def share(full, rank, world):
    rows = full.shape[0] // world
    return full[rank * rows:(rank + 1) * rows]


def three_hosts(rank, world, hosts_dir, root, full):
    on_host(hosts_dir, "abc"[rank])
    mgr = cp.CheckpointManager(root, memory_every=1)
    mgr.save_async(1, {"w": Rows(share(full, rank, world).clone(), full.shape, rank), "note": {"world": world}}).wait()


def two_of_three(rank, world, hosts_dir, root, full):
    on_host(hosts_dir, "ab"[rank])
    mine = torch.zeros_like(share(full, rank, world))
    note = {"world": None}
    result = cp.CheckpointManager(root, memory_every=1).load({"w": Rows(mine, full.shape, rank), "note": note})
    assert result.source == "memory" and note == {"world": 3}
    assert torch.equal(mine, share(full, rank, world))


def test_a_file_on_one_surviving_host_is_read_there_and_passed_on():
    """3 hosts, one rank each: host c's file survives only as its replica on host a. After c is
    lost, 2 ranks load 2-way: rank 1 needs that file, and rank 0, which alone can read it, reads
    it and passes the bytes on."""
    hosts_dir = tempfile.mkdtemp(prefix="ckpt-hosts-", dir=shm.SHM_DIR)
    root = tempfile.mkdtemp(prefix="ckpt-tier-")
    try:
        full = torch.randn(12, 40)
        run_ranks(3, three_hosts, hosts_dir, root, full)
        shutil.rmtree(os.path.join(hosts_dir, "c"))
        run_ranks(2, two_of_three, hosts_dir, root, full)
    finally:
        shutil.rmtree(hosts_dir, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)


def full_replica_memory(rank, world, hosts_dir, root, full, where):
    """Host b's memory is full when step 2's replica arrives (reserving the file, or writing a
    piece): the save fails on both ranks, and no partial replica is left."""
    import errno
    from ckpt_plugins._src.tier.hostdir import HostDir, Landing
    on_host(hosts_dir, "ab"[rank])
    mgr = cp.CheckpointManager(root, memory_every=1)
    mgr.save_async(1, {"w": Rows(share(full, rank, world).clone(), full.shape, rank)}).wait()
    def full_memory(*args):
        raise OSError(errno.ENOSPC, "No space left on device")
    if rank == 1 and where == "land":
        HostDir.land = full_memory
    elif rank == 1:
        Landing.write = full_memory
    with pytest.raises(cp.SaveError) as err:
        mgr.save_async(2, {"w": Rows(share(full, rank, world) + 1, full.shape, rank)}).wait()
    assert "rank 1: OSError" in str(err.value) and "No space left" in str(err.value), err.value
    step = mgr.tier.host.step_path(2)
    assert not [f for _, _, fs in os.walk(step) for f in fs if f.endswith(".part")], list(os.walk(step))


def survivor_of_b(rank, world, hosts_dir, root, full):
    on_host(hosts_dir, "b")
    whole = torch.zeros_like(full)
    result = cp.CheckpointManager(root, memory_every=1).load({"w": Rows(whole, full.shape, 0)})
    assert (result.step, result.source) == (1, "memory") and torch.equal(whole, full)


@pytest.mark.parametrize("where", ["land", "write"])
def test_a_failed_replication_fails_the_save_everywhere_and_keeps_the_previous_step(where):
    hosts_dir = tempfile.mkdtemp(prefix="ckpt-hosts-", dir=shm.SHM_DIR)
    root = tempfile.mkdtemp(prefix="ckpt-tier-")
    try:
        full = torch.randn(8, 16)
        run_ranks(2, full_replica_memory, hosts_dir, root, full, where)
        shutil.rmtree(os.path.join(hosts_dir, "a"))  # step 2 was never whole on host b: step 1 is
        run_ranks(1, survivor_of_b, hosts_dir, root, full)
    finally:
        shutil.rmtree(hosts_dir, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)


def test_one_process_persists_from_memory_and_recovers_either_way(tmp_path):
    """No process group: memory steps, every 2nd persisted; a persist that fails keeps the step in
    memory; a restart takes memory, then storage once the memory is gone."""
    memory = tempfile.mkdtemp(prefix="ckpt-tier-", dir=shm.SHM_DIR)
    try:
        root = tmp_path / "run"
        w = torch.zeros(64, 8)
        mgr = cp.CheckpointManager(root, memory_every=1, persist_every=2, memory_dir=memory)
        for step in (1, 2, 3):
            w.fill_(step)
            mgr.save_async(step, {"w": w, "step": step}).wait()
        assert mgr.steps() == [2] and sorted(os.listdir(memory)) == ["step_3"]
        with open(root / "telemetry.jsonl") as f:  # the persisted step is in the run's history
            assert [json.loads(line)["step"] for line in f] == [2]
        (tmp_path / "blocked").write_text("a file where the next step's directory would go")
        blocked = cp.CheckpointManager(tmp_path / "blocked" / "run", memory_every=1, persist_every=2,
                                       memory_dir=memory)
        w.fill_(4)
        with pytest.raises(cp.SaveError, match="persisting memory step 4 to .* failed: rank 0: "
                                               "(NotADirectoryError|FileExistsError)"):
            blocked.save_async(4, {"w": w, "step": 4}).wait()
        assert sorted(os.listdir(memory)) == ["step_4"]  # in memory all the same
        got = {"w": torch.zeros(64, 8), "step": None}
        result = cp.CheckpointManager(root, memory_every=1, memory_dir=memory).load(got)
        assert (result.step, result.source, got["step"]) == (4, "memory", 4) and torch.equal(got["w"], w)
        shutil.rmtree(memory)
        result = cp.CheckpointManager(root, memory_every=1, memory_dir=memory).load(got)
        assert (result.step, result.source, got["step"]) == (2, "storage", 2) and bool((got["w"] == 2).all())
        os.makedirs(os.path.join(memory, "step_9", "data"))  # a save that never committed
        with open(os.path.join(memory, "step_9", "data", "r0-0.bin"), "wb") as f:
            f.write(b"partial")
        with pytest.raises(cp.NotACheckpointError, match="nothing to recover: step 9: no surviving host has"):
            cp.CheckpointManager(tmp_path / "empty", memory_every=1, memory_dir=memory).load(got)
        assert os.listdir(memory) == []  # dropped: the run starts afresh
    finally:
        shutil.rmtree(memory, ignore_errors=True)


# ------------------------------------------------------------------ pure


def test_replicas_go_to_the_next_host():
    hosts = Hosts(("a", "a", "b", "b", "c"))
    assert [hosts.replica_of(r) for r in range(5)] == [2, 3, 4, 4, 0]
    assert hosts.replicas_for(4) == [2, 3] and hosts.replicas_for(1) == []
    assert Hosts(("a", "a")).replica_of(0) is None
    assert [r for r in range(5) if hosts.leader(r)] == [0, 2, 4]


def test_recovery_takes_the_newest_step_complete_on_the_survivors():
    meta = "metadata.json"
    need = {"data/r0-0.bin": 10, "data/r1-0.bin": 20}

    def step(files, committed=True):
        return StepFiles(present={**files, **({meta: 5} if committed else {})},
                         required=dict(need) if committed else None)

    hosts = Hosts(("a", "b"))
    a = {5: step({"data/r0-0.bin": 10, "data/r1-0.bin": 20}), 6: step({"data/r0-0.bin": 10}),
         7: step({"data/r0-0.bin": 10, "data/r1-0.bin": 20}, committed=False)}
    b = {6: step({"data/r1-0.bin": 19})}  # truncated
    choice = choose(hosts, [HostReport(a, 4), HostReport(b, None)], meta)
    assert (choice.step, choice.source) == (5, "memory") and choice.holders["data/r1-0.bin"] == (0,)
    assert "step 7: no surviving host has its metadata" in choice.why and "step 6: 1 of its 3 files" in choice.why
    b[6] = step({"data/r1-0.bin": 20})
    assert choose(hosts, [HostReport(a, 4), HostReport(b, None)], meta).step == 6
    assert choose(hosts, [HostReport(a, 8), HostReport(b, None)], meta).source == "storage"  # durable is newer
    assert choose(Hosts(("a",)), [HostReport({}, None)], meta).step is None


def test_an_item_no_needer_can_read_is_read_by_a_rank_that_can():
    from ckpt_plugins._src.read_once import RankReads, ReadRequest, assign_transfers
    from ckpt_plugins._src.runs import run_groups
    assign = lambda requests, **kw: assign_transfers(  # noqa: E731
        RankReads.joined([RankReads.of(r, {"data/r2-0.bin": 0}) for r in requests]),
        run_groups(None, [len(r) for r in requests]), ["data/r2-0.bin"], **kw)
    box = ((0,), (4,))
    requests = [[], [ReadRequest("data/r2-0.bin", 0, 0, 16, (box,))]]
    transfer = assign(requests, readers=lambda f: (0,)).transfers[("data/r2-0.bin", 0)]
    assert (transfer.reader, transfer.needers, transfer.wants) == (0, (1,), ((box,),))
    assert assign(requests).transfers == {}  # any rank can read it: its needer does
    with pytest.raises(cp.LoadMismatchError, match="no rank of this job can read it"):
        assign(requests, readers=lambda f: ())
