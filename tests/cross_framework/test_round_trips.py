"""Every ordered pair of Megatron (TP2×PP2 + distributed optimizer, TP1), DeepSpeed (ZeRO-1, ZeRO-3),
FSDP1, FSDP2, DDP, one process and HF (safetensors export/import): saved in A, loaded in B, every
weight and Adam moment and step equal A's bit for bit (after the canonical mapping); saved in B and
loaded back in A: identical to the original. What one framework has and the other cannot take (a
torch LR scheduler vs Megatron's) is reported by the load, not dropped silently.

Three rounds of one process group per framework: save (A), cross (B loads every A, saves), back
(A loads every B's save)."""
import os
import subprocess
import sys

import pytest
import torch

import ckpt_plugins as cp
from checkpoint_compare import assert_matches
from distributed import run_ranks
from endpoints import TORCH_SCHEDULER, WORLD, build, close, llama

NAMES = list(WORLD)
BCP = os.path.join(os.path.dirname(sys.executable), "bcp")


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


def save_round(rank, world, name, root):
    endpoint = build(name, seed=NAMES.index(name))
    for i in range(2):
        endpoint.step(i)
    cp.save(os.path.join(root, name), endpoint.state)
    close(endpoint)


def cross_round(rank, world, name, root, sources):
    endpoint = build(name, seed=100)
    for source in sources:
        path = os.path.join(root, source)
        load(endpoint, path, source)
        assert_matches(path, endpoint.state, weights_only=source == "hf")
        for group in endpoint.optimizer.param_groups if hasattr(endpoint, "optimizer") else []:
            assert group["lr"] == 1e-2 and tuple(group["betas"]) == (0.9, 0.95) and group["eps"] == 1e-8
        cp.save(os.path.join(root, f"{source}__{name}"), endpoint.state)
    close(endpoint)


def back_round(rank, world, name, root, destinations):
    endpoint = build(name, seed=200)
    original = os.path.join(root, name)
    for dest in destinations:
        load(endpoint, os.path.join(root, f"{name}__{dest}"), "hf" if dest == "hf" else dest)
        assert_matches(original, endpoint.state, weights_only=dest == "hf")
    close(endpoint)


def bcp(*args):
    out = subprocess.run([BCP, *map(str, args)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout


def hf_round_trip(root, source, tmp):
    """B = HF: export A's checkpoint, from_pretrained, compare; save_pretrained, import as `A__hf`."""
    from transformers import LlamaForCausalLM
    export = tmp / f"{source}_export"
    bcp("export", os.path.join(root, source), export, "--format", "hf")
    llama(0).config.save_pretrained(export)  # the checkpoint carries no HF config: the run's own
    model = LlamaForCausalLM.from_pretrained(export)
    assert_matches(os.path.join(root, source), {"model": model}, weights_only=True)
    model.save_pretrained(tmp / f"{source}_hf")
    bcp("import-hf", tmp / f"{source}_hf", os.path.join(root, f"{source}__hf"))


def test_every_ordered_pair_round_trips_bit_for_bit(tmp_path):
    root = str(tmp_path / "ckpts")
    for name in NAMES:
        run_ranks(WORLD[name], save_round, name, root)
    # HF as A: a transformers model directory imported as a checkpoint
    hf = llama(NAMES.index("single") + 50)
    hf.save_pretrained(tmp_path / "hf_model")
    bcp("import-hf", tmp_path / "hf_model", os.path.join(root, "hf"))
    for source in NAMES:
        hf_round_trip(root, source, tmp_path)
    for name in NAMES:
        run_ranks(WORLD[name], cross_round, name, root, [s for s in NAMES + ["hf"] if s != name])
    for name in NAMES:
        run_ranks(WORLD[name], back_round, name, root, [d for d in NAMES + ["hf"] if d != name])
    # HF as A, back: each framework's save of the HF weights exports to the same model
    from transformers import LlamaForCausalLM
    for dest in NAMES:
        export = tmp_path / f"hf__{dest}_export"
        bcp("export", os.path.join(root, f"hf__{dest}"), export, "--format", "hf")
        hf.config.save_pretrained(export)
        back = LlamaForCausalLM.from_pretrained(export)
        for (k, a), b in zip(hf.state_dict().items(), back.state_dict().values()):
            assert torch.equal(a, b), (dest, k)

    # another size or architecture: the first differing tensor and both shapes, or the keys, are named
    from transformers import LlamaConfig
    wider = LlamaForCausalLM(LlamaConfig(**{**hf.config.to_dict(), "hidden_size": 48, "head_dim": 12}))
    with pytest.raises(cp.LoadMismatchError, match=r"model/[\w.]+: checkpoint holds shape \[\d+, \d+\], the model "
                                                   r"wants \[\d+, \d+\]"):
        cp.load(os.path.join(root, "megatron_tp2pp2"), {"model": wider, "optim": cp.Ignore()})
    shallower = LlamaForCausalLM(LlamaConfig(**{**hf.config.to_dict(), "num_hidden_layers": 2}))
    with pytest.raises(cp.LoadMismatchError, match=r"in the checkpoint but not in the state: model/model\.layers\.2\."):
        cp.load(os.path.join(root, "ds_zero3"), {"model": shallower, "optim": cp.Ignore(), "sched": cp.Ignore()})
