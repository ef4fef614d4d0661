"""Compressed and delta saves (format version 4): each tensor's chunks stored as zstd frames of
their bytes grouped by position, where that pays, or as XORs with the same chunks of an earlier
checkpoint; bit-exact loads, resharded ones reading only the chunks they touch; chains, their
bases and retention; tools and bad input."""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import ckpt_plugins as cp
from ckpt_plugins._src import codec
from ckpt_plugins._src.engine.pace import Pace, worth_compressing
from ckpt_plugins._src.format import CHUNK_BYTES
from ckpt_plugins.ext import LazyFragment, LoadItems, box_fragment, write_checkpoint
from distributed import run_ranks

BCP = os.path.join(os.path.dirname(sys.executable), "bcp")


def tensors():
    """Weights shaped like trained ones in every stored dtype, and bytes that do not compress."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(1100, 1024, generator=g) * 0.02  # 4.3 MB in fp32: five chunks, the last one partial
    return {"bf16": w.to(torch.bfloat16), "fp32": w, "fp8": w[:300].mul(20).to(torch.float8_e4m3fn),
            "int32": torch.arange(-300_000, 300_000, dtype=torch.int32).view(600, 1000),
            "random": torch.randint(0, 256, (1500, 1000), dtype=torch.uint8, generator=g),
            "tiny": torch.arange(6.0)}


def raw(t):
    return t.contiguous().view(torch.uint8)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("compressed") / "ckpt"
    cp.save(path, {"t": tensors(), "step": 3}, compress=True)
    return path


def test_each_tensor_is_compressed_where_it_pays_and_loads_bit_for_bit(saved):
    meta = cp.read_metadata(saved)
    assert meta.version == 5
    want = tensors()
    for key in ("bf16", "fp32", "fp8", "int32"):
        box, = meta.tensors[f"t/{key}"].boxes
        assert box.group == want[key].element_size() and len(box.packed) == -(-box.nbytes // CHUNK_BYTES), key
        assert box.stored_nbytes < box.nbytes, key
    for key in ("random", "tiny"):  # the first chunk does not shrink: stored as it is
        box, = meta.tensors[f"t/{key}"].boxes
        assert box.group == 0 and box.packed == [] and box.stored_nbytes == box.nbytes, key
    assert meta.tensors["t/bf16"].boxes[0].stored_nbytes < 0.8 * meta.tensors["t/bf16"].boxes[0].nbytes
    assert meta.total_bytes == sum(os.path.getsize(saved / f) for f in meta.files)
    got = {"t": {k: torch.zeros_like(v) for k, v in want.items()}, "step": 0}
    cp.load(saved, got)
    assert got["step"] == 3
    for key, value in want.items():
        assert torch.equal(raw(got["t"][key]), raw(value)), key


class Rows(cp.Handler):
    """Rows [first, first + len(target)) of a stored 2-D tensor."""

    def __init__(self, shape, first, target):
        self.shape, self.first, self.target = shape, first, target

    def save_items(self, prefix):
        raise AssertionError("only loaded")

    def load_items(self, prefix, metadata):
        return LoadItems(fragments=[box_fragment(prefix, self.shape, (self.first, 0), self.target)])


def test_a_few_rows_decompress_only_the_chunks_they_lie_in(saved, monkeypatch):
    from ckpt_plugins._src.engine import read
    seen = []
    unpack = codec.unpack
    monkeypatch.setattr(read, "unpack", lambda frame, n, group, where: (seen.append(n), unpack(frame, n, group, where))[1])
    want = tensors()["fp32"]
    rows_per_chunk = CHUNK_BYTES // (1024 * 4)
    for first, count, chunks in ((rows_per_chunk + 10, 5, 1), (rows_per_chunk - 2, 4, 2), (1096, 4, 1)):
        seen.clear()
        target = torch.zeros(count, 1024)
        cp.load(saved, {"t": {"fp32": Rows((1100, 1024), first, target)}}, strict=False)
        assert torch.equal(target, want[first:first + count]), first
        assert len(seen) == chunks, (first, seen)


def test_a_checkpoint_of_more_chunks_than_the_format_keeps_small_has_bigger_ones(tmp_path, monkeypatch):
    """Past `MAX_CHUNKS` chunks (2 TiB of 1 MiB ones), a checkpoint's chunks double until it has
    no more; here at 4: 14 MiB saves in 4 MiB chunks. Checksums, compressed boxes, a few rows'
    read, `bcp verify` and the offline writer all follow the recorded size; a delta on a base of
    other chunks stores everything."""
    from ckpt_plugins._src import format as fmt
    assert [fmt.chunk_bytes_for(n << 40) >> 20 for n in (1, 2, 3, 8, 9)] == [1, 1, 2, 4, 8]
    g = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(3072, 1024, generator=g),  # 12 MiB
             "b": (torch.randn(1024, 1024, generator=g) * 0.02).to(torch.bfloat16)}
    small = cp.Checkpointer(compress=True)  # a plan, with its chunk, holds while the state's structure does
    small.save(tmp_path / "small", state)
    small.close()
    monkeypatch.setattr(fmt, "MAX_CHUNKS", 4)
    big = cp.Checkpointer(compress=True)
    big.save(tmp_path / "big", state, delta_from=tmp_path / "small")
    meta = cp.read_metadata(tmp_path / "big")
    w, b = meta.tensors["w"].boxes[0], meta.tensors["b"].boxes[0]
    assert meta.chunk_bytes == 4 << 20 and meta.delta is None and not w.delta, meta.chunk_bytes
    assert len(w.crc32c) == 3 and len(b.crc32c) == 1 and b.group == 2 and len(b.packed) == 1
    got = {k: torch.zeros_like(v) for k, v in state.items()}
    cp.load(tmp_path / "big", got)
    assert all(torch.equal(got[k], state[k]) for k in state)
    rows = torch.zeros(4, 1024)
    result = cp.load(tmp_path / "big", {"w": Rows((3072, 1024), 1030, rows)}, strict=False)  # in chunk 2 of 3
    assert torch.equal(rows, state["w"][1030:1034]) and result.read_bytes == 4 << 20, result.read_bytes
    assert subprocess.run([BCP, "verify", tmp_path / "big"], capture_output=True, timeout=120).returncode == 0
    big.save(tmp_path / "delta", state, delta_from=tmp_path / "big")  # same chunks: a delta
    big.close()
    meta = cp.read_metadata(tmp_path / "delta")
    assert meta.delta is not None and meta.tensors["w"].boxes[0].packed == [0, 0, 0]
    cp.load(tmp_path / "delta", got)
    assert all(torch.equal(got[k], state[k]) for k in state)
    write_checkpoint(tmp_path / "offline", [LazyFragment(k, v.shape, v.dtype, (0,) * v.dim(), v.shape, lambda v=v: v)
                                            for k, v in state.items()])  # the offline writer (bcp import-*)
    assert cp.read_metadata(tmp_path / "offline").chunk_bytes == 4 << 20
    assert subprocess.run([BCP, "verify", tmp_path / "offline"], capture_output=True, timeout=120).returncode == 0


def test_tools_show_verify_and_diff_compressed_checkpoints(saved, tmp_path):
    out = subprocess.run([BCP, "inspect", saved], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "format v5" in out.stdout and "tensors compressed" in out.stdout
    line = next(ln for ln in out.stdout.splitlines() if "t/bf16" in ln)
    assert "stored in" in line
    info = json.loads(subprocess.run([BCP, "inspect", saved, "--json"], capture_output=True, text=True).stdout)
    assert info["tensors"]["t/bf16"]["stored_bytes"] < info["tensors"]["t/bf16"]["bytes"]
    assert info["tensors"]["t/bf16"]["boxes"][0]["compressed"] and not info["tensors"]["t/random"]["boxes"][0]["compressed"]
    out = subprocess.run([BCP, "verify", saved], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "all checksums match" in out.stdout
    # a plain save of the same state: diff reads both and finds them equal, then one element apart
    plain = tmp_path / "plain"
    state = tensors()
    cp.save(plain, {"t": state, "step": 3})
    assert cp.read_metadata(plain).tensors["t/bf16"].boxes[0].group == 0
    out = subprocess.run([BCP, "diff", saved, plain], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    state["bf16"][700, 3] += 1
    cp.save(tmp_path / "edited", {"t": state, "step": 3}, compress=True)
    report = cp.diff(saved, tmp_path / "edited")
    assert [(k.key, k.status, k.differing, k.first_index) for k in report.keys if k.status != "equal"] == [
        ("t/bf16", "different", 1, [700, 3])]


def test_a_corrupt_compressed_chunk_is_refused_naming_the_tensor(saved, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(saved, bad)
    box, = cp.read_metadata(bad).tensors["t/int32"].boxes
    with open(bad / box.file, "r+b") as f:  # inside the second chunk's frame
        f.seek(box.offset + box.packed[0] + box.packed[1] // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x5A]))
    with pytest.raises(cp.CorruptCheckpointError, match="t/int32"):
        cp.load(bad, {"t": {"int32": torch.zeros(600, 1000, dtype=torch.int32)}}, strict=False)
    out = subprocess.run([BCP, "verify", bad], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "t/int32" in out.stdout and "corrupt" in out.stdout


def reshard_worker(rank, world, path):
    mesh = init_device_mesh("cpu", (world,))
    want = tensors()
    state = {k: distribute_tensor(want[k], mesh, [Shard(0)]) for k in ("bf16", "fp32", "int32")}
    cp.save(path, {"t": state}, compress=True)
    got = {k: distribute_tensor(torch.zeros_like(want[k]), mesh, [Shard(1)]) for k in state}
    result = cp.load(path, {"t": got})
    for key, value in got.items():
        assert torch.equal(raw(value.full_tensor()), raw(want[key])), key
    out = [None] * world
    dist.all_gather_object(out, result.read_bytes)
    if rank == 0:
        meta = cp.read_metadata(path)
        boxes = [b for t in meta.tensors.values() for b in t.boxes]
        assert len(boxes) == 6 and all(b.group for b in boxes)
        assert sum(out) == sum(b.nbytes for b in boxes)  # each stored byte read once
    # a delta of the rows, on two ranks too, loaded as columns
    with torch.no_grad():
        state["fp32"].to_local()[5:8].mul_(1.5)
    cp.save(path + "-delta", {"t": state}, delta_from=path)
    got = {k: distribute_tensor(torch.zeros_like(want[k]), mesh, [Shard(1)]) for k in state}
    cp.load(path + "-delta", {"t": got})
    for key, value in got.items():
        assert torch.equal(raw(value.full_tensor()), raw(state[key].full_tensor())), key
    assert all(b.delta for t in cp.read_metadata(path + "-delta").tensors.values() for b in t.boxes)


def test_rows_saved_compressed_and_as_deltas_on_two_ranks_load_as_columns_reading_each_byte_once(tmp_path):
    run_ranks(2, reshard_worker, str(tmp_path / "ckpt"))
    got = {k: torch.zeros_like(v) for k, v in tensors().items() if k in ("bf16", "fp32", "int32")}
    cp.load(tmp_path / "ckpt", {"t": got})  # and whole, on one process
    for key, value in got.items():
        assert torch.equal(raw(value), raw(tensors()[key])), key


def test_without_zstandard_a_compressed_save_names_the_install(tmp_path):
    code = ("import sys; sys.modules['zstandard'] = None\n"
            "import torch, ckpt_plugins as cp\n"
            f"cp.save({str(tmp_path / 'c')!r}, {{'w': torch.zeros(1 << 20)}}, compress=True)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "pip install 'ckpt_plugins[zstd]'" in out.stderr, out.stderr


def test_a_compressed_checkpoint_exports_to_dcp_bit_for_bit(tmp_path):
    import torch.distributed.checkpoint as dcp
    torch.manual_seed(0)
    model = torch.nn.Linear(512, 512)
    cp.save(tmp_path / "c", {"model": model}, compress=True)
    assert cp.read_metadata(tmp_path / "c").tensors["model/weight"].boxes[0].group == 4
    out = subprocess.run([BCP, "export", tmp_path / "c", tmp_path / "dcp", "--format", "dcp"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = {"model.weight": torch.zeros(512, 512), "model.bias": torch.zeros(512)}
    dcp.load(got, checkpoint_id=str(tmp_path / "dcp"))
    assert torch.equal(got["model.weight"], model.weight) and torch.equal(got["model.bias"], model.bias)


def rl_steps(state, steps, seed=0):
    """What RL post-training does to bf16 weights between saves: a small update moves about a
    tenth of the elements by one or two bf16 steps; the int tensor never changes."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        w = state["bf16"].view(-1).view(torch.int16)
        moved = torch.rand(w.numel(), generator=g) < 0.02
        w[moved] += torch.randint(-2, 3, (int(moved.sum()),), generator=g, dtype=torch.int16)
        state["fp32"].add_(torch.randn(state["fp32"].shape, generator=g) * 1e-4)


def test_a_chain_of_deltas_loads_bit_for_bit_and_stores_only_what_changed(tmp_path, monkeypatch):
    state = {k: v for k, v in tensors().items() if k in ("bf16", "fp32", "int32")}
    cp.save(tmp_path / "s0", {"t": state}, compress=True)
    full = cp.read_metadata(tmp_path / "s0").tensors["t/bf16"].boxes[0].stored_nbytes
    saved = []
    for i in range(1, 7):
        rl_steps(state, 2, seed=i)
        cp.save(tmp_path / f"s{i}", {"t": state}, delta_from=tmp_path / f"s{i - 1}", max_chain=5)
        saved.append({k: v.clone() for k, v in state.items()})
    metas = [cp.read_metadata(tmp_path / f"s{i}") for i in range(1, 7)]
    assert [m.delta.depth if m.delta else 0 for m in metas] == [1, 2, 3, 4, 5, 0]  # the sixth starts anew
    assert metas[0].delta.path == "../s0" and metas[4].delta.path == "../s4"
    for m in metas[:5]:
        boxes = {k: t.boxes[0] for k, t in m.tensors.items()}
        assert all(b.delta for b in boxes.values())
        assert boxes["t/int32"].stored_nbytes == 0 and set(boxes["t/int32"].packed) == {0}  # unchanged
        assert boxes["t/bf16"].stored_nbytes * 3 < full  # a delta of about 4% of elements
    assert not any(b.delta for t in metas[5].tensors.values() for b in t.boxes)
    for i, want in enumerate(saved, 1):
        got = {k: torch.zeros_like(v) for k, v in want.items()}
        cp.load(tmp_path / f"s{i}", {"t": got})
        for key, value in want.items():
            assert torch.equal(raw(got[key]), raw(value)), (i, key)
    seen = []  # a few rows of the deepest delta: their chunk only, at every level of the chain
    unpack = codec.unpack
    from ckpt_plugins._src.engine import read
    monkeypatch.setattr(read, "unpack", lambda frame, n, group, where: (seen.append(where), unpack(frame, n, group, where))[1])
    target = torch.zeros(3, 1024)
    cp.load(tmp_path / "s5", {"t": {"fp32": Rows((1100, 1024), 700, target)}}, strict=False)
    assert torch.equal(target, saved[4]["fp32"][700:703])
    assert len(seen) == 6, seen  # s5's chunk, its bases' down to s0 (which stores it compressed)
    out = subprocess.run([BCP, "verify", tmp_path / "s5"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "all checksums match" in out.stdout, out.stdout + out.stderr
    out = subprocess.run([BCP, "inspect", tmp_path / "s5"], capture_output=True, text=True, timeout=120)
    assert "a delta against ../s4 (5 deep)" in out.stdout


def test_a_missing_or_changed_base_is_refused_naming_it(tmp_path):
    state = {"bf16": tensors()["bf16"]}
    cp.save(tmp_path / "s0", {"t": state})
    rl_steps({"bf16": state["bf16"], "fp32": torch.zeros(1)}, 1)
    cp.save(tmp_path / "s1", {"t": state}, delta_from=tmp_path / "s0")
    cp.save(tmp_path / "s2", {"t": state}, delta_from=tmp_path / "s1")
    got = {"t": {"bf16": torch.zeros_like(state["bf16"])}}
    shutil.move(tmp_path / "s0", tmp_path / "elsewhere")  # the chain's bottom, two below
    with pytest.raises(cp.CheckpointError, match=r"s1 was saved on the base checkpoint .*s0, which cannot be read"):
        cp.load(tmp_path / "s2", got)
    assert not got["t"]["bf16"].any()  # nothing loaded
    cp.save(tmp_path / "s0", {"t": {"bf16": torch.ones_like(state["bf16"])}})  # another checkpoint there
    with pytest.raises(cp.CheckpointError, match=r"s1 was saved on the base checkpoint .*s0, which has changed since"):
        cp.load(tmp_path / "s2", got)
    out = subprocess.run([BCP, "verify", tmp_path / "s2"], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "has changed since" in out.stderr
    with pytest.raises(cp.SaveError, match="delta_from names the checkpoint being saved"):
        cp.save(tmp_path / "s2", {"t": state}, delta_from=tmp_path / "s2", overwrite=True)
    assert cp.read_metadata(tmp_path / "s2").delta.path == "../s1"  # still the one committed


def test_retention_keeps_the_bases_a_kept_delta_needs(tmp_path):
    manager = cp.CheckpointManager(tmp_path / "run", keep_last=1)
    state = {"bf16": tensors()["bf16"]}
    manager.save(1, {"t": state})
    for step in (2, 3):
        rl_steps({"bf16": state["bf16"], "fp32": torch.zeros(1)}, 1, seed=step)
        manager.save(step, {"t": state}, delta_from=manager.path(step - 1))
    assert manager.steps() == [1, 2, 3]  # step 3 needs 2, which needs 1
    manager.save(4, {"t": state})  # stores everything: nothing below it is needed
    assert manager.steps() == [4]
    got = {"t": {"bf16": torch.zeros_like(state["bf16"])}}
    manager.load(got)
    assert torch.equal(got["t"]["bf16"], state["bf16"])


def test_the_pace_compresses_a_kind_only_while_that_shortens_the_commit(monkeypatch):
    """Storage's time per byte: each write counted its share of the time it was in flight; a
    kind's compression, per byte."""
    from ckpt_plugins._src.engine import pace as paced
    clock = [0.0]
    monkeypatch.setattr(paced.time, "perf_counter", lambda: clock[0])

    def write(nbytes, seconds, writers=1):  # `writers` writes of `nbytes` at once
        for w in range(writers):
            pace.writing(w)
        clock[0] += seconds
        for w in range(writers):
            pace.wrote(w, nbytes)

    kind = (2, 1)  # bf16, its top byte compressed
    pace = Pace(threads=2)
    assert pace.pays(kind) is False  # storage's pace unknown: as it is
    write(1 << 20, 0.001, writers=2)  # 2.1 GB/s, two writers sharing it
    assert pace.pays(kind) is False and pace.written.seconds == pytest.approx(0.001)  # too few bytes to trust
    write(3 << 20, 0.003, writers=2)
    assert pace.pays(kind) is None  # the kind not measured: compress one chunk to find out
    pace.compressed(kind, 1 << 20, 700_000, 0.002)  # 0.5 GB/s a thread, a third saved
    assert pace.pays(kind) is False and pace.pays((4, 1)) is None
    write(1 << 30, 1.07)  # 1 GB/s now: 0.95 + 0.67² / 0.95 ns a byte compressed, against 0.95 * 1 as it is
    assert pace.pays(kind) is False
    write(1 << 30, 7.6)  # 0.25 GB/s over both: 2.7 + 0.95² / 2.7 ns against 0.95 * 4
    assert pace.pays(kind) is True
    assert worth_compressing(0.2, 0.3, 2.0, threads=1) is True  # one writer: 0.2 + 1.4 < 0.95 * 2
    assert worth_compressing(1.0, 0.3, 1.5, threads=1) is False  # 1 + 1.05 > 0.95 * 1.5
    assert worth_compressing(1.0, 0.3, 1.5, threads=2) is True  # 1.05 + 0.5² / 1.05


def test_auto_compresses_onto_slow_storage_and_not_onto_fast_storage(tmp_path, monkeypatch):
    """compress="auto": onto storage that takes 40 MB/s (a rank's share of a busy shared
    filesystem), tensors are stored compressed once storage's pace is known (a piece of each file
    has gone out as it is); onto storage in memory, compressing never pays and every tensor is
    stored as it is. Both load bit for bit. A value other than True, False or "auto" is refused."""
    import faults
    g = torch.Generator().manual_seed(1)
    state = {f"w{i}": (torch.randn(1024, 2048, generator=g) * 0.02).to(torch.bfloat16) for i in range(8)}  # 32 MiB

    def slow(writer, data):
        writer.write(data)
        time.sleep(len(memoryview(data).cast("B")) / 40e6)

    monkeypatch.setitem(faults.FaultyStorage.FAULTS, "write", slow)
    cp.save(f"faulty://{tmp_path / 'slow'}", state, compress="auto")
    shm = tempfile.mkdtemp(dir="/dev/shm")
    try:
        cp.save(os.path.join(shm, "fast"), state, compress="auto")
        for path, compressed in ((tmp_path / "slow", True), (os.path.join(shm, "fast"), False)):
            meta = cp.read_metadata(path)
            boxes = [t.boxes[0] for t in meta.tensors.values()]
            if compressed:
                packed = [b for b in boxes if b.group]
                assert len(packed) >= 3 and all(b.group == 2 and b.stored_nbytes < 0.8 * b.nbytes for b in packed)
                assert sum(b.stored_nbytes for b in boxes) < 0.9 * sum(b.nbytes for b in boxes)
            else:
                assert all(b.group == 0 and b.stored_nbytes == b.nbytes for b in boxes), path
            got = {k: torch.zeros_like(v) for k, v in state.items()}
            cp.load(path, got)
            assert all(torch.equal(raw(got[k]), raw(v)) for k, v in state.items()), path
    finally:
        shutil.rmtree(shm)
    for bad in ("fast", 1, None):
        with pytest.raises(ValueError, match=r"compress must be True, False or 'auto', not"):
            cp.save(tmp_path / "bad", state, compress=bad)
    with pytest.raises(ValueError, match=r"compress must be True, False or 'auto', not 'yes'"):
        cp.Checkpointer(compress="yes")
    assert not os.path.exists(tmp_path / "bad")
