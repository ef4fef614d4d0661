"""Save under one layout, load under another, on real gloo process groups: bit-for-bit equality.

DTensor models (1-D and 2-D meshes, Shard(d) / Replicate()) with AdamW state, and ZeRO-style
flat partitions (uneven, across 2 and 3 ranks) through the core's packed-fragment helper.
"""
import math
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import ckpt_plugins as cp
from ckpt_plugins._src.fragment import packed_pieces, piece_fragments
from ckpt_plugins._src.state import Handler, LoadItems, SaveItems, root_handler
from distributed import run_ranks

SHAPES = {"emb": (11, 6), "w1": (6, 9), "w3": (3, 5, 4), "norm": (7,)}  # odd sizes: uneven shards


class Toy(nn.Module):
    def __init__(self, seed):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        for name, shape in SHAPES.items():
            self.register_parameter(name, nn.Parameter(torch.randn(shape, generator=g)))


def placements_for(spec, ndim):
    """spec: list of 'S0'/'S1'/'R' per mesh dim; a shard dim beyond the tensor's rank falls back."""
    return [Replicate() if p == "R" else Shard(min(int(p[1]), ndim - 1)) for p in spec]


def build(seed, mesh=None, spec=None):
    model = Toy(seed)
    if mesh is not None:
        for name, p in list(model.named_parameters()):
            setattr(model, name, nn.Parameter(distribute_tensor(p.data, mesh, placements_for(spec, p.dim()))))
    return model, torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1, betas=(0.8, 0.95))


def train(model, opt, steps=2):
    for step in range(steps):
        for i, (name, p) in enumerate(model.named_parameters()):
            g = torch.Generator().manual_seed(100 * step + i)
            grad = torch.randn(SHAPES[name], generator=g)
            p.grad = distribute_tensor(grad, p.device_mesh, p.placements) if isinstance(p, DTensor) else grad
        opt.step()


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t.detach().clone()


def full_state(model, opt):
    out = {f"p/{n}": full(p) for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        for k, v in opt.state[p].items():
            out[f"o/{n}/{k}"] = full(v)
    return out


def assert_same(ref, model, opt):
    got = full_state(model, opt)
    assert sorted(got) == sorted(ref)
    for k in ref:
        assert got[k].dtype == ref[k].dtype and torch.equal(got[k], ref[k]), k
    assert opt.param_groups[0]["betas"] == (0.8, 0.95) and opt.param_groups[0]["lr"] == 0.01


def mesh_for(world, spec):
    shape = (world,) if len(spec) == 1 else (2, world // 2)
    return init_device_mesh("cpu", shape)


def save_worker(rank, world, spec, path, ref_path):
    model, opt = build(seed=1, mesh=mesh_for(world, spec), spec=spec)
    train(model, opt)
    info = cp.save(path, {"model": model, "optim": opt}, layout={"mesh": spec})
    ref = full_state(model, opt)
    if rank == 0:
        torch.save(ref, ref_path)
        print(f"saved {path} from {world} ranks {spec}: balance {info.balance:.3f}")


def load_worker(rank, world, cases):
    for spec, path, ref_path in cases:
        model, opt = build(seed=2, mesh=mesh_for(world, spec), spec=spec)
        result = cp.load(path, {"model": model, "optim": opt}, verify=True)  # whatever the layout change
        assert_same(torch.load(ref_path), model, opt)
        assert result.verified_bytes == sum(f.nbytes for f in root_handler({"model": model, "optim": opt})
                                            .save_items("").fragments)


def two_hosts_load_worker(rank, world, cases, hosts_dir, opens_dir):
    """load_worker on 2 simulated hosts (ranks 0, 1 and 2, 3), through a storage that notes every
    read of the metadata file."""
    from faults import FaultyStorage
    from ckpt_plugins._src import shm
    host = "ab"[rank * 2 // world]
    os.environ[shm.HOST_ENV], os.environ[shm.SHM_DIR_ENV] = host, os.path.join(hosts_dir, host)
    os.makedirs(os.environ[shm.SHM_DIR_ENV], exist_ok=True)

    def note(name, offset=0):
        if name == "metadata.json":
            open(os.path.join(opens_dir, f"{host}-{rank}-{len(os.listdir(opens_dir))}"), "w").close()
    FaultyStorage.FAULTS.update(read_bytes=note, read_into=note)
    load_worker(rank, world, [(spec, f"faulty://{path}", ref) for spec, path, ref in cases])


def load_plain(path, ref_path):
    model, opt = build(seed=3)
    result = cp.load(path, {"model": model, "optim": opt}, verify=True)
    assert_same(torch.load(ref_path), model, opt)
    assert result.verified_bytes == sum(t.numel() * t.element_size() for t in torch.load(ref_path).values())
    return result


def test_dtensor_reshard_across_world_sizes_meshes_and_placements(tmp_path):
    a, b, c = (str(tmp_path / n) for n in "abc")
    refs = {n: str(tmp_path / f"{n}.ref") for n in "abc"}
    run_ranks(2, save_worker, ["S0"], a, refs["a"])  # 2 ranks, Shard(0)
    # 1 process, plain tensors
    model, opt = build(seed=1)
    train(model, opt)
    cp.save(b, {"model": model, "optim": opt})
    torch.save(full_state(model, opt), refs["b"])
    load_plain(a, refs["a"])  # 2 -> 1
    hosts, opens = tmp_path / "hosts", tmp_path / "opens"
    opens.mkdir()
    run_ranks(4, two_hosts_load_worker, [
        (["S1"], a, refs["a"]),  # 2 -> 4, Shard(0) -> Shard(1)
        (["S0"], b, refs["b"]),  # 1 -> 4
        (["S0", "S1"], a, refs["a"]),  # 1-D -> 2-D mesh
        (["R", "S0"], b, refs["b"]),
    ], str(hosts), str(opens))
    # 4 loads on 2 hosts: the metadata was opened once per host and load, by one of its ranks
    noted = sorted(n.split("-")[0] for n in os.listdir(opens))
    assert noted == ["a"] * 4 + ["b"] * 4, noted
    assert sorted(os.listdir(hosts / "a")) == sorted(os.listdir(hosts / "b")) == []  # nothing left behind
    run_ranks(4, save_worker, ["S1", "R"], c, refs["c"])  # 2-D mesh, 4 ranks
    run_ranks(2, load_worker, [(["S1"], c, refs["c"]), (["R"], c, refs["c"])])  # 4 -> 2
    load_plain(c, refs["c"])


# ------------------------------------------------------------- ZeRO-style flat partitions


class FlatPartition(Handler):
    """A simulated ZeRO-1 rank: every parameter packed (64-aligned), this rank owning 1/world.

    It stores weights and Adam moments straight from its flat partition, like a real adapter.
    """

    def __init__(self, rank, world, state=None):
        self.entries, offset = [], 0
        for name, shape in SHAPES.items():
            self.entries.append((name, shape, offset))
            offset += -(-math.prod(shape) // 64) * 64
        size = -(-offset // world)
        self.start = rank * size
        self.buffers = state or {k: torch.zeros(max(0, min(size, offset - self.start))) for k in
                                 ("param", "exp_avg", "exp_avg_sq")}

    def _frags(self, prefix):
        frags = []
        for kind, buf in self.buffers.items():
            entries = [(f"{prefix}/{n}" if kind == "param" else f"optim/{n}/{kind}", s, o)
                       for n, s, o in self.entries]
            frags += piece_fragments(packed_pieces(entries, self.start,
                                                   self.start + buf.numel()), buf)
        return frags

    def save_items(self, prefix):
        return SaveItems(fragments=self._frags(prefix))

    def load_items(self, prefix, metadata):
        return LoadItems(fragments=self._frags(prefix))


def flat_from_full(ref, rank, world):
    """The flat partition a ZeRO rank would hold for the reference state."""
    part = FlatPartition(rank, world)
    for kind, buf in part.buffers.items():
        packed = torch.zeros(part.start + buf.numel() + 4096)
        for name, shape, offset in part.entries:
            key = f"p/{name}" if kind == "param" else f"o/{name}/{kind}"
            packed[offset:offset + math.prod(shape)] = ref[key].reshape(-1)
        buf.copy_(packed[part.start:part.start + buf.numel()])
    return part


def flat_save_worker(rank, world, ref_path, path):
    part = flat_from_full(torch.load(ref_path), rank, world)
    cp.save(path, {"model": part})


def flat_load_worker(rank, world, ref_path, path):
    expect = flat_from_full(torch.load(ref_path), rank, world)
    part = FlatPartition(rank, world)
    result = cp.load(path, {"model": part}, strict=False, verify=True)  # steps are not part of a flat partition
    assert result.verified_bytes == sum(f.nbytes for f in part.save_items("model").fragments)
    for kind in part.buffers:
        assert torch.equal(part.buffers[kind], expect.buffers[kind]), kind


def test_flat_partitions_reshard_to_regular_shards_and_back(tmp_path):
    regular, ref = str(tmp_path / "regular"), str(tmp_path / "ref")
    model, opt = build(seed=5)
    train(model, opt)
    torch.save(full_state(model, opt), ref)
    cp.save(regular, {"model": model, "optim": opt})
    # regular -> flat partitions over 3 uneven ranks, and flat (3 ranks) -> flat (2 ranks)
    run_ranks(3, flat_load_worker, ref, regular)
    flat3 = str(tmp_path / "flat3")
    run_ranks(3, flat_save_worker, ref, flat3)
    run_ranks(2, flat_load_worker, ref, flat3)
    # flat partitions (2 ranks) -> a regular single-process model (a flat partition has no steps)
    flat2 = str(tmp_path / "flat2")
    run_ranks(2, flat_save_worker, ref, flat2)
    model2, opt2 = build(seed=9)
    result = cp.load(flat2, {"model": model2, "optim": opt2}, strict=False)
    assert result.missing_keys == ["optim/param_groups"]
    got, want = full_state(model2, opt2), torch.load(ref)
    for k in want:
        if not k.endswith("/step"):
            assert torch.equal(got[k], want[k]), k
    meta = cp.read_metadata(flat2)
    assert meta.world_size == 2 and meta.tensors["model/w3"].shape == (3, 5, 4)
    assert sum(b.nbytes for b in meta.tensors["model/w3"].boxes) == 60 * 4  # no padding stored


# ------------------------------------------------------------- replicated state, written once


def replicated_worker(rank, world, path):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64, bias=False) for _ in range(24)])
    info = cp.save(path, {"model": model})
    if rank == 0:
        print(f"replicated save over {world} ranks: byte balance max/mean = {info.balance:.3f}")
    assert info.balance < 1.25
    assert info.total_bytes == 24 * 64 * 64 * 4  # every replica written once
    from ckpt_plugins._src import loading
    results = []
    for inline in (loading.INLINE_READS, 0):  # 0: the digest-first exchange of the ranks' requests
        loading.INLINE_READS = inline
        fresh = nn.Sequential(*[nn.Linear(64, 64, bias=False) for _ in range(24)])
        results.append(cp.load(path, {"model": fresh}))
        assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
    read = [None] * world
    dist.all_gather_object(read, [r.read_bytes for r in results])
    assert [sum(r[i] for r in read) for i in range(2)] == [info.total_bytes] * 2  # each byte read once
    assert results[1].collectives == results[0].collectives + 1  # the runs, then each rank's share of the reads
    part = nn.Module()  # ranks 0 and 2 load the same layers (their keys sent once), 1 and 3 others, all
    for i in range(24):  # layer 4's: the keys no rank uses are left over
        if i % 6 in (rank % 2, 4):
            part.add_module(str(i), nn.Linear(64, 64, bias=False))
    result = cp.load(path, {"model": part}, strict=False)
    assert result.missing_keys == [] and result.unexpected_keys == sorted(f"model/{i}.weight" for i in range(24) if i % 6 in (2, 3, 5))
    assert all(torch.equal(p, model.get_submodule(name).weight) for name, p in
               ((n.split(".")[0], p) for n, p in part.named_parameters()))


def test_replicated_state_is_written_once_and_balanced(tmp_path, capsys):
    """Replicas' state is written once, balanced, and read once on load, whether the ranks send
    their whole read requests at once or their runs first."""
    path = str(tmp_path / "ddp")
    run_ranks(4, replicated_worker, path)
    meta = cp.read_metadata(path)
    assert all(len(t.boxes) == 1 for t in meta.tensors.values())
    writers = {t.boxes[0].file.split("-")[0] for t in meta.tensors.values()}
    assert writers == {"data/r0", "data/r1", "data/r2", "data/r3"}
    assert sum(os.path.getsize(os.path.join(path, f)) for f in meta.files) == 24 * 64 * 64 * 4


# ------------------------------------------------------------- read-once exchange, resharded

EVEN = {"a": (10, 8), "b": (7, 6), "c": (9,)}  # even column splits over 2 ranks


def even_model(seed, dim):
    """EVEN's parameters sharded on `dim` (1-D ones on dim 0) over every rank, with AdamW state."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    g = torch.Generator().manual_seed(seed)
    model = nn.Module()
    for name, shape in EVEN.items():
        full_value = torch.randn(shape, generator=g)
        model.register_parameter(name, nn.Parameter(distribute_tensor(full_value, mesh, [Shard(min(dim, len(shape) - 1))])))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for i, p in enumerate(model.parameters()):
        p.grad = distribute_tensor(torch.randn(p.shape, generator=g), mesh, p.placements)
    opt.step()
    return model, opt


def rows_to_columns_worker(rank, world, path, out_path, shared_memory):
    from ckpt_plugins._src import shm
    from ckpt_plugins._src.engine.ring import Ring
    if shared_memory == "full on rank 0" and rank == 0:  # /dev/shm has no room for this rank's ring
        def full(nbytes):
            raise OSError(28, "No space left on device")
        shm.Segment.create = full
    model, opt = even_model(seed=1, dim=0)
    cp.save(path, {"model": model, "optim": opt})
    want = full_state(model, opt)  # collective
    sent, rings, isend, init = [], [], dist.isend, Ring.__init__
    dist.isend = lambda tensor, *a, **k: (sent.append(tensor.numel() * tensor.element_size()), isend(tensor, *a, **k))[1]
    Ring.__init__ = lambda self, sizes, **kw: (init(self, sizes, **kw), rings.append(self.size))[0]
    model, opt = even_model(seed=2, dim=1)
    result = cp.Checkpointer(shared_memory=bool(shared_memory)).load(path, {"model": model, "optim": opt})
    got = full_state(model, opt)
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    out = [None] * world
    dist.all_gather_object(out, (sent, rings, result.read_bytes))
    if rank == 0:
        torch.save(out, out_path)


@pytest.mark.parametrize("shared_memory", [False, True, "full on rank 0"])
def test_resharded_read_once_sends_only_what_each_rank_wants(tmp_path, shared_memory):
    """Rows saved, columns loaded: every stored box is wanted half by each rank. One rank reads
    it; the other gets its half packed, straight into its tensor, or, sharing the reader's host,
    copies it out of the reader's shared memory, told where by one announcement for all its
    ranges, acknowledged once. A rank that cannot get shared memory sends over the group instead."""
    from ckpt_plugins._src import shm
    out = str(tmp_path / "out")
    ours = lambda: {f for f in os.listdir(shm.SHM_DIR) if f.startswith("ckpt_plugins-")}  # noqa: E731
    before = ours()
    run_ranks(2, rows_to_columns_worker, str(tmp_path / "ckpt"), out, shared_memory)
    ranks = torch.load(out)
    sent = [sum(r[0]) for r in ranks]
    two_d = sum(math.prod(s) for s in EVEN.values() if len(s) == 2) * 3 * 4  # weight, exp_avg, exp_avg_sq
    steps = len(EVEN) * 4  # AdamW's float32 step, stored once, wanted by both ranks
    transfers = 2 * 3 * 2 + len(EVEN)  # two row boxes of each 2-D tensor, and the steps
    print(f"rows -> columns on 2 ranks ({shared_memory}): sent {sent} bytes, rings {[r[1] for r in ranks]}")
    if shared_memory is True:  # each rank: one announcement and one acknowledgement, not two per transfer
        assert sorted(ranks[0][0]) == sorted(ranks[1][0]) == [8, shm.ANNOUNCE_BYTES] and transfers > 2
    elif shared_memory is False:
        assert sum(sent) == two_d // 2 + steps  # not the whole boxes (two_d)
        assert all(r[1][1] == 0 for r in ranks)  # no receive buffers: payloads land in the destination
    else:  # rank 0 sends payloads, rank 1 an announcement; rank 0 acknowledges it
        assert shm.ANNOUNCE_BYTES not in ranks[0][0] and 8 not in ranks[1][0]
        assert ranks[1][0] == [shm.ANNOUNCE_BYTES] and 8 in ranks[0][0]
    stored = sum(b.nbytes for t in cp.read_metadata(tmp_path / "ckpt").tensors.values() for b in t.boxes)
    assert sum(r[2] for r in ranks) == stored  # each byte read once
    assert ours() == before  # no segment outlives the load


def stage_objects_worker(rank, world, path):
    """Each rank holds objects of its own (a pipeline stage's optimizer steps, say)."""
    cp.save(path, {"stage": {f"layer{rank}": {"step": 10 + rank}}, "shared": {"lr": 0.5}})


def test_objects_only_some_ranks_hold_are_saved_once(tmp_path):
    run_ranks(2, stage_objects_worker, str(tmp_path / "c"))
    meta = cp.read_metadata(tmp_path / "c")
    assert sorted(meta.objects) == ["shared/lr", "stage/layer0/step", "stage/layer1/step"]
    assert all(len(v) == 1 for v in meta.objects.values())  # each written once
    back = {"stage": {"layer0": {"step": None}, "layer1": {"step": None}}, "shared": {"lr": None}}
    cp.load(tmp_path / "c", back)
    assert back == {"stage": {"layer0": {"step": 10}, "layer1": {"step": 11}}, "shared": {"lr": 0.5}}
