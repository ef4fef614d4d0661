"""Things that really break: a rank SIGKILLed mid-write, a full disk, two jobs saving to one path, a
save overwriting a checkpoint that another job is loading; plus the checkpoint manager."""
import multiprocessing as mp
import os
import resource
import signal
import subprocess
import sys
import time

import pytest
import torch
from torch import nn

import ckpt_plugins as cp
from bcp_cli import bcp
from ckpt_plugins._src import lock
from ckpt_plugins._src.manager import CheckpointManager
from ckpt_plugins._src.storage import LocalStorage
from distributed import run_ranks



def linear(seed):
    torch.manual_seed(seed)
    return nn.Linear(512, 512)


def test_manager_latest_retention_listing_and_failed_saves(tmp_path):
    manager = CheckpointManager(tmp_path / "run", keep_last=2)
    assert manager.latest() is None and manager.steps() == []
    for step in range(1, 5):
        manager.save(step, {"model": linear(step)})
    assert manager.steps() == [3, 4] and manager.latest() == 4
    model = linear(0)
    manager.load({"model": model})
    assert torch.equal(model.weight, linear(4).weight)
    manager.load({"model": model}, step=3)
    assert torch.equal(model.weight, linear(3).weight)

    # a save that fails before its commit leaves `latest` and every committed step alone
    with pytest.raises(cp.SaveError):
        manager.save(5, {"model": linear(5), "bad": lambda: None})
    assert manager.latest() == 4 and manager.steps() == [3, 4]
    # the newest committed checkpoint is never removed, even with keep_last=1
    tight = CheckpointManager(tmp_path / "run", keep_last=1)
    tight.save(6, {"model": linear(6)})
    assert tight.steps() == [6] and tight.latest() == 6
    with pytest.raises(ValueError):
        CheckpointManager(tmp_path / "run", keep_last=0)


def crash_worker(rank, world, root, ref_path):
    from faults import FaultyStorage
    manager = CheckpointManager(f"faulty://{root}")
    model = linear(0)
    manager.save(1, {"model": model})
    if rank == 0:
        torch.save(model.state_dict(), ref_path)
    with torch.no_grad():
        model.weight.add_(1.0)
    if rank == 1:  # this rank dies with SIGKILL in the middle of writing its data file
        def write_then_die(writer, data):
            writer.write(memoryview(data)[:len(memoryview(data)) // 2])
            os.kill(os.getpid(), signal.SIGKILL)
        FaultyStorage.FAULTS["write"] = write_then_die
    manager.save(2, {"model": model, "rng": cp.RNGState()})  # per-rank objects: every rank writes


def test_a_rank_killed_mid_write_leaves_the_previous_checkpoint_latest(tmp_path):
    root, ref = str(tmp_path / "run"), str(tmp_path / "ref.pt")
    with pytest.raises(Exception, match="SIGKILL|signal"):
        run_ranks(2, crash_worker, root, ref)
    os.makedirs(os.path.join(root, "notes"))  # not a checkpoint: cleanup must leave it
    manager = CheckpointManager(root)
    assert manager.latest() == 1 and manager.steps() == [1] and manager.incomplete() == ["step_2"]
    model = linear(5)
    manager.load({"model": model})
    assert all(torch.equal(model.state_dict()[k], v) for k, v in torch.load(ref).items())

    out = bcp("inspect", os.path.join(root, "step_2"), check=False)
    assert out.returncode == 2 and "INCOMPLETE" in out.stdout
    out = bcp("list", root)
    assert "step_1  (latest)" in out.stdout and "step_2  INCOMPLETE" in out.stdout
    out = bcp("cleanup", root)
    assert out.returncode == 0 and "removed step_2" in out.stdout, out.stderr
    assert sorted(os.listdir(root)) == ["latest", "notes", "step_1", "telemetry.jsonl"]


def disk_full_worker(rank, world, path):
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
    resource.setrlimit(resource.RLIMIT_FSIZE, (256 << 10, 256 << 10))
    torch.manual_seed(rank)
    state = {"model": nn.Linear(1024, 1024)}  # 4 MiB: each rank writes about 2 MiB
    t = time.time()
    with pytest.raises(cp.SaveError, match="File too large") as err:
        cp.save(path, state)
    assert time.time() - t < 60
    assert "Nothing was committed" in str(err.value) and ".bin" in str(err.value)  # the rank's file named
    assert not os.path.exists(os.path.join(path, "metadata.json"))


def test_disk_full_fails_every_rank_and_commits_nothing(tmp_path):
    run_ranks(2, disk_full_worker, str(tmp_path / "ckpt"))
    with pytest.raises(cp.IncompleteCheckpointError):
        cp.read_metadata(tmp_path / "ckpt")


def _job(path, seed, start_at, result_file):
    torch.manual_seed(seed)
    state = {"w": torch.randn(2 << 20)}  # 8 MiB
    while time.time() < start_at:
        pass
    try:
        cp.save(path, state)
        outcome = f"committed {seed}"
    except cp.SaveError as exc:
        outcome = f"failed {exc}"
    with open(result_file, "w") as f:
        f.write(outcome)


def test_two_jobs_saving_to_one_path_one_wins_the_other_fails_clearly(tmp_path):
    path = str(tmp_path / "ckpt")
    ctx = mp.get_context("spawn")
    start_at = time.time() + 5  # both import first, then start together
    jobs = [ctx.Process(target=_job, args=(path, seed, start_at, str(tmp_path / f"job{seed}"))) for seed in (1, 2)]
    for job in jobs:
        job.start()
    for job in jobs:
        job.join(120)
    outcomes = [open(tmp_path / f"job{seed}").read() for seed in (1, 2)]
    winners = [o for o in outcomes if o.startswith("committed")]
    assert len(winners) == 1, outcomes
    loser = next(o for o in outcomes if o.startswith("failed"))
    assert "being written by another save" in loser or "already holds a committed checkpoint" in loser, loser
    torch.manual_seed(int(winners[0].split()[1]))
    out = {"w": torch.zeros(2 << 20)}
    cp.load(path, out)
    assert torch.equal(out["w"], torch.randn(2 << 20))
    assert not os.path.exists(os.path.join(path, lock.LOCK_FILE))


def test_a_live_lock_refuses_and_a_dead_one_is_taken_over(tmp_path):
    path = tmp_path / "ckpt"
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.makedirs(path)
        (path / lock.LOCK_FILE).write_text(f'{{"host": "{os.uname().nodename}", "pid": {holder.pid}, "since": 0}}')
        with pytest.raises(cp.SaveError, match=f"pid {holder.pid}"):
            cp.save(path, {"w": torch.ones(3)})
    finally:
        holder.kill()
        holder.wait()
    cp.save(path, {"w": torch.ones(3)})  # its owner is gone: the lock is stale
    assert not (path / lock.LOCK_FILE).exists()


def _reader(path, n, result_file):
    outcomes = []
    for _ in range(n):
        out = {"w": torch.zeros(1 << 20)}
        try:
            cp.load(path, out)
            outcomes.append(str(int(out["w"][0].item())) if torch.all(out["w"] == out["w"][0]) else "mixed")
        except cp.CheckpointError as exc:
            outcomes.append(type(exc).__name__)
    with open(result_file, "w") as f:
        f.write(" ".join(outcomes))


def test_overwriting_a_checkpoint_while_it_is_loaded_corrupts_neither(tmp_path):
    path = str(tmp_path / "ckpt")
    cp.save(path, {"w": torch.full((1 << 20,), 0.0)})
    reader = mp.get_context("spawn").Process(target=_reader, args=(path, 40, str(tmp_path / "reads")))
    reader.start()
    for value in range(1, 30):
        cp.save(path, {"w": torch.full((1 << 20,), float(value))}, overwrite=True)
    reader.join(120)
    outcomes = open(tmp_path / "reads").read().split()
    # each load got one whole checkpoint's values, or a clear error (the checkpoint changed under it)
    assert "mixed" not in outcomes and len(outcomes) == 40
    assert all(o.isdigit() or o.endswith("Error") for o in outcomes), outcomes
    out = {"w": torch.zeros(1 << 20)}
    cp.load(path, out)
    assert torch.all(out["w"] == 29.0)


class _FailingWrites(LocalStorage):
    """A directory whose data files fail to write (a full disk, say)."""

    def open_writer(self, name):
        raise OSError(28, "No space left on device", name)


def _overwriter(path, ready):
    """Overwrite `path` with a save whose writes never finish (killed meanwhile)."""

    class Stuck(LocalStorage):
        def open_writer(self, name):
            ready.set()
            time.sleep(600)

    cp.save(Stuck(path), {"w": torch.full((1 << 16,), 9.0)}, overwrite=True)


def test_an_overwritten_checkpoint_stays_loadable_until_its_replacement_commits(tmp_path):
    path = str(tmp_path / "ckpt")
    cp.save(path, {"w": torch.full((1 << 16,), 1.0)})

    def loads(value):
        out = {"w": torch.zeros(1 << 16)}
        cp.load(path, out)
        return torch.all(out["w"] == value).item()

    with pytest.raises(cp.SaveError, match="No space left"):  # fails mid-save: the old one stays whole
        cp.save(_FailingWrites(path), {"w": torch.full((1 << 16,), 2.0)}, overwrite=True)
    assert loads(1.0)
    ready = mp.get_context("spawn").Event()
    killed = mp.get_context("spawn").Process(target=_overwriter, args=(path, ready))
    killed.start()
    assert ready.wait(60)
    killed.kill()  # mid-write
    killed.join()
    assert loads(1.0)
    files = []
    for value in (3.0, 4.0, 5.0):  # each replacement commits, then the files it replaced go
        cp.save(path, {"w": torch.full((1 << 16,), value)}, overwrite=True)
        assert loads(value)
        files.append(sorted(os.listdir(os.path.join(path, "data"))))
    assert files[0] == files[2] and not set(files[0]) & set(files[1]), files
    assert sorted(cp.read_metadata(path).files) == [f"data/{f}" for f in files[2]]
