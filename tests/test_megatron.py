"""megatron-core GPT (real megatron-core on CPU, gloo) through megatron_ext: saved at TP2×PP2 (bf16)
and TP2×DP2 (fp32), both with the distributed optimizer, loaded at TP1, TP2×PP2, TP1×PP2, TP1×DP4
and on one process; weights, fp32 masters and Adam moments equal the saved ones bit for bit, and
training goes on with the losses of the uninterrupted run. Logits agree with transformers'
LlamaForCausalLM in both directions."""
import json
import os
from typing import NamedTuple

import pytest
import torch

import ckpt_plugins as cp
from checkpoint_compare import assert_matches
from distributed import run_ranks

# name -> (tp, pp, dtype) of the saving run; world 4: TP2×PP2 has DP1, TP2×DP2 has DP2
SAVES = {"tp2pp2_bf16": (2, 2, torch.bfloat16), "tp2dp2_fp32": (2, 1, torch.float32)}
STEPS = 2  # trained before the save; the next two are compared


def megatron_state(model, optimizer):
    from megatron_ext import MegatronModel, MegatronOptimizer
    return {"model": MegatronModel(model), "optim": MegatronOptimizer(optimizer, model)}


def assert_matches_checkpoint(path, model, optimizer):
    """Every weight, master and moment this rank holds equals the checkpoint's, bit for bit (a bf16
    weight in an fp32 model: its fp32 master)."""
    assert_matches(path, megatron_state(model, optimizer))


def save_worker(rank, world, root):
    import megatron_util as mu
    from megatron_ext import MegatronModel, MegatronOptimizer
    from test_hf_fsdp1 import CountTrainingCollectives
    for name, (tp, pp, dtype) in SAVES.items():
        mu.init_parallel(tp, pp)
        model = mu.build_gpt(0, dtype=dtype)
        opt = mu.build_optimizer(model)
        for step in range(STEPS):
            mu.train_step(model, opt, step)
        path = os.path.join(root, name)
        state = {"model": MegatronModel(model), "optim": MegatronOptimizer(opt, model)}
        counter = CountTrainingCollectives()
        try:
            first = cp.save(path, state, framework="megatron")
            calls_first = list(counter.calls)
            second = cp.save(path, state, overwrite=True)
        finally:
            counter.close()
        # no gather of weights or optimizer state: the training groups see no collective at all
        # (the param-group names are exchanged once per run with all_gather_object, not counted here)
        assert calls_first == [] and counter.calls == [], counter.calls
        assert not first.plan_cached and second.plan_cached and second.collectives == 1
        assert_matches_checkpoint(path, model, opt)
        losses = [mu.train_step(model, opt, STEPS + i) for i in range(2)]
        if rank == 0:
            with open(path + ".json", "w") as f:
                json.dump(losses, f)
        mu.destroy()


class Reload(NamedTuple):
    """A saved checkpoint (a key of SAVES) reloaded at this TP x PP, with or without the
    distributed optimizer."""
    saved: str
    tp: int
    pp: int
    distributed: bool


def load_worker(rank, world, root, cases):
    import megatron_util as mu
    for name, tp, pp, distributed in cases:
        dtype = SAVES[name][2]
        mu.init_parallel(tp, pp)
        model = mu.build_gpt(7, dtype=dtype, distributed_optimizer=distributed)
        opt = mu.build_optimizer(model)
        path = os.path.join(root, name)
        cp.load(path, megatron_state(model, opt))
        assert_matches_checkpoint(path, model, opt)
        for group in opt.param_groups:
            assert group["betas"] == (0.9, 0.95) and group["lr"] == 1e-2
            assert group["weight_decay"] == (0.0 if group["wd_mult"] == 0 else 0.1)
        with open(path + ".json") as f:
            mu.assert_losses_continue(model, opt, STEPS, json.load(f), dtype, (name, tp, pp, distributed))
        mu.destroy()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("megatron"))
    run_ranks(4, save_worker, root)
    return root


def test_distributed_optimizer_checkpoints_reload_at_tp2pp2_and_tp1dp4(saved):
    run_ranks(4, load_worker, saved, [Reload("tp2pp2_bf16", 2, 2, True), Reload("tp2dp2_fp32", 1, 1, True),
                                      Reload("tp2pp2_bf16", 1, 1, True), Reload("tp2dp2_fp32", 2, 2, True)])


def test_distributed_optimizer_checkpoints_reload_at_tp1pp2_and_tp1(saved):
    run_ranks(2, load_worker, saved, [Reload("tp2pp2_bf16", 1, 2, True), Reload("tp2dp2_fp32", 1, 2, True),
                                      Reload("tp2dp2_fp32", 1, 1, False), Reload("tp2pp2_bf16", 1, 1, False)])


def test_distributed_optimizer_checkpoints_reload_on_one_process(saved):
    run_ranks(1, load_worker, saved, [Reload("tp2pp2_bf16", 1, 1, False), Reload("tp2dp2_fp32", 1, 1, True)])


def test_bf16_weights_are_stored_as_their_fp32_masters_cast(saved):
    """The distributed optimizer copies its masters into the weights each step: the bf16 save
    stores the masters once, the weights recorded as their cast (loaded above, bit for bit)."""
    meta = cp.read_metadata(os.path.join(saved, "tp2pp2_bf16"))
    weights = [k for k in meta.tensors if k.startswith("model/") and f"optim/{k[6:]}/master" in meta.tensors]
    assert weights and meta.casts == {k: f"optim/{k[6:]}/master" for k in weights}
    assert not any(meta.tensors[k].boxes for k in weights)
    assert cp.read_metadata(os.path.join(saved, "tp2dp2_fp32")).casts == {}  # fp32: the weights are the masters
