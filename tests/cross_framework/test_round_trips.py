"""Every ordered pair of frameworks, for a dense Llama and for a Qwen3-MoE: saved in A, loaded in B,
every weight and Adam moment and step equal A's bit for bit (after the canonical mapping); saved in
B and loaded back in A: identical to the original. What one framework has and the other cannot take
(a torch LR scheduler vs Megatron's) is reported by the load, not dropped silently.

Llama: Megatron (TP2×PP2 + distributed optimizer, TP1), DeepSpeed (ZeRO-1, ZeRO-3), FSDP1, FSDP2,
DDP, one process and HF (safetensors export → from_pretrained → save_pretrained → import).
Qwen3-MoE: Megatron EP2 (distributed optimizer), DeepSpeed ZeRO-1, ZeRO-3 and AutoEP EP2 with
ZeRO-2, FSDP1 (flat ranges across expert boundaries), FSDP2 (experts sharded by rows), DDP, one
process and HF: transformers' fused experts, Megatron's and AutoEP's local experts all land in the
same per-expert tensors.

Three rounds, each one process group per world size that runs its frameworks in turn: save (A),
cross (B loads every A, saves), back (A loads every B's save)."""
import os

import pytest
import torch

import ckpt_plugins as cp
from bcp_cli import bcp
from checkpoint_compare import assert_matches
from distributed import run_ranks
from endpoints import TORCH_SCHEDULER, WORLD, build, close, hf_model


def load(endpoint, path, source):
    """Load `path` (saved by `source`) into the endpoint; check what it could not take is reported."""
    if source == "hf":
        result = cp.load(path, endpoint.weights_state(), strict=False)
        assert result.missing_keys == [] and set(result.unexpected_keys) <= {"hf_config"}, result
        return
    both_torch = endpoint.name in TORCH_SCHEDULER and source in TORCH_SCHEDULER
    state = {k: v for k, v in endpoint.state.items() if k != "sched" or both_torch}
    result = cp.load(path, state, strict=False)
    left = [k for k in result.unexpected_keys + result.missing_keys if not k.startswith("sched/")]
    assert left == [], left
    if source in TORCH_SCHEDULER and not both_torch:  # Megatron has no torch scheduler to take it
        assert any(k.startswith("sched/") for k in result.unexpected_keys), result.unexpected_keys
    if both_torch:
        assert endpoint.scheduler.last_epoch == 2


def save_round(rank, world, names, root, model):
    for name in names:
        endpoint = build(name, list(WORLD[model]).index(name), model)
        for i in range(2):
            endpoint.step(i)
        cp.save(os.path.join(root, name), endpoint.state)
        close(endpoint)


def cross_round(rank, world, names, root, model):
    for name in names:
        endpoint = build(name, 100, model)
        for source in [s for s in list(WORLD[model]) + ["hf"] if s != name]:
            path = os.path.join(root, source)
            load(endpoint, path, source)
            assert_matches(path, endpoint.state, weights_only=source == "hf")
            for group in endpoint.optimizer.param_groups if hasattr(endpoint, "optimizer") else []:
                assert group["lr"] == 1e-2 and tuple(group["betas"]) == (0.9, 0.95) and group["eps"] == 1e-8
                if name in TORCH_SCHEDULER:  # another framework's layout flags stay out of torch's groups
                    assert not {"moe", "is_expert_parallel"} & set(group), group.keys()
            cp.save(os.path.join(root, f"{source}__{name}"), endpoint.state)
        close(endpoint)


def back_round(rank, world, names, root, model):
    for name in names:
        endpoint = build(name, 200, model)
        original = os.path.join(root, name)
        for dest in [d for d in list(WORLD[model]) + ["hf"] if d != name]:
            load(endpoint, os.path.join(root, f"{name}__{dest}"), "hf" if dest == "hf" else dest)
            assert_matches(original, endpoint.state, weights_only=dest == "hf")
        close(endpoint)


def each_world(model, round_fn, root):
    """One process group per world size, its endpoints one after another: the frameworks leave no
    state behind that the next one sees (Megatron's parallel state is destroyed by `close`)."""
    by_world = {}
    for name, world in WORLD[model].items():
        by_world.setdefault(world, []).append(name)
    for world, names in by_world.items():
        run_ranks(world, round_fn, names, root, model)


def hf_round_trip(root, source, tmp, model):
    """B = HF: export A's checkpoint, from_pretrained, compare; save_pretrained, import as `A__hf`."""
    from transformers import AutoModelForCausalLM
    export = tmp / f"{source}_export"
    bcp("export", os.path.join(root, source), export, "--format", "hf")
    hf_model(model, 0).config.save_pretrained(export)  # the checkpoint carries no HF config: the run's own
    hf = AutoModelForCausalLM.from_pretrained(export)
    assert_matches(os.path.join(root, source), {"model": hf}, weights_only=True)
    hf.save_pretrained(tmp / f"{source}_hf")
    bcp("import-hf", tmp / f"{source}_hf", os.path.join(root, f"{source}__hf"))


def round_trip_every_pair(tmp_path, model):
    """The three rounds, HF as A and as B; returns the checkpoints' root and the HF model (A)."""
    from transformers import AutoModelForCausalLM
    names, root = list(WORLD[model]), str(tmp_path / "ckpts")
    each_world(model, save_round, root)
    # HF as A: a transformers model directory imported as a checkpoint
    hf = hf_model(model, 50)
    hf.save_pretrained(tmp_path / "hf_model")
    bcp("import-hf", tmp_path / "hf_model", os.path.join(root, "hf"))
    for source in names:
        hf_round_trip(root, source, tmp_path, model)
    each_world(model, cross_round, root)
    each_world(model, back_round, root)
    # HF as A, back: each framework's save of the HF weights exports to the same model
    for dest in names:
        export = tmp_path / f"hf__{dest}_export"
        bcp("export", os.path.join(root, f"hf__{dest}"), export, "--format", "hf")
        hf.config.save_pretrained(export)
        back = AutoModelForCausalLM.from_pretrained(export)
        for (k, a), b in zip(hf.state_dict().items(), back.state_dict().values()):
            assert torch.equal(a, b), (dest, k)
    return root, hf


def test_every_ordered_pair_round_trips_bit_for_bit(tmp_path):
    root, hf = round_trip_every_pair(tmp_path, "llama")
    from transformers import LlamaForCausalLM

    # another size or architecture: the first differing tensor and both shapes, or the keys, are named
    from transformers import LlamaConfig
    wider = LlamaForCausalLM(LlamaConfig(**{**hf.config.to_dict(), "hidden_size": 48, "head_dim": 12}))
    with pytest.raises(cp.LoadMismatchError, match=r"model/[\w.]+: checkpoint holds shape \[\d+, \d+\], the model "
                                                   r"wants \[\d+, \d+\]"):
        cp.load(os.path.join(root, "megatron_tp2pp2"), {"model": wider, "optim": cp.Ignore()})
    shallower = LlamaForCausalLM(LlamaConfig(**{**hf.config.to_dict(), "num_hidden_layers": 2}))
    with pytest.raises(cp.LoadMismatchError, match=r"in the checkpoint but not in the state: model/model\.layers\.2\."):
        cp.load(os.path.join(root, "ds_zero3"), {"model": shallower, "optim": cp.Ignore(), "sched": cp.Ignore()})


def test_every_ordered_pair_round_trips_a_moe_model_bit_for_bit(tmp_path):
    root, _ = round_trip_every_pair(tmp_path, "qwen3_moe")
    meta = cp.read_metadata(os.path.join(root, "fsdp2"))
    experts = [k for k in meta.tensors if k.startswith("model/model.layers.0.mlp.experts.")]
    assert sorted(experts) == sorted(f"model/model.layers.0.mlp.experts.{e}.{p}_proj.weight"
                                     for e in range(4) for p in ("gate", "up", "down"))
    assert "optim/model.layers.3.mlp.experts.3.down_proj.weight/exp_avg" in meta.tensors
