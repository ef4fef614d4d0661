"""Data-loader state that reshards, with real processes and torchdata's StatefulDataLoader over a
dataset of distinct sample ids: a DP=4 run saves mid-epoch, runs resume at DP=2, 3 and 6 (and with
another global batch, with workers and prefetch, with a sequence packer) and consume exactly what
the uninterrupted run did; a changed dataset is refused."""
import json
from collections import Counter

import pytest
import torch
import torch.distributed as dist

import ckpt_plugins as cp
from distributed import run_ranks

SAMPLES, GLOBAL_BATCH, SAVED_AT = 96, 12, 3


class Ids(torch.utils.data.Dataset):
    def __init__(self, n=SAMPLES):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.tensor(i)


class Documents(Ids):
    """Document i: 1 + i % 5 tokens, globally distinct (i * 100 + k)."""

    def __getitem__(self, i):
        return torch.arange(1 + i % 5) + i * 100


def loader(rank, world, per_rank, workers=0, dataset=None, seed=3):
    from torchdata.stateful_dataloader import StatefulDataLoader
    dataset = dataset or Ids()
    sampler = torch.utils.data.DistributedSampler(dataset, world, rank, shuffle=True, seed=seed)
    return StatefulDataLoader(dataset, batch_size=per_rank, sampler=sampler, num_workers=workers,
                              prefetch_factor=2 if workers else None,
                              collate_fn=list if isinstance(dataset, Documents) else None)


def global_batches(data):
    """Every step's samples over all ranks, as sorted lists (the loop a DP job runs)."""
    out = []
    for batch in data:
        everything = [None] * dist.get_world_size()
        dist.all_gather_object(everything, batch.tolist())
        out.append(sorted(i for part in everything for i in part))
    return out


def ids_worker(rank, world, root, role, per_rank, workers):
    data = cp.DataState(loader(rank, world, per_rank, workers))
    if role == "full":  # the uninterrupted run, saving after SAVED_AT steps
        out, it = [], iter(data)
        for step, batch in enumerate(it):
            everything = [None] * world
            dist.all_gather_object(everything, batch.tolist())
            out.append(sorted(i for part in everything for i in part))
            if step + 1 == SAVED_AT:
                cp.save(f"{root}/ckpt", {"data": data})
    else:
        cp.load(f"{root}/ckpt", {"data": data}, verify=True)  # a position dealt anew is not compared
        assert data.epoch == 0
        out = global_batches(data)
        data.set_epoch(1)  # the next epoch is a whole one again
        assert sorted(i for b in global_batches(data) for i in b) == list(range(SAMPLES))
    if rank == 0:
        with open(f"{root}/{role}.json", "w") as f:
            json.dump(out, f)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    run_ranks(4, ids_worker, str(root), "full", GLOBAL_BATCH // 4, 2)  # workers and prefetch
    with open(root / "full.json") as f:
        return root, json.load(f)


@pytest.mark.parametrize("world,workers", [(2, 2), (3, 0), (6, 0)])
def test_resumed_at_another_dp_size_the_global_batches_are_the_uninterrupted_runs(saved, world, workers):
    root, full = saved
    run_ranks(world, ids_worker, str(root), f"dp{world}", GLOBAL_BATCH // world, workers)
    with open(root / f"dp{world}.json") as f:
        resumed = json.load(f)
    assert len(full) == SAMPLES // GLOBAL_BATCH and resumed == full[SAVED_AT:]


def test_with_another_global_batch_the_epoch_is_consumed_exactly_once(saved):
    root, full = saved
    run_ranks(2, ids_worker, str(root), "gb4", 2, 0)  # global batch 4 instead of 12
    with open(root / "gb4.json") as f:
        resumed = json.load(f)
    consumed = Counter(i for b in full[:SAVED_AT] + resumed for i in b)
    assert consumed == Counter(range(SAMPLES))


def packing_worker(rank, world, root, role):
    packer = cp.TokenPacker(seq_len=4)
    data = cp.DataState(loader(rank, world, 2, dataset=Documents()), packer)
    tokens = []
    if role == "full":
        for step, batch in enumerate(data):
            tokens += batch.reshape(-1).tolist()
            if step + 1 == 6:  # every rank's packer then holds part of a document
                cp.save(f"{root}/packed", {"data": data})
                held = packer.pending().numel()
                break
    else:
        cp.load(f"{root}/packed", {"data": data})
        held = packer.pending().numel()
        for batch in data:
            tokens += batch.reshape(-1).tolist()
        tokens += packer.pending().tolist()  # the epoch's last partial row
    everything = [None] * world
    dist.all_gather_object(everything, {"tokens": tokens, "held": held})
    if rank == 0:
        with open(f"{root}/{role}.json", "w") as f:
            json.dump(everything, f)


def test_packed_sequences_resume_at_other_dp_sizes_with_every_token_once(tmp_path):
    run_ranks(4, packing_worker, str(tmp_path), "full")
    with open(tmp_path / "full.json") as f:
        before = json.load(f)
    assert all(r["held"] > 0 for r in before)  # partial sequences pending on every rank
    every = Counter(t for i in range(SAMPLES) for t in Documents()[i].tolist())
    for world in (3, 2):
        run_ranks(world, packing_worker, str(tmp_path), f"dp{world}")
        with open(tmp_path / f"dp{world}.json") as f:
            after = json.load(f)
        assert sum(r["held"] for r in after) == sum(r["held"] for r in before)  # handed out, none lost
        consumed = Counter(t for r in before + after for t in r["tokens"])
        assert consumed == every, (consumed - every, every - consumed)


def changed_worker(rank, world, root, length, seed, restart):
    data = cp.DataState(loader(rank, world, 2, dataset=Ids(length), seed=seed), restart_epoch=restart)
    model = torch.nn.Linear(2, 2)
    before = model.weight.detach().clone()
    if restart:
        cp.load(f"{root}/ckpt", {"data": data, "model": cp.Ignore()})
        assert sorted(i for b in global_batches(data) for i in b) == list(range(length))  # the epoch again
        return
    with pytest.raises(cp.DataChangedError) as err:
        cp.load(f"{root}/ckpt", {"data": data, "model": model})
    assert torch.equal(model.weight, before)  # refused before any data moved
    with open(f"{root}/error_{length}_{seed}.txt", "w") as f:
        f.write(str(err.value))


def saving_worker(rank, world, root):
    data = cp.DataState(loader(rank, world, 2))
    next(iter(data))
    cp.save(f"{root}/ckpt", {"data": data, "model": torch.nn.Linear(2, 2)})


def test_a_changed_dataset_is_refused_unless_the_epoch_restarts(tmp_path):
    run_ranks(2, saving_worker, str(tmp_path))
    run_ranks(2, changed_worker, str(tmp_path), 90, 3, False)
    run_ranks(2, changed_worker, str(tmp_path), SAMPLES, 4, False)
    assert "length 96 -> 90" in (tmp_path / "error_90_3.txt").read_text()
    message = (tmp_path / f"error_{SAMPLES}_4.txt").read_text()
    assert "seed 3 -> 4" in message and "restart_epoch=True" in message
    run_ranks(2, changed_worker, str(tmp_path), 90, 3, True)
