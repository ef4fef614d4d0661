"""megatron-core mixture of experts and model families (real megatron-core on CPU, gloo).

- A tiny Qwen3-MoE-shaped GPTModel (4 experts, top-2, q/k norms, SequentialMLP, alltoall
  dispatcher) saved at EP2×PP2 with the distributed optimizer in bf16, loaded at EP1×TP2 (experts
  split over expert-TP), TP2×EP2 with expert-TP 1, EP4 and on one process: weights, fp32 masters
  and Adam moments equal the saved ones bit for bit, the experts are stored under their global
  index as the HF files name them (checked against Megatron's own sharded_state_dict), and
  training continues with the uninterrupted run's losses.
- Exports to transformers (Qwen3-MoE, DeepSeek-V3, Qwen2, Qwen3, Mixtral) with the Megatron
  model's logits, and imports back at other layouts.
- A DeepSeek-V3-shaped model (MLA) and a HybridModel reshard.
"""
import json
import math
import os

import pytest
import torch

import ckpt_plugins as cp
from bcp_cli import bcp
from checkpoint_compare import assert_matches
from ckpt_plugins._src.committed import read_object
from ckpt_plugins._src.offline import open_checkpoint
from distributed import run_ranks
from megatron_util import MOE

STEPS = 2


def moe_state(model, optimizer):
    from megatron_ext import MegatronModel, MegatronOptimizer
    return {"model": MegatronModel(model), "optim": MegatronOptimizer(optimizer, model)}


def assert_experts_as_megatron_places_them(model):
    """Megatron's own sharded_state_dict gives each local expert tensor its global expert index
    (an offset on the expert axis): our fragment of the same tensor names that expert."""
    import megatron_util as mu
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron_ext.gpt import GPTLayout

    ours = {p.data_ptr(): segs[0].name for p, _, segs in GPTLayout(model).params}
    sharded = mu.unwrap(model).sharded_state_dict()
    checked = 0
    for key, sh in sharded.items():
        if isinstance(sh, ShardedTensor) and ".local_experts." in key and key.endswith("linear_fc2.weight"):
            layer, e = sh.global_offset[:2]  # (layer, expert) axes prepended to the tensor's own
            assert ours[sh.data.data_ptr()] == f"model.layers.{layer}.mlp.experts.{e}.down_proj.weight", key
            checked += 1
    assert checked == 4  # 2 layers on this stage × 2 local experts


def save_worker(rank, world, root):
    import megatron_util as mu
    mu.init_parallel(tp=1, pp=2, ep=2)
    model = mu.build_gpt(0, dtype=torch.bfloat16, moe=mu.MOE)
    opt = mu.build_optimizer(model)
    for step in range(STEPS):
        mu.train_step(model, opt, step)
    assert_experts_as_megatron_places_them(model)
    from megatron_ext import hf_config_json
    path = os.path.join(root, "ep2pp2")
    cp.save(path, {**moe_state(model, opt), "hf_config": hf_config_json(model)}, framework="megatron")
    assert_matches(path, moe_state(model, opt))
    losses = [mu.train_step(model, opt, STEPS + i) for i in range(2)]
    if rank == 0:
        with open(path + ".json", "w") as f:
            json.dump(losses, f)
    mu.destroy()


def load_worker(rank, world, root, tp, pp, ep, distributed, etp=None):
    import megatron_util as mu
    mu.init_parallel(tp=tp, pp=pp, ep=ep, etp=etp)
    model = mu.build_gpt(7, dtype=torch.bfloat16, distributed_optimizer=distributed, moe=mu.MOE)
    opt = mu.build_optimizer(model)
    path = os.path.join(root, "ep2pp2")
    cp.load(path, {**moe_state(model, opt), "hf_config": cp.Ignore()})
    assert_matches(path, moe_state(model, opt))
    with open(path + ".json") as f:
        mu.assert_losses_continue(model, opt, STEPS, json.load(f), torch.bfloat16, (tp, pp, ep))
    mu.destroy()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("megatron_moe"))
    run_ranks(4, save_worker, root)
    return root


def test_moe_checkpoint_names_every_expert_by_its_global_index(saved):
    meta = cp.read_metadata(os.path.join(saved, "ep2pp2"))
    for layer in range(4):
        base = f"model/model.layers.{layer}."
        assert meta.tensors[base + "mlp.gate.weight"].shape == (4, 32)
        assert meta.tensors[base + "self_attn.q_norm.weight"].shape == (8,)
        for e in range(4):
            assert meta.tensors[f"{base}mlp.experts.{e}.gate_proj.weight"].shape == (24, 32)
            assert meta.tensors[f"{base}mlp.experts.{e}.up_proj.weight"].shape == (24, 32)
            assert meta.tensors[f"{base}mlp.experts.{e}.down_proj.weight"].shape == (32, 24)
            assert f"optim/model.layers.{layer}.mlp.experts.{e}.down_proj.weight/exp_avg" in meta.tensors
    storage, metadata = open_checkpoint(os.path.join(saved, "ep2pp2"))
    config = json.loads(read_object(storage, metadata, "hf_config", None))
    assert config["model_type"] == "qwen3_moe" and config["num_experts"] == 4 and config["num_experts_per_tok"] == 2


def test_moe_reloads_at_ep1_tp2(saved):
    run_ranks(2, load_worker, saved, 2, 1, 1, True)


def test_moe_reloads_at_ep4(saved):
    run_ranks(4, load_worker, saved, 1, 1, 4, True)


def test_moe_reloads_at_tp2_with_ep2_and_expert_tp1(saved):
    """Expert-TP other than TP: attention split over TP2, experts whole on each of EP2."""
    run_ranks(4, load_worker, saved, 2, 1, 2, True, 1)


def test_moe_reloads_on_one_process(saved):
    run_ranks(1, load_worker, saved, 1, 1, 1, False)


IDS = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(5))


def export_worker(rank, world, root):
    """An fp32 Qwen3-MoE at EP2 on 4 ranks (expert-DP 2): its logits and a checkpoint carrying its
    config.json."""
    import megatron_util as mu
    from megatron_ext import MegatronModel, hf_config_json
    mu.init_parallel(ep=2)
    model = mu.build_gpt(3, distributed_optimizer=False, moe=mu.MOE)
    cp.save(os.path.join(root, "megatron"), {"model": MegatronModel(model), "hf_config": hf_config_json(model)})
    logits = mu.logits(model, IDS)
    if rank == 0:
        torch.save(logits, os.path.join(root, "megatron_logits.pt"))
    mu.destroy()


def import_worker(rank, world, root, tp, ep):
    import megatron_util as mu
    from megatron_ext import MegatronModel
    mu.init_parallel(tp=tp, ep=ep)
    model = mu.build_gpt(9, distributed_optimizer=False, moe=mu.MOE)
    cp.load(os.path.join(root, "imported"), {"model": MegatronModel(model), "hf_config": cp.Ignore()})
    logits = mu.logits(model, IDS)
    if rank == 0:
        torch.save(logits, os.path.join(root, f"imported_tp{tp}_ep{ep}.pt"))
    mu.destroy()


def in_place_worker(rank, world, root):
    """Megatron at TP2 x EP2 (expert-TP 1) with the distributed optimizer loads the sharded HF
    directory in place: the weights the imported checkpoint gives, every file byte read once."""
    import megatron_util as mu
    from megatron_ext import MegatronModel
    mu.init_parallel(tp=2, ep=2, etp=1)
    models = [mu.build_gpt(seed, distributed_optimizer=True, moe=mu.MOE) for seed in (9, 10)]
    result = cp.load(os.path.join(root, "resaved"), {"model": MegatronModel(models[0])})
    cp.load(os.path.join(root, "imported"), {"model": MegatronModel(models[1]), "hf_config": cp.Ignore()})
    for (name, a), b in zip(models[0].named_parameters(), models[1].parameters()):
        assert torch.equal(a, b), name
    read = torch.tensor([result.read_bytes])
    torch.distributed.all_reduce(read)
    assert read.item() == sum(t.nbytes for t in cp.read_metadata(os.path.join(root, "imported")).tensors.values()
                              for t in t.boxes)
    mu.destroy()


def test_moe_export_from_pretrained_save_pretrained_import_keeps_the_logits(tmp_path):
    """Megatron EP2 x expert-DP2 → `bcp export` (per-expert names and config.json, nothing copied by hand) →
    transformers' Qwen3MoeForCausalLM.from_pretrained: the Megatron model's logits. Its
    save_pretrained → `bcp import-hf` → Megatron at TP2 (expert-TP 2) and at EP4: the same logits;
    the saved directory read in place at TP2 x EP2 with the distributed optimizer: the same weights."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM
    root = str(tmp_path)
    run_ranks(4, export_worker, root)
    meta = cp.read_metadata(os.path.join(root, "megatron"))
    for key, t in meta.tensors.items():  # expert-DP and DP replicas: every element written once
        assert sum(b.nbytes for b in t.boxes) == 4 * math.prod(t.shape), key
    bcp("export", os.path.join(root, "megatron"), os.path.join(root, "hf"))
    with safe_open(os.path.join(root, "hf", "model.safetensors"), "pt") as f:
        assert "model.layers.3.mlp.experts.3.down_proj.weight" in set(f.keys())
    hf = AutoModelForCausalLM.from_pretrained(os.path.join(root, "hf")).eval()
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"
    with torch.no_grad():
        ref = hf(IDS).logits
    want = torch.load(os.path.join(root, "megatron_logits.pt"))
    torch.testing.assert_close(ref, want, rtol=0, atol=2e-5)
    hf.save_pretrained(os.path.join(root, "resaved"), max_shard_size="100KB")
    bcp("import-hf", os.path.join(root, "resaved"), os.path.join(root, "imported"))
    run_ranks(2, import_worker, root, 2, 1)
    run_ranks(4, import_worker, root, 1, 4)
    run_ranks(4, in_place_worker, root)
    for name in ("imported_tp2_ep1.pt", "imported_tp1_ep4.pt"):
        torch.testing.assert_close(torch.load(os.path.join(root, name)), ref, rtol=0, atol=2e-5)


def dsv3_save_worker(rank, world, root):
    """A DeepSeek-V3-shaped model at EP2, fp32, distributed optimizer: trained (the expert bias
    moves), saved with its config.json, then its logits and next two losses recorded."""
    import megatron_util as mu
    from megatron_ext import hf_config_json
    mu.init_parallel(ep=2)
    model = mu.build_gpt(0, moe=mu.DSV3)
    opt = mu.build_optimizer(model)
    for step in range(STEPS):
        mu.train_step(model, opt, step)
    bias = mu.unwrap(model).decoder.layers[1].mlp.router.expert_bias
    assert torch.count_nonzero(bias) > 0  # training state a load must bring back
    path = os.path.join(root, "dsv3")
    cp.save(path, {**moe_state(model, opt), "hf_config": hf_config_json(model)})
    logits = mu.logits(model, IDS)
    losses = [mu.train_step(model, opt, STEPS + i) for i in range(2)]
    if rank == 0:
        torch.save({"logits": logits, "losses": losses}, path + ".pt")
    mu.destroy()


def dsv3_load_worker(rank, world, root, tp, ep, distributed):
    import megatron_util as mu
    mu.init_parallel(tp=tp, ep=ep)
    model = mu.build_gpt(7, moe=mu.DSV3, distributed_optimizer=distributed)
    opt = mu.build_optimizer(model)
    path = os.path.join(root, "dsv3")
    cp.load(path, {**moe_state(model, opt), "hf_config": cp.Ignore()})
    assert_matches(path, moe_state(model, opt))  # the expert bias included
    ref = torch.load(path + ".pt")
    torch.testing.assert_close(mu.logits(model, IDS), ref["logits"], rtol=0, atol=2e-5)
    mu.assert_losses_continue(model, opt, STEPS, ref["losses"], torch.float32, (tp, ep))
    mu.destroy()


def test_deepseek_v3_shaped_model_with_mla_reshards_and_exports(tmp_path):
    """MLA, a dense first layer, shared experts and the expert bias: saved at EP2, loaded at TP2
    (heads and shared experts split, experts over expert-TP) and on one process with the same
    logits and losses; exported, transformers' DeepseekV3ForCausalLM gives the same logits."""
    from transformers import AutoModelForCausalLM
    root = str(tmp_path)
    run_ranks(2, dsv3_save_worker, root)
    meta = cp.read_metadata(os.path.join(root, "dsv3"))
    for name in ("model.layers.0.mlp.gate_proj.weight", "model.layers.1.mlp.gate.e_score_correction_bias",
                 "model.layers.1.mlp.shared_experts.up_proj.weight", "model.layers.3.mlp.experts.3.down_proj.weight",
                 "model.layers.2.self_attn.kv_a_proj_with_mqa.weight", "model.layers.2.self_attn.q_a_layernorm.weight"):
        assert f"model/{name}" in meta.tensors, name
    run_ranks(2, dsv3_load_worker, root, 2, 1, True)
    run_ranks(1, dsv3_load_worker, root, 1, 1, False)
    bcp("export", os.path.join(root, "dsv3"), os.path.join(root, "hf"))
    hf = AutoModelForCausalLM.from_pretrained(os.path.join(root, "hf")).eval()
    assert type(hf).__name__ == "DeepseekV3ForCausalLM"
    with torch.no_grad():
        got = hf(IDS).logits
    torch.testing.assert_close(got, torch.load(os.path.join(root, "dsv3.pt"))["logits"], rtol=0, atol=2e-5)


def hybrid_save_worker(rank, world, root):
    """A HybridModel `*-*E` (attention, MLP, attention, MoE) at EP2: its checkpoint and logits."""
    import megatron_util as mu
    from megatron_ext import hf_config_json
    mu.init_parallel(ep=2)
    model = mu.build_gpt(0, moe=mu.MOE, hybrid="*-*E")
    opt = mu.build_optimizer(model)
    for step in range(STEPS):
        mu.train_step(model, opt, step)
    path = os.path.join(root, "hybrid")
    cp.save(path, {**moe_state(model, opt), "hf_config": hf_config_json(model)})
    logits = mu.logits(model, IDS)
    if rank == 0:
        torch.save(logits, path + ".pt")
    mu.destroy()


def gpt_from_hybrid_worker(rank, world, root):
    """The GPTModel of the same layers (dense first layer, then MoE) loads the hybrid's checkpoint."""
    import megatron_util as mu
    mu.init_parallel()
    model = mu.build_gpt(7, layers=2, moe={**mu.MOE, "moe_layer_freq": [0, 1]}, distributed_optimizer=False)
    opt = mu.build_optimizer(model)
    path = os.path.join(root, "hybrid")
    cp.load(path, {**moe_state(model, opt), "hf_config": cp.Ignore()})
    assert_matches(path, moe_state(model, opt))
    torch.testing.assert_close(mu.logits(model, IDS), torch.load(path + ".pt"), rtol=0, atol=2e-5)
    mu.destroy()


def test_hybrid_model_saves_as_the_gpt_and_hf_layers_it_forms(tmp_path):
    """HybridModel's attention + MLP/MoE pairs are stored as the HF layers they form: a GPTModel
    with the same layers loads the checkpoint bit for bit with the same logits, and the export is a
    Qwen3-MoE with a dense first layer (mlp_only_layers) that computes them too."""
    from transformers import AutoModelForCausalLM
    root = str(tmp_path)
    run_ranks(2, hybrid_save_worker, root)
    meta = cp.read_metadata(os.path.join(root, "hybrid"))
    assert "model/model.layers.0.mlp.down_proj.weight" in meta.tensors
    assert "model/model.layers.1.mlp.experts.3.up_proj.weight" in meta.tensors
    assert "model/model.layers.1.input_layernorm.weight" in meta.tensors and "model/model.norm.weight" in meta.tensors
    run_ranks(1, gpt_from_hybrid_worker, root)
    bcp("export", os.path.join(root, "hybrid"), os.path.join(root, "hf"))
    hf = AutoModelForCausalLM.from_pretrained(os.path.join(root, "hf")).eval()
    assert hf.config.mlp_only_layers == [0]
    with torch.no_grad():
        got = hf(IDS).logits
    torch.testing.assert_close(got, torch.load(os.path.join(root, "hybrid.pt")), rtol=0, atol=2e-5)


FAMILIES = {"qwen2": ({"add_qkv_bias": True}, "Qwen2ForCausalLM"),
            "qwen3": ({"qk_layernorm": True}, "Qwen3ForCausalLM"),
            "mixtral": ({**MOE, "qk_layernorm": False}, "MixtralForCausalLM")}


def family_worker(rank, world, root, extra):
    import megatron_util as mu
    from megatron_ext import MegatronModel, hf_config_json
    mu.init_parallel()
    model = mu.build_gpt(3, distributed_optimizer=False, moe=extra)
    cp.save(os.path.join(root, "megatron"), {"model": MegatronModel(model), "hf_config": hf_config_json(model)})
    torch.save(mu.logits(model, IDS), os.path.join(root, "logits.pt"))
    mu.destroy()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_exports_from_megatron_with_its_config_and_logits(family, tmp_path):
    """Qwen2 (q/k/v biases), Qwen3 (q/k norms), Mixtral (MoE, block_sparse_moe names): `bcp export`
    of a Megatron checkpoint, then transformers' class of the family, from_pretrained with the
    config.json the export wrote, computes the Megatron model's logits."""
    from transformers import AutoModelForCausalLM
    extra, cls = FAMILIES[family]
    root = str(tmp_path)
    run_ranks(1, family_worker, root, extra)
    bcp("export", os.path.join(root, "megatron"), os.path.join(root, "hf"))
    hf = AutoModelForCausalLM.from_pretrained(os.path.join(root, "hf")).eval()
    assert type(hf).__name__ == cls
    with torch.no_grad():
        got = hf(IDS).logits
    torch.testing.assert_close(got, torch.load(os.path.join(root, "logits.pt")), rtol=0, atol=2e-5)


def test_megatron_named_tensors_are_listed_or_refused_by_another_framework(tmp_path):
    """Linear biases (`add_bias_linear`) have no HF Qwen2 counterpart: stored under their Megatron
    names, an HF model's load lists them with strict=False and names them with strict=True."""
    import json as js
    from transformers import AutoConfig, AutoModelForCausalLM
    root = str(tmp_path)
    run_ranks(1, family_worker, root, {"add_bias_linear": True})
    path = os.path.join(root, "megatron")
    storage, metadata = open_checkpoint(path)
    biases = sorted(k for k in metadata.tensors if k.startswith("model/decoder.layers."))
    assert "model/decoder.layers.0.self_attention.linear_proj.bias" in biases
    assert "model/model.layers.0.self_attn.q_proj.bias" in metadata.tensors  # q/k/v biases: HF names
    config = js.loads(read_object(storage, metadata, "hf_config", None))
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    with pytest.raises(cp.LoadMismatchError, match="decoder.layers.0.self_attention.linear_proj.bias"):
        cp.load(path, {"model": hf, "hf_config": cp.Ignore()})
    result = cp.load(path, {"model": hf, "hf_config": cp.Ignore()}, strict=False)
    assert sorted(result.unexpected_keys) == biases and not result.missing_keys
