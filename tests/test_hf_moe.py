"""transformers' MoE models, whose experts are fused in memory, stored under the per-expert names
their safetensors files use: whole, as FSDP2's uneven row shards, as FSDP1's flat ranges, and as
DeepSpeed AutoEP's grouped local experts (a pure mapping checked against DeepSpeed's own repacking)."""
import os
import types

import pytest
import torch
from safetensors import safe_open

import ckpt_plugins as cp
from ckpt_plugins._src.families.hf_config import hf_config
from ckpt_plugins._src.families.segments import segment_fragments
from ckpt_plugins._src.offline import open_checkpoint, read_tensor
from ckpt_plugins._src.tensor_map import tensor_map
from distributed import run_ranks
from test_families import tiny

FAMILIES = ("qwen3_moe", "mixtral", "qwen2_moe", "deepseek_v3")


def hf_moe(family: str, seed: int):
    """A tiny transformers model of `family` (fp32), its router biases random (training state)."""
    import transformers
    torch.manual_seed(seed)
    config = transformers.AutoConfig.for_model(**hf_config(tiny(family)))
    model = transformers.AutoModelForCausalLM.from_config(config)
    for module in model.modules():
        if hasattr(module, "e_score_correction_bias"):
            module.e_score_correction_bias.normal_()
    return model


def stored(path) -> dict:
    storage, metadata = open_checkpoint(path)
    return {k: read_tensor(storage, metadata, k) for k in metadata.tensors}


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_experts_are_stored_as_the_tensors_transformers_files_hold(family, tmp_path):
    """The checkpoint of a live model holds exactly the names and values `save_pretrained` writes
    (per-expert gate/up/down or w1/w3/w2, Mixtral's block_sparse_moe, DeepSeek-V3's
    score-correction bias), and loads back into the fused parameters bit for bit."""
    model = hf_moe(family, 0)
    model.save_pretrained(tmp_path / "hf")
    with safe_open(os.path.join(tmp_path, "hf", "model.safetensors"), "pt") as f:
        files = {k: f.get_tensor(k) for k in f.keys()}
    cp.save(tmp_path / "ckpt", {"model": model})
    ours = {k[len("model/"):]: v for k, v in stored(tmp_path / "ckpt").items()}
    assert sorted(ours) == sorted(files)
    assert all(torch.equal(ours[k], files[k]) for k in files)
    fresh = hf_moe(family, 1)
    cp.load(tmp_path / "ckpt", {"model": fresh})
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name


def fsdp_worker(rank, world, root, flavour):
    """One AdamW step of a Qwen3-MoE under FSDP2 (3 ranks: 4 experts shard 2/2/0) or FSDP1 with
    flat parameters (use_orig_params=False: experts cut at arbitrary elements), saved; the full
    weights (and FSDP2's Adam moments) as FSDP itself gathers them, kept for the test."""
    import hf_ext  # noqa: F401  (FSDP1 handler)
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, fully_shard
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeDecoderLayer
    model = hf_moe("qwen3_moe", 0)
    if flavour == "fsdp2":
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        local = model.model.layers[0].mlp.experts.gate_up_proj._local_tensor
        assert local.shape[0] == [2, 2, 0][rank]  # uneven: the last rank holds no expert
    else:
        model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Qwen3MoeDecoderLayer}), use_orig_params=False,
                     device_id=torch.device("cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 40, (2, 9), generator=torch.Generator().manual_seed(rank))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    cp.save(os.path.join(root, flavour), {"model": model, "optim": opt})
    if flavour == "fsdp2":
        full = {n: p.full_tensor() for n, p in model.named_parameters()}
        full.update({f"{n}/exp_avg": opt.state[p]["exp_avg"].full_tensor() for n, p in model.named_parameters()})
    else:
        with FSDP.summon_full_params(model):
            full = {n.replace("_fsdp_wrapped_module.", ""): p.detach().clone() for n, p in model.named_parameters()}
    if rank == 0:
        torch.save(full, os.path.join(root, flavour + ".pt"))


@pytest.mark.parametrize("flavour, world", [("fsdp2", 3), ("fsdp1", 2)])
def test_fsdp_shards_of_fused_experts_load_into_one_process(flavour, world, tmp_path):
    root = str(tmp_path)
    run_ranks(world, fsdp_worker, root, flavour)
    full = torch.load(os.path.join(root, flavour + ".pt"))
    meta = cp.read_metadata(os.path.join(root, flavour))
    assert "model/model.layers.1.mlp.experts.3.up_proj.weight" in meta.tensors
    assert not any("gate_up_proj" in k for k in meta.tensors)
    model = hf_moe("qwen3_moe", 5)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cp.load(os.path.join(root, flavour), {"model": model, "optim": opt}, strict=flavour == "fsdp2")
    for name, p in model.named_parameters():
        assert torch.equal(p, full[name]), name
        if flavour == "fsdp2":
            assert torch.equal(opt.state[p]["exp_avg"], full[f"{name}/exp_avg"]), name


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("ep_size", [1, 2, 4])
def test_autoep_local_experts_are_boxes_of_the_per_expert_tensors(family, ep_size):
    """DeepSpeed's own repacking (`repack_expert_weights`, what AutoEP copies into its grouped
    experts) cut by our AutoEP mapping gives, on every EP rank, exactly the per-expert tensors
    transformers' fused layout maps to; the ranks together cover every expert once."""
    from deepspeed.moe.ep_repack import repack_expert_weights
    from deepspeed_ext.autoep import Placement, autoep_segments
    model = hf_moe(family, 0)
    experts = model.model.layers[1].mlp.experts
    canonical = {}
    for name in ("gate_up_proj", "down_proj"):
        full = f"model.layers.1.mlp.experts.{name}"
        for frag in tensor_map(model).fragments(full, getattr(experts, name).detach(), lambda n: n):
            canonical[frag.key] = frag.local
    spec = types.SimpleNamespace(num_experts=4, expert_storage="fused_3d", expert_w1_name="gate_up_proj",
                                 expert_w2_name="down_proj", expert_w3_name=None)
    seen = []
    for rank in range(ep_size):
        placements = (("model.layers.1.", Placement(rank, ep_size, 4)),)
        w1, w2, w3 = repack_expert_weights(experts, spec, rank, ep_size)
        for name, local in (("w1", w1), ("w2", w2), ("w3", w3)):
            segments = autoep_segments(family, placements, tensor_map(model).segments,
                                       f"model.layers.1.mlp.experts.{name}", tuple(local.shape))
            for frag in segment_fragments(segments, local.shape, local, lambda n: n):
                assert frag.offsets == (0, 0) and torch.equal(frag.local, canonical[frag.key]), frag.key
                seen.append(frag.key)
        router = autoep_segments(family, placements, tensor_map(model).segments, "model.layers.1.mlp.router.gate.weight",
                                 (4, 16))
        block = "block_sparse_moe" if family == "mixtral" else "mlp"
        assert [s.name for s in router] == [f"model.layers.1.{block}.gate.weight"]
    assert sorted(seen) == sorted(canonical)
