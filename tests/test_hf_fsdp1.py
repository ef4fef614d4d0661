"""FSDP1 through hf_ext, on real gloo process groups: each rank's flat shard is saved as is (no
all-gather), and the checkpoint reshards to FSDP1 at another world size and parameter mode, to
FSDP2, and to a single process, bit for bit; training continues."""
import functools

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecision
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

import ckpt_plugins as cp
import hf_ext  # noqa: F401  (registers the FSDP1 handler)
from distributed import run_ranks
from hf_models import assert_same, full_state, tiny_llama, train_step

COLLECTIVES = ("all_gather_into_tensor", "all_gather", "all_reduce", "broadcast", "reduce_scatter_tensor",
               "_all_gather_base", "all_to_all_single")


def fsdp1(model, use_orig_params, mixed):
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed else None
    return FSDP(model, auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}), device_id=torch.device("cpu"),
                use_orig_params=use_orig_params, mixed_precision=mp)


def fsdp2(model):
    from torch.distributed.fsdp import fully_shard
    for layer in model.model.layers:
        fully_shard(layer)
    return fully_shard(model)


def make(kind, seed, **kw):
    model = tiny_llama(seed)
    if kind == "fsdp1":
        model = fsdp1(model, **kw)
    elif kind == "fsdp2":
        model = fsdp2(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95))


class CountTrainingCollectives:
    """Counts collectives issued on the training job's own groups (not ckpt_plugins' groups)."""

    def __init__(self):
        self.calls = []
        self.patches = []
        for name in COLLECTIVES:
            original = getattr(dist, name)
            self.patches.append((name, original))
            setattr(dist, name, functools.partial(self._record, name, original))

    def _record(self, name, original, *args, **kwargs):
        group = kwargs.get("group")
        if group is None or group == dist.group.WORLD:
            self.calls.append(name)
        return original(*args, **kwargs)

    def close(self):
        for name, original in self.patches:
            setattr(dist, name, original)


def save_worker(rank, world, path, ref_path, orig, mixed):
    model, opt = make("fsdp1", 0, use_orig_params=orig, mixed=mixed)
    for step in range(2):
        train_step(model, opt, step)
    counter = CountTrainingCollectives()
    try:
        first = cp.save(path, {"model": model, "optim": opt}, framework="fsdp1")
        second = cp.save(path, {"model": model, "optim": opt}, overwrite=True)  # same structure: cached plan
    finally:
        counter.close()
    assert counter.calls == [], counter.calls  # no all-gather, no broadcast: the flat shards as they are
    assert not first.plan_cached and second.plan_cached and second.collectives == 1
    ref = full_state(model, opt)
    loss = train_step(model, opt, 2)  # what the next step gives, for the loaded copies to match
    if rank == 0:
        torch.save({"state": ref, "loss": loss}, ref_path)


def load_worker(rank, world, path, ref_path, kind, orig, mixed, exact, out_path):
    model, opt = make(kind, 1, use_orig_params=orig, mixed=mixed)
    cp.load(path, {"model": model, "optim": opt})
    ref = torch.load(ref_path)
    assert_same(ref["state"], full_state(model, opt))
    assert opt.param_groups[0]["betas"] == (0.9, 0.95) and opt.param_groups[0]["weight_decay"] == 0.1
    if out_path is not None:  # saved again from this layout, it loads back as well
        cp.save(out_path, {"model": model, "optim": opt})
    loss = train_step(model, opt, 2)
    if mixed and kind != "fsdp1":
        pass  # bf16 compute saved, fp32 compute loaded: the state above is what must match
    elif exact:  # same world size, same arithmetic: the run continues exactly
        assert loss == ref["loss"], (loss, ref["loss"])
    else:  # gradients averaged over another number of ranks: summation order differs
        assert abs(loss - ref["loss"]) < 1e-5 * abs(ref["loss"]), (loss, ref["loss"])


@pytest.mark.parametrize("orig, mixed", [(False, False), (True, True)])
def test_fsdp1_flat_shards_save_without_gathering_and_reshard_everywhere(tmp_path, orig, mixed):
    path, ref_path = tmp_path / "fsdp1", tmp_path / "ref.pt"
    run_ranks(2, save_worker, path, ref_path, orig, mixed)
    run_ranks(2, load_worker, path, ref_path, "fsdp1", not orig, mixed, True, None)  # other parameter mode
    run_ranks(3, load_worker, path, ref_path, "fsdp1", orig, mixed, False, tmp_path / "fsdp1_3")  # uneven
    run_ranks(2, load_worker, tmp_path / "fsdp1_3", ref_path, "fsdp2", False, mixed, False, None)
    plain, opt = make("plain", 2)
    cp.load(tmp_path / "fsdp1_3", {"model": plain, "optim": opt})
    assert_same(torch.load(ref_path)["state"], full_state(plain, opt))


def test_fsdp1_loads_a_single_process_checkpoint(tmp_path):
    model, opt = make("plain", 0)
    for step in range(2):
        train_step(model, opt, step)
    cp.save(tmp_path / "c", {"model": model, "optim": opt})
    ref = full_state(model, opt)
    torch.save({"state": ref, "loss": train_step(model, opt, 2)}, tmp_path / "ref.pt")
    run_ranks(2, load_worker, tmp_path / "c", tmp_path / "ref.pt", "fsdp1", True, False, False, None)


def bitsandbytes_worker(rank, world, root):
    import bitsandbytes as bnb
    for orig in (False, True):
        model = fsdp1(tiny_llama(0), use_orig_params=orig, mixed=False)
        opt = bnb.optim.AdamW8bit(model.parameters(), lr=1e-2, min_8bit_size=0)
        for step in range(2):
            train_step(model, opt, step)
        cp.save(root / str(orig), {"model": model, "optim": opt})
        saved = [t.clone() for s in opt.state.values() for _, t in sorted(s.items()) if torch.is_tensor(t) and t.dim()]
        loss = train_step(model, opt, 2)
        model = fsdp1(tiny_llama(1), use_orig_params=orig, mixed=False)
        opt = bnb.optim.AdamW8bit(model.parameters(), lr=1e-2, min_8bit_size=0)
        cp.load(root / str(orig), {"model": model, "optim": opt})
        loaded = [t for s in opt.state.values() for _, t in sorted(s.items()) if torch.is_tensor(t) and t.dim()]
        assert len(loaded) == len(saved) and all(torch.equal(a, b) for a, b in zip(saved, loaded)), orig
        assert train_step(model, opt, 2) == loss, orig


def test_bitsandbytes_8bit_state_of_flat_shards_returns_to_its_shard(tmp_path):
    """bitsandbytes' 8-bit AdamW over FSDP1's flat shards (both parameter modes) keeps an absmax per
    256-element block of each rank's shard: it comes back to that shard bit for bit and training
    goes on exactly (it once came back as another rank's)."""
    run_ranks(2, bitsandbytes_worker, tmp_path)
