"""The pure model-family mappings (ckpt_plugins._src.families), without processes: Megatron's TP/EP-local
tensors cut into canonical boxes and reassembled for every layout (SequentialMLP, TEGroupedMLP and
GroupedMLP experts, expert-TP, the distributed optimizer's flat ranges), the names each HF family's
own `save_pretrained` writes, and config.json in both directions."""
import json
import os

import pytest
import torch
from safetensors import safe_open

from ckpt_plugins._src.families.hf_config import ModelConfig, hf_config, model_config
from ckpt_plugins._src.families.dims import Dims
from megatron_ext.family import Ranks, canonical_segments, hybrid_pairs, megatron_family, moe_layers
from ckpt_plugins._src.families.segments import segment_fragments

DIMS = Dims(hidden=16, ffn=24, heads=8, groups=4, head_dim=2, vocab=50)


def reassemble(canonical: dict, pieces) -> dict:
    """Canonical tensors filled from (name, offsets, view) pieces; unfilled elements stay NaN."""
    out = {k: torch.full_like(v, float("nan")) for k, v in canonical.items()}
    for key, offsets, view in pieces:
        region = out[key]
        for d, (o, n) in enumerate(zip(offsets, view.shape)):
            region = region.narrow(d, o, n)
        region.copy_(view)
    return out


def cut(name, local, dims, ranks, dim, flat_ranges=None):
    """The canonical pieces of one local tensor, whole or as the distributed optimizer's flat ranges."""
    segs = canonical_segments(name, tuple(local.shape), dims, ranks, dim)
    if flat_ranges is None:
        frags = segment_fragments(segs, local.shape, local, lambda n: n)
    else:
        flat = local.reshape(-1)
        frags = [f for a, b in flat_ranges for f in segment_fragments(segs, local.shape, flat[a:b], lambda n: n, a)]
    return [(f.key, f.offsets, f.local) for f in frags]


def test_qkv_rows_split_per_query_group_into_q_k_v():
    """Megatron's fused rows [q heads of group g, k_g, v_g] × groups, against an independent reshape."""
    per_group = DIMS.heads // DIMS.groups
    full = torch.arange((DIMS.heads + 2 * DIMS.groups) * DIMS.head_dim * 16, dtype=torch.float32).view(-1, 16)
    grouped = full.view(DIMS.groups, per_group + 2, DIMS.head_dim, 16)
    want = {f"model.layers.3.self_attn.{p}_proj.weight": t for p, t in
            (("q", grouped[:, :per_group].reshape(-1, 16)), ("k", grouped[:, per_group].reshape(-1, 16)),
             ("v", grouped[:, per_group + 1].reshape(-1, 16)))}
    for tp in (1, 2, 4):
        pieces = [p for rank in range(tp) for p in cut("decoder.layers.3.self_attention.linear_qkv.weight",
                                                       full.chunk(tp)[rank], DIMS, Ranks(rank, tp), 0)]
        got = reassemble(want, pieces)
        assert all(torch.equal(got[k], want[k]) for k in want), tp


def test_fc1_vocab_padding_norms_and_megatron_names():
    gate_up = canonical_segments("decoder.layers.0.mlp.linear_fc1.weight", (24, 16), DIMS, Ranks(1, 2), 0)
    assert [(s.name, s.local, s.offsets) for s in gate_up] == [
        ("model.layers.0.mlp.gate_proj.weight", ((0, 0), (12, 16)), (12, 0)),
        ("model.layers.0.mlp.up_proj.weight", ((12, 0), (12, 16)), (12, 0))]
    last = canonical_segments("output_layer.weight", (26, 16), DIMS, Ranks(1, 2), 0)  # rows 26..51, vocab 50
    assert [(s.name, s.local, s.offsets) for s in last] == [
        ("lm_head.weight", ((0, 0), (24, 16)), (26, 0)), (None, ((24, 0), (2, 16)), (24, 0))]
    tied = Dims(**{**DIMS.__dict__, "tied": True})
    assert canonical_segments("output_layer.weight", (52, 16), tied)[0].name == "model.embed_tokens.weight"
    proj = canonical_segments("decoder.layers.1.self_attention.linear_proj.weight", (16, 8), DIMS, Ranks(1, 2), 1)
    assert [(s.name, s.shape, s.offsets) for s in proj] == [("model.layers.1.self_attn.o_proj.weight", (16, 16), (0, 8))]
    assert canonical_segments("decoder.layers.0.self_attention.q_layernorm.weight", (2,), DIMS)[0].name == \
        "model.layers.0.self_attn.q_norm.weight"
    mla = Dims(**{**DIMS.__dict__, "mla": True, "family": "deepseek_v3"})
    assert canonical_segments("decoder.layers.0.self_attention.q_layernorm.weight", (4,), mla)[0].name == \
        "model.layers.0.self_attn.q_a_layernorm.weight"
    # no HF counterpart: the Megatron name (global layer), the TP-merged shape, still a box
    bias = canonical_segments("decoder.layers.2.self_attention.linear_proj.bias", (16,), DIMS, Ranks(1, 2), None)
    assert [(s.name, s.shape, s.offsets) for s in bias] == [("decoder.layers.2.self_attention.linear_proj.bias", (16,), (0,))]
    plain = Dims(**{**DIMS.__dict__, "gated": False})
    fc1 = canonical_segments("decoder.layers.0.mlp.linear_fc1.weight", (12, 16), plain, Ranks(1, 2), 0)
    assert [(s.name, s.shape, s.offsets) for s in fc1] == [("decoder.layers.0.mlp.linear_fc1.weight", (24, 16), (12, 0))]
    with pytest.raises(ValueError, match="unknown model family 'gpt-j'"):
        canonical_segments("decoder.layers.0.mlp.linear_fc2.weight", (16, 24), Dims(**{**DIMS.__dict__, "family": "gpt-j"}))


MOE = Dims(hidden=16, ffn=40, heads=8, groups=4, head_dim=2, vocab=50, family="qwen3_moe", experts=8, moe_ffn=12)


def expert_tensors(dims, layer=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for e in range(dims.experts):
        for proj, shape in (("gate_proj", (dims.moe_ffn, dims.hidden)), ("up_proj", (dims.moe_ffn, dims.hidden)),
                            ("down_proj", (dims.hidden, dims.moe_ffn))):
            out[f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"] = torch.randn(shape, generator=gen)
    return out


def local_experts(canonical, dims, ep_rank, ep, etp_rank, etp, layer=2):
    """Each local expert's (fc1, fc2) as megatron holds it: fc1 = [gate rows; up rows] of this
    expert-TP rank, fc2 = its down columns; global expert ep_rank · local + i."""
    n = dims.experts // ep
    out = []
    for i in range(n):
        e = ep_rank * n + i
        t = {p: canonical[f"model.layers.{layer}.mlp.experts.{e}.{p}_proj.weight"] for p in ("gate", "up", "down")}
        fc1 = torch.cat([t["gate"].chunk(etp)[etp_rank], t["up"].chunk(etp)[etp_rank]])
        out.append((fc1, t["down"].chunk(etp, dim=1)[etp_rank].contiguous()))
    return out


@pytest.mark.parametrize("ep,etp", [(1, 1), (2, 1), (2, 2), (4, 2), (8, 1)])
@pytest.mark.parametrize("layout", ["sequential", "te_grouped", "grouped"])
def test_experts_reassemble_from_every_ep_and_expert_tp_layout(ep, etp, layout):
    """Every expert layout at every (EP, expert-TP), whole and as flat ranges cut at odd places,
    lands each element once in the global expert's canonical tensors. GroupedMLP's weight1/weight2
    are built as its forward uses them: weight1.view(local, H, -1)[i] = fc1_i.T."""
    want = expert_tensors(MOE)
    pieces = []
    for ep_rank in range(ep):
        for etp_rank in range(etp):
            ranks = Ranks(0, 1, ep_rank, ep, etp_rank, etp)
            experts = local_experts(want, MOE, ep_rank, ep, etp_rank, etp)
            if layout == "grouped":
                w1 = torch.stack([fc1.t() for fc1, _ in experts]).reshape(MOE.hidden, -1)
                w2 = torch.stack([fc2.t() for _, fc2 in experts]).reshape(-1, MOE.hidden)
                tensors = [("decoder.layers.2.mlp.experts.weight1", w1, 1), ("decoder.layers.2.mlp.experts.weight2", w2, 0)]
            else:
                fmt = ("decoder.layers.2.mlp.experts.local_experts.{i}.linear_fc{k}.weight" if layout == "sequential"
                       else "decoder.layers.2.mlp.experts.linear_fc{k}.weight{i}")
                tensors = [(fmt.format(i=i, k=k), t, k - 1) for i, pair in enumerate(experts)
                           for k, t in ((1, pair[0]), (2, pair[1]))]
            for name, local, dim in tensors:
                pieces += cut(name, local, MOE, ranks, dim)
                numel = local.numel()
                cuts = [0, numel // 3 + 1, 2 * numel // 3 - 5, numel]
                flat = cut(name, local, MOE, ranks, dim, list(zip(cuts, cuts[1:])))
                got_whole = reassemble(want, cut(name, local, MOE, ranks, dim))
                got_flat = reassemble(want, flat)
                for k in want:  # the flat ranges cover exactly what the whole tensor does
                    assert torch.equal(got_whole[k].isnan(), got_flat[k].isnan()), (name, k)
                    assert torch.equal(got_whole[k].nan_to_num(), got_flat[k].nan_to_num()), (name, k)
    got = reassemble(want, pieces)
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_family_names_for_router_shared_experts_and_expert_bias():
    mixtral = Dims(**{**MOE.__dict__, "family": "mixtral"})
    segs = canonical_segments("decoder.layers.1.mlp.experts.local_experts.1.linear_fc1.weight", (24, 16), mixtral,
                              Ranks(0, 1, 2, 4), 0)
    assert [s.name for s in segs] == ["model.layers.1.block_sparse_moe.experts.5.w1.weight",
                                      "model.layers.1.block_sparse_moe.experts.5.w3.weight"]
    assert canonical_segments("decoder.layers.1.mlp.router.weight", (8, 16), mixtral)[0].name == \
        "model.layers.1.block_sparse_moe.gate.weight"
    qwen2 = Dims(**{**MOE.__dict__, "family": "qwen2_moe", "shared_ffn": 20})
    shared = canonical_segments("decoder.layers.0.mlp.shared_experts.linear_fc1.weight", (20, 16), qwen2, Ranks(1, 2), 0)
    assert [(s.name, s.offsets) for s in shared] == [("model.layers.0.mlp.shared_expert.gate_proj.weight", (10, 0)),
                                                     ("model.layers.0.mlp.shared_expert.up_proj.weight", (10, 0))]
    assert canonical_segments("decoder.layers.0.mlp.shared_experts.gate_weight", (1, 16), qwen2)[0].name == \
        "model.layers.0.mlp.shared_expert_gate.weight"
    dsv3 = Dims(**{**MOE.__dict__, "family": "deepseek_v3", "shared_ffn": 12, "mla": True})
    assert canonical_segments("decoder.layers.3.mlp.router.expert_bias", (8,), dsv3)[0].name == \
        "model.layers.3.mlp.gate.e_score_correction_bias"
    assert canonical_segments("decoder.layers.3.mlp.shared_experts.linear_fc2.weight", (16, 12), dsv3, Ranks(), 1)[0].name \
        == "model.layers.3.mlp.shared_experts.down_proj.weight"
    # a dense first layer of a MoE model: the dense MLP names
    assert [s.name for s in canonical_segments("decoder.layers.0.mlp.linear_fc1.weight", (80, 16), dsv3, Ranks(), 0)] \
        == ["model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"]
    # Qwen3-MoE has no expert bias in its files: the Megatron name
    assert canonical_segments("decoder.layers.3.mlp.router.expert_bias", (8,), MOE)[0].name == \
        "decoder.layers.3.mlp.router.expert_bias"
    bias = canonical_segments("decoder.layers.3.mlp.experts.linear_fc2.bias1", (16,), MOE, Ranks(0, 1, 1, 2))
    assert bias[0].name == "decoder.layers.3.mlp.experts.local_experts.5.linear_fc2.bias"


def test_family_from_config_features():
    flags = dict(moe=False, mla=False, qk_norm=False, qkv_bias=False, shared_experts=False, shared_gate=False)
    assert megatron_family(**flags) == "llama"
    assert megatron_family(**{**flags, "qkv_bias": True}) == "qwen2"
    assert megatron_family(**{**flags, "qk_norm": True}) == "qwen3"
    assert megatron_family(**{**flags, "moe": True}) == "mixtral"
    assert megatron_family(**{**flags, "moe": True, "qk_norm": True}) == "qwen3_moe"
    assert megatron_family(**{**flags, "moe": True, "shared_experts": True, "shared_gate": True}) == "qwen2_moe"
    assert megatron_family(**{**flags, "moe": True, "mla": True, "shared_experts": True}) == "deepseek_v3"


def megatron_parameters(m: ModelConfig):
    """(Megatron name, global shape, partition dim) of every parameter and persistent buffer of a
    megatron-core GPTModel with these sizes, local spec, TP1/EP1 (as its named_parameters list them)."""
    d = m.dims
    out = [("embedding.word_embeddings.weight", (d.vocab, d.hidden), 0), ("decoder.final_layernorm.weight", (d.hidden,), None)]
    if not d.tied:
        out.append(("output_layer.weight", (d.vocab, d.hidden), 0))
    for i in range(m.layers):
        p = f"decoder.layers.{i}."
        out += [(p + "input_layernorm.weight", (d.hidden,), None), (p + "pre_mlp_layernorm.weight", (d.hidden,), None)]
        if d.mla:
            qk = m.qk_nope_dim + m.qk_rope_dim
            out += [(p + "self_attention.linear_q_down_proj.weight", (m.q_lora_rank, d.hidden), 0),
                    (p + "self_attention.q_layernorm.weight", (m.q_lora_rank,), None),
                    (p + "self_attention.linear_q_up_proj.weight", (d.heads * qk, m.q_lora_rank), 0),
                    (p + "self_attention.linear_kv_down_proj.weight", (m.kv_lora_rank + m.qk_rope_dim, d.hidden), 0),
                    (p + "self_attention.kv_layernorm.weight", (m.kv_lora_rank,), None),
                    (p + "self_attention.linear_kv_up_proj.weight", (d.heads * (m.qk_nope_dim + m.v_head_dim), m.kv_lora_rank), 0),
                    (p + "self_attention.linear_proj.weight", (d.hidden, d.heads * m.v_head_dim), 1)]
        else:
            qkv = (d.heads + 2 * d.groups) * d.head_dim
            out += [(p + "self_attention.linear_qkv.weight", (qkv, d.hidden), 0),
                    (p + "self_attention.linear_proj.weight", (d.hidden, d.heads * d.head_dim), 1)]
            if d.family in ("qwen2", "qwen2_moe"):
                out.append((p + "self_attention.linear_qkv.bias", (qkv,), 0))
            if d.family in ("qwen3", "qwen3_moe"):
                out += [(p + "self_attention.q_layernorm.weight", (d.head_dim,), None),
                        (p + "self_attention.k_layernorm.weight", (d.head_dim,), None)]
        if not d.experts or i in m.dense_layers:
            out += [(p + "mlp.linear_fc1.weight", (2 * d.ffn, d.hidden), 0), (p + "mlp.linear_fc2.weight", (d.hidden, d.ffn), 1)]
            continue
        out.append((p + "mlp.router.weight", (d.experts, d.hidden), None))
        if d.family == "deepseek_v3":
            out.append((p + "mlp.router.expert_bias", (d.experts,), None))
        for e in range(d.experts):
            out += [(p + f"mlp.experts.local_experts.{e}.linear_fc1.weight", (2 * d.moe_ffn, d.hidden), 0),
                    (p + f"mlp.experts.local_experts.{e}.linear_fc2.weight", (d.hidden, d.moe_ffn), 1)]
        if d.shared_ffn:
            out += [(p + "mlp.shared_experts.linear_fc1.weight", (2 * d.shared_ffn, d.hidden), 0),
                    (p + "mlp.shared_experts.linear_fc2.weight", (d.hidden, d.shared_ffn), 1)]
            if d.family == "qwen2_moe":
                out.append((p + "mlp.shared_experts.gate_weight", (1, d.hidden), None))
    return out


def tiny(family) -> ModelConfig:
    moe = dict(experts=4, moe_ffn=12)
    dims = {"llama": {}, "qwen2": {}, "qwen3": {}, "mixtral": moe, "qwen3_moe": moe,
            "qwen2_moe": {**moe, "shared_ffn": 20}, "deepseek_v3": {**moe, "shared_ffn": 12, "mla": True}}[family]
    extra = dict(q_lora_rank=12, kv_lora_rank=8, qk_nope_dim=4, qk_rope_dim=2, v_head_dim=4) \
        if family == "deepseek_v3" else {}
    return ModelConfig(Dims(hidden=16, ffn=12 if family == "mixtral" else 24, heads=4, groups=2 if family != "deepseek_v3" else 4,
                            head_dim=2 if family == "deepseek_v3" else 4,  # MLA: HF's head_dim is the rope dim
                            vocab=40, family=family, **dims), layers=2, topk=2 if dims else 0, **extra)


@pytest.mark.parametrize("family,dense", [("llama", ()), ("qwen2", ()), ("qwen3", ()), ("mixtral", ()),
                                          ("qwen3_moe", ()), ("qwen3_moe", (0,)), ("qwen2_moe", ()), ("deepseek_v3", (0,))])
def test_megatron_names_are_the_names_transformers_save_pretrained_writes(family, dense, tmp_path):
    """For each family, transformers' own model built from our config.json saves exactly the names
    and shapes the mapping gives a Megatron model of the same sizes (a MoE model's dense layers
    included); the config reads back."""
    import dataclasses
    import transformers
    m = dataclasses.replace(tiny(family), dense_layers=dense)
    config = hf_config(m)
    assert model_config(json.loads(json.dumps(config))) == m
    hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config))
    hf.save_pretrained(tmp_path)
    with safe_open(os.path.join(tmp_path, "model.safetensors"), "pt") as f:
        saved = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    ours = {}
    for name, shape, dim in megatron_parameters(m):
        for seg in canonical_segments(name, shape, m.dims, Ranks(), dim):
            ours[seg.name] = seg.shape
    assert ours == saved


def test_hybrid_pair_patterns_and_moe_layer_frequencies():
    assert hybrid_pairs("*-*E") == [False, True]  # HF layer 0 dense, 1 MoE
    assert hybrid_pairs("*-|*E/*-") == [False, True]  # a pipeline cut; an MTP section is no decoder layer
    assert hybrid_pairs("M*-M") is None and hybrid_pairs("*--") is None and hybrid_pairs("-*") is None
    assert moe_layers([0, 1, 1], 3) == [False, True, True] and moe_layers(2, 4) == [True, False, True, False]


def test_mamba_mixer_fused_projections_reassemble_at_every_tp():
    """in_proj rows are [z, x, B, C, dt] per TP rank and the convolution's channels [x, B, C] (the
    parts megatron's MambaMixer splits them into): each part reshards on its own."""
    dims = Dims(hidden=16, ffn=0, heads=4, groups=4, head_dim=4, vocab=40, family="megatron",
                mamba_heads=8, mamba_head_dim=4, mamba_groups=4, mamba_state=2)
    d_inner, bc = 32, 8
    gen = torch.Generator().manual_seed(1)
    for name, parts, tail in (("decoder.layers.1.mixer.in_proj.weight", [d_inner, d_inner, bc, bc, 8], (16,)),
                              ("decoder.layers.1.mixer.conv1d_weight", [d_inner, bc, bc], (1, 4)),
                              ("decoder.layers.1.mixer.conv1d_bias", [d_inner, bc, bc], ())):
        blocks = [torch.randn((n,) + tail, generator=gen) for n in parts]
        want = {name: torch.cat(blocks)}
        for tp in (1, 2, 4):
            pieces = []
            for rank in range(tp):
                local = torch.cat([b.chunk(tp)[rank] for b in blocks])
                pieces += cut(name, local, dims, Ranks(rank, tp), 0)
            assert torch.equal(reassemble(want, pieces)[name], want[name]), (name, tp)
    # a hybrid's other layers keep their Megatron names
    assert canonical_segments("decoder.layers.2.self_attention.linear_proj.weight", (16, 16), dims, Ranks(), 1)[0].name \
        == "decoder.layers.2.self_attention.linear_proj.weight"
    assert canonical_segments("decoder.final_norm.weight", (16,), dims)[0].name == "model.norm.weight"
