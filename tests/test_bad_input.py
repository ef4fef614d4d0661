"""Bad checkpoints and bad requests: each gets a clear error, and no live tensor is touched."""
import errno
import json
import os
from dataclasses import replace

import pytest
import torch
from torch import nn

import ckpt_plugins as cp
from ckpt_plugins._src.metadata_codec import decode_metadata, encode_metadata
from ckpt_plugins._src.storage import LocalStorage
from distributed import run_ranks


def model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 300), nn.Linear(300, 4))


@pytest.fixture
def ckpt(tmp_path):
    path = tmp_path / "ckpt"
    cp.save(path, {"model": model()})
    return path


def meta_json(path):
    return json.loads((path / "metadata.json").read_text())


def write_json(path, raw):
    (path / "metadata.json").write_text(json.dumps(raw))


def read_meta(path):
    return decode_metadata((path / "metadata.json").read_bytes())


def write_meta(path, meta):
    """`meta` as the metadata file, unchecked (what a buggy or hostile writer could leave)."""
    (path / "metadata.json").write_bytes(encode_metadata(meta))


def untouched_load(path, error, match):
    """The load fails with `error` matching `match`, and the destination keeps its values."""
    m = model(seed=1)
    before = [t.clone() for t in m.state_dict().values()]
    with pytest.raises(error, match=match):
        cp.load(path, {"model": m})
    assert all(torch.equal(a, b) for a, b in zip(before, m.state_dict().values()))


def test_missing_metadata_is_an_incomplete_checkpoint(ckpt):
    os.remove(ckpt / "metadata.json")
    untouched_load(ckpt, cp.IncompleteCheckpointError, "never committed")


def test_flipped_byte_names_key_and_file(ckpt):
    box = read_meta(ckpt).tensors["model/0.weight"].boxes[0]
    with open(ckpt / box.file, "r+b") as f:
        f.seek(box.offset + 5)
        byte = f.read(1)
        f.seek(box.offset + 5)
        f.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(cp.CorruptCheckpointError, match=rf"model/0\.weight: file {box.file}"):
        cp.load(ckpt, {"model": model(1)})


def test_truncated_data_file(ckpt):
    name = sorted(read_meta(ckpt).files)[0]
    size = os.path.getsize(ckpt / name)
    os.truncate(ckpt / name, size - 3)
    untouched_load(ckpt, cp.CorruptCheckpointError, f"{name} of .* is truncated")


@pytest.mark.parametrize("bad", ["../outside.bin", "/etc/passwd", "data/../../x.bin", "data\\..\\x"])
def test_metadata_paths_must_stay_inside(ckpt, bad):
    meta = read_meta(ckpt)
    name = meta.tensors["model/0.weight"].boxes[0].file
    meta.files[bad] = meta.files.pop(name)
    for box in (b for t in meta.tensors.values() for b in t.boxes if b.file == name):
        box.file = bad
    write_meta(ckpt, meta)
    untouched_load(ckpt, cp.UnsafePathError, "not a plain relative path inside the checkpoint")


def test_symlink_escape_is_refused(ckpt, tmp_path):
    name = sorted(read_meta(ckpt).files)[0]
    outside = tmp_path / "outside.bin"
    os.rename(ckpt / name, outside)
    os.symlink(outside, ckpt / name)
    untouched_load(ckpt, cp.UnsafePathError, "outside checkpoint")


def test_shape_mismatch_names_key_and_shapes(ckpt):
    m = nn.Sequential(nn.Linear(8, 300), nn.Linear(300, 5))
    before = m[0].weight.clone()
    with pytest.raises(cp.LoadMismatchError, match=r"model/1\.weight: checkpoint holds shape \[4, 300\], "
                                                   r"the model wants \[5, 300\]"):
        cp.load(ckpt, {"model": m})
    assert torch.equal(m[0].weight, before)


def test_dtype_mismatch(ckpt):
    untouched = model(1).to(torch.bfloat16)
    with pytest.raises(cp.LoadMismatchError, match=r"model/0\.weight: the model wants bfloat16, but the checkpoint "
                                                   r"holds no bfloat16 copy \(model/0\.weight is float32\)"):
        cp.load(ckpt, {"model": untouched})


def test_newer_format_version(ckpt):
    raw = meta_json(ckpt)
    raw["version"] = 99
    write_json(ckpt, raw)
    untouched_load(ckpt, cp.MetadataError, "version 99 is newer .* upgrade ckpt_plugins")


def test_uncovered_region_names_key_and_region(ckpt):
    meta = read_meta(ckpt)
    box = meta.tensors["model/0.weight"].boxes[0]
    box.lengths, box.nbytes = (100, 8), 100 * 8 * 4
    write_meta(ckpt, meta)
    untouched_load(ckpt, cp.LoadMismatchError,
                   r"model/0\.weight: no stored box covers region offsets \[100, 0\] lengths \[200, 8\]")


@pytest.mark.parametrize("setup,error,match", [
    ("missing", cp.NotACheckpointError, "is not a checkpoint ckpt_plugins reads"),
    ("empty", cp.NotACheckpointError, "is not a checkpoint ckpt_plugins reads"),
    ("foreign", cp.MetadataError, "not a ckpt_plugins checkpoint's"),
    ("garbage", cp.MetadataError, "not valid JSON"),
    ("a file", cp.NotACheckpointError, "is not a checkpoint ckpt_plugins reads"),
])
def test_not_a_checkpoint(tmp_path, setup, error, match):
    path = tmp_path / "x"
    if setup == "empty":
        path.mkdir()
    elif setup in ("foreign", "garbage"):
        path.mkdir()
        (path / "metadata.json").write_text('{"weight_map": {}}' if setup == "foreign" else "\x00{{")
    elif setup == "a file":
        path.write_text("hello")
    untouched_load(path, error, match)


class FailingStorage(LocalStorage):
    def open_writer(self, name):
        raise OSError(28, "No space left on device")


def failing_write_worker(rank, world, path):
    storage = FailingStorage(path) if rank == 1 else LocalStorage(path)
    with pytest.raises(cp.SaveError, match=r"rank 1: OSError: .*No space left on device "
                                           r"\(writing data/r1-0.bin"):
        cp.Checkpointer(threads=1).save(storage, {"model": model()})
    assert not os.path.exists(os.path.join(path, "metadata.json"))


def test_a_failed_write_on_one_rank_commits_nothing_and_fails_every_rank(tmp_path):
    run_ranks(2, failing_write_worker, str(tmp_path / "c"))
    with pytest.raises(cp.IncompleteCheckpointError):
        cp.read_metadata(tmp_path / "c")


def test_a_failed_load_leaves_no_optimizer_state_behind(tmp_path):
    m = model()
    opt = torch.optim.AdamW(m.parameters())
    m(torch.ones(2, 8)).sum().backward()
    opt.step()
    cp.save(tmp_path / "c", {"model": m, "optim": opt})
    with open(tmp_path / "c" / "data" / "r0-0.bin", "r+b") as f:  # corrupt data: found only while reading
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    fresh = model(seed=1)
    fresh_opt = torch.optim.AdamW(fresh.parameters())
    with pytest.raises(cp.CorruptCheckpointError, match="checksum mismatch"):
        cp.load(tmp_path / "c", {"model": fresh, "optim": fresh_opt})
    assert not fresh_opt.state  # the moments it had allocated are gone: no half-filled state
    wrong = nn.Sequential(nn.Linear(8, 300), nn.Linear(300, 5))
    wrong_opt = torch.optim.AdamW(wrong.parameters())
    with pytest.raises(cp.LoadMismatchError, match="shape"):
        cp.load(tmp_path / "c", {"model": wrong, "optim": wrong_opt})
    assert not wrong_opt.state


def test_big_aligned_reads_bypass_the_page_cache_and_truncation_is_still_named(tmp_path, monkeypatch):
    from ckpt_plugins._src.hostmem import DIRECT_MIN, aligned_empty
    body = DIRECT_MIN + 3 * 4096
    data = os.urandom(body + 100)
    (tmp_path / "f.bin").write_bytes(data)
    storage, direct, read = LocalStorage(str(tmp_path)), [], LocalStorage._direct_read
    monkeypatch.setattr(LocalStorage, "_direct_read",
                        staticmethod(lambda path, offset, view: direct.append((offset, len(view))) or read(path, offset, view)))
    buffer = aligned_empty(len(data))[:len(data)]
    storage.read_into("f.bin", 0, memoryview(buffer.numpy()))
    assert bytes(buffer.numpy()) == data and direct == [(0, body)]  # the aligned body; the tail buffered
    direct.clear()
    # an unaligned address or file offset, or an aligned range under DIRECT_MIN (the page cache's
    # to keep): buffered only
    for offset, at, n in ((4096, 1, DIRECT_MIN), (100, 0, DIRECT_MIN), (4096, 0, 3 * 4096)):
        out = aligned_empty(n + 4096)[at:at + n]
        storage.read_into("f.bin", offset, memoryview(out.numpy()))
        assert bytes(out.numpy()) == data[offset:offset + n] and not direct
    with pytest.raises(cp.CorruptCheckpointError,
                       match=rf"f\.bin is truncated: wanted bytes 0\.\.{body + 4096}, file ends at {body + 100}"):
        storage.read_into("f.bin", 0, memoryview(aligned_empty(body + 4096).numpy()))


def test_shared_memory_segments_are_only_ours():
    from ckpt_plugins._src import shm
    for path in ("/etc/passwd", "/dev/shm/../etc/passwd", "/dev/shm/other-1-0123456789abcdef", "/tmp/ckpt_plugins-1-0123456789abcdef"):
        with pytest.raises(ValueError, match="not a ckpt_plugins shared-memory segment"):
            shm.Segment.attach(path)


def test_a_full_shared_memory_directory_leaves_each_rank_to_read_the_metadata_itself(ckpt, tmp_path, monkeypatch):
    """The copy of the metadata a load leaves for the host's other ranks has no room: the load goes
    on, reading from storage, and leaves nothing behind."""
    from ckpt_plugins._src import host_share, shm
    monkeypatch.setenv(shm.SHM_DIR_ENV, str(tmp_path / "shm"))
    os.makedirs(tmp_path / "shm")

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(host_share.os, "replace", full)
    m = model(seed=1)
    cp.load(ckpt, {"model": m})
    assert all(torch.equal(a, b) for a, b in zip(model().state_dict().values(), m.state_dict().values()))
    assert os.listdir(tmp_path / "shm") == []


def test_a_full_disk_found_when_a_file_is_flushed_is_the_error_reported(tmp_path, monkeypatch):
    """A full disk often shows only at fsync, after every write went through: that error is the
    one the save raises (the file is not closed twice), and nothing is committed."""
    real, failed = os.fsync, []

    def fsync(fd):
        if not failed and "/data/" in os.readlink(f"/proc/self/fd/{fd}"):
            failed.append(fd)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(cp.SaveError, match=r"rank 0: OSError: \[Errno 28\] No space left on device"):
        cp.Checkpointer(threads=1).save(tmp_path / "c", {"model": model()})
    monkeypatch.undo()
    assert failed
    with pytest.raises(cp.IncompleteCheckpointError):
        cp.read_metadata(tmp_path / "c")


def test_a_full_disk_is_the_error_reported_when_the_flush_after_it_fails_too(tmp_path, monkeypatch):
    """A write that finds the disk full, then a failing fsync as the file is closed: the full disk
    is the error reported, by the offline writer (`bcp import-*`) and by a memory step's persist,
    and nothing is committed."""
    import shutil
    import tempfile
    from ckpt_plugins._src import shm
    from ckpt_plugins.ext import LazyFragment, write_checkpoint
    real_pwrite, real_fsync, target = os.pwrite, os.fsync, str(tmp_path / "full")

    def on_target(fd):
        return os.readlink(f"/proc/self/fd/{fd}").startswith(target)

    def pwrite(fd, data, offset):
        if on_target(fd):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwrite(fd, data, offset)

    def fsync(fd):
        if on_target(fd):
            raise OSError(errno.EIO, "Input/output error")
        return real_fsync(fd)

    w = torch.arange(4096, dtype=torch.float32).reshape(64, 64)
    memory = tempfile.mkdtemp(prefix="ckpt-tier-", dir=shm.SHM_DIR)
    try:
        mgr = cp.CheckpointManager(tmp_path / "full" / "run", memory_every=1, persist_every=2, memory_dir=memory)
        mgr.save_async(1, {"w": w}).wait()
        monkeypatch.setattr(os, "pwrite", pwrite)
        monkeypatch.setattr(os, "fsync", fsync)
        with pytest.raises(OSError, match=r"\[Errno 28\] No space left on device"):
            write_checkpoint(tmp_path / "full" / "offline", [LazyFragment("w", w.shape, w.dtype, (0, 0), w.shape,
                                                                          lambda: w)])
        with pytest.raises(cp.SaveError, match=r"rank 0: OSError: \[Errno 28\] No space left on device"):
            mgr.save_async(2, {"w": w + 1}).wait()
        monkeypatch.undo()
        for path in ("offline", "run/step_2"):
            with pytest.raises((cp.IncompleteCheckpointError, cp.NotACheckpointError)):
                cp.read_metadata(tmp_path / "full" / path)
    finally:
        shutil.rmtree(memory, ignore_errors=True)


def test_a_partitions_optimizer_state_that_is_not_one_is_refused_naming_its_key():
    """State saved per rank with its flat partition (bitsandbytes' absmax under ZeRO or FSDP1) comes
    back as a {'partition', 'value'} object: anything else a checkpoint holds there is refused
    naming the key, and a partition of other pieces, as not the one saved."""
    from ckpt_plugins._src.fragment import FlatPiece
    from ckpt_plugins._src.format import Metadata, ObjectMeta
    from ckpt_plugins._src.state import OptimizerHandler, flat_layout
    flat = nn.Parameter(torch.zeros(8))
    opt = torch.optim.Adam([flat])
    pieces = [FlatPiece("a", (4,), 0, 4, 0), FlatPiece("b", (4,), 4, 4, 0)]
    layout = flat_layout(("a", "b"), ((4,), (4,)), pieces)
    at = ObjectMeta(file="data/r0-objects.bin", offset=0, nbytes=1, crc32c=[0], encoding="torch", rank=0)
    metadata = Metadata(tensors={}, objects={"optim/a/absmax1": [at], "optim/param_groups": [replace(at, rank=None)]},
                        files={"data/r0-objects.bin": 1}, world_size=2)
    put = OptimizerHandler(opt, {id(flat): layout}).load_items("optim", metadata).per_rank["optim/a/absmax1"]
    for bad in ([1, 2], {"partition": [list(p) for p in layout.partition], "value": [0.5]}):
        with pytest.raises(cp.LoadMismatchError, match="optim/a/absmax1 holds .*, not a partition's state"):
            put(bad)
    with pytest.raises(cp.LoadMismatchError, match="optim/a/absmax1 is optimizer state of one rank's partition.*"
                                                   "this rank's partition is not the one saved"):
        put({"partition": [["a", 0, 8, 0]], "value": torch.ones(1)})
    put({"partition": [list(p) for p in layout.partition], "value": torch.ones(1)})
    assert torch.equal(opt.state[flat]["absmax1"], torch.ones(1))
