"""Megatron-core on CPU for the tests: a tiny GPTModel under TP/PP/DP, megatron's optimizers and
one training step through megatron's pipeline schedule. Call these inside a rank started by
``distributed.run_ranks`` (a gloo group already exists); ``init_parallel`` installs the CPU shim.

Weights are initialised layout-independently: every parameter of the *global* model is drawn
from its own ``torch.Generator`` seeded from (seed, global name), and each rank copies in its
TP slice. Megatron's own CPU init is not layout-independent (each PP stage restarts the same
RNG stream, so a layer's values depend on its position inside its stage).
"""
from __future__ import annotations

import zlib

import torch
import torch.distributed as dist

import megatron_shim

GLOBAL_BATCH = 4  # sequences per step, split over the DP ranks
SEQ_LEN = 12
INIT_STD = 0.02


def init_parallel(tp: int = 1, pp: int = 1, ep: int = 1, etp: int | None = None) -> None:
    """megatron parallel state over the existing gloo group: TP, PP, DP = world / (tp * pp); EP
    and expert-TP (default: TP) split the experts inside TP × DP."""
    megatron_shim.install()
    from megatron.core import parallel_state

    world = dist.get_world_size()
    if world % (tp * pp):
        raise ValueError(f"world size {world} is not a multiple of tp*pp = {tp * pp}")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                             expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
                                             create_gloo_process_groups=True)


def destroy() -> None:
    """Tear down megatron's parallel state (the gloo world group stays for run_ranks)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    get_cuda_rng_tracker().reset()
    parallel_state.destroy_model_parallel()


# A tiny Qwen3-MoE: 4 experts, top-2, q/k norms, softmax routing with an auxiliary loss.
MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=24, qk_layernorm=True,
           moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="aux_loss",
           moe_aux_loss_coeff=1e-3, moe_grouped_gemm=False)


# A tiny DeepSeek-V3: multi-latent attention, one dense layer then MoE layers with a shared expert,
# sigmoid routing steered by the aux-loss-free expert bias.
DSV3 = dict(multi_latent_attention=True, q_lora_rank=16, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4,
            v_head_dim=8, rope_type="rope", qk_layernorm=True, layernorm_epsilon=1e-6, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=24,
            moe_shared_expert_intermediate_size=24, moe_layer_freq=[0, 1, 1, 1], moe_router_enable_expert_bias=True,
            moe_router_score_function="sigmoid", moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
            moe_router_bias_update_rate=1e-2, moe_token_dispatcher_type="alltoall", moe_grouped_gemm=False)


class SDPACoreAttention(torch.nn.Module):
    """Causal attention for multi-latent attention on CPU. Megatron's local DotProductAttention
    takes no separate key/value head sizes, which MLA passes (its GPU path is TE's); this stands in
    for it in tests: [s, b, heads, d] in, [s, b, heads · d_v] out, no parameters."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type=None, softmax_scale=None,
                 k_channels=None, v_channels=None, cp_comm_type=None, pg_collection=None, **kwargs):
        super().__init__()
        self.scale = softmax_scale

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        return out.permute(2, 0, 1, 3).reshape(out.shape[2], out.shape[0], -1)


def layer_spec(config):
    """megatron's local (no TE) layer spec for the config (per layer when dense and MoE layers
    mix): MLA layers get SDPACoreAttention."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
    if not config.multi_latent_attention and not isinstance(config.moe_layer_freq, list):
        return get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False,
                                        qk_layernorm=config.qk_layernorm, normalization="RMSNorm")
    torch._dynamo.config.disable = True  # megatron's MLA / sigmoid-router fusers compile, with no compiler here
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    if config.multi_latent_attention:
        for layer in spec.layer_specs:
            layer.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    return spec


def hybrid_stack_spec(config):
    """A HybridStack spec from the local GPT layer specs: attention layers are a GPT layer without
    its MLP, MLP and MoE layers one without its attention (what megatron's TE hybrid spec does)."""
    import dataclasses

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import MoETransformerLayer, TransformerLayer

    def local(**kw):
        return get_gpt_layer_local_spec(qk_layernorm=config.qk_layernorm, normalization="RMSNorm", **kw).submodules

    no_attention = dict(input_layernorm=IdentityOp, self_attention=IdentityOp, self_attn_bda=IdentityFuncOp)
    return ModuleSpec(module=HybridStack, submodules=HybridStackSubmodules(
        attention_layer=ModuleSpec(module=TransformerLayer, submodules=dataclasses.replace(
            local(), pre_mlp_layernorm=IdentityOp, mlp=IdentityOp, mlp_bda=IdentityFuncOp)),
        mlp_layer=ModuleSpec(module=MLPLayer, submodules=dataclasses.replace(local(), **no_attention)),
        moe_layer=ModuleSpec(module=MoETransformerLayer, submodules=dataclasses.replace(
            local(num_experts=config.num_moe_experts, moe_grouped_gemm=False), **no_attention))))


def transformer_config(hidden=32, ffn=64, layers=4, heads=4, kv_heads=2, dtype=torch.float32, **extra):
    """The tiny model's TransformerConfig; `extra` adds or overrides fields."""
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig
    import torch.nn.functional as F

    ps = _ps()
    fields = dict(
        num_layers=layers, hidden_size=hidden, ffn_hidden_size=ffn, num_attention_heads=heads,
        num_query_groups=kv_heads, tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
        expert_tensor_parallel_size=ps.get_expert_tensor_parallel_world_size(),
        params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16,
        use_cpu_initialization=True, perform_initialization=True, init_method_std=INIT_STD,
        normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0,
        bias_dropout_fusion=False, apply_rope_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False, bias_activation_fusion=False)
    fields.update(extra)
    if fields.get("num_moe_experts") and ps.get_tensor_model_parallel_world_size() > 1:
        fields["sequence_parallel"] = True  # megatron refuses to train MoE with TP but without it
    return (MLATransformerConfig if fields.get("multi_latent_attention") else TransformerConfig)(**fields)


def _ps():
    from megatron.core import parallel_state
    return parallel_state


def build_gpt(seed: int, vocab: int = 96, hidden: int = 32, ffn: int = 64, layers: int = 4, heads: int = 4,
              kv_heads: int = 2, dtype: torch.dtype = torch.float32, tied: bool = False,
              distributed_optimizer: bool = True, moe: dict | None = None, hybrid: str | None = None,
              overlap: bool = False):
    """This rank's piece of a tiny GPTModel (local spec, RMSNorm, SwiGLU, RoPE, no bias), wrapped
    (Float16Module for bf16, then) megatron's DistributedDataParallel. `distributed_optimizer`
    must match build_optimizer's choice: DDP reduce-scatters grads for the distributed optimizer
    and all-reduces them otherwise. `vocab` must be divisible by TP (no padding is added).
    `moe`: TransformerConfig fields making it a mixture of experts (MOE, DSV3), SequentialMLP experts.
    `hybrid`: a HybridModel of this layer pattern (`*` attention, `-` MLP, `E` MoE) instead.
    `overlap`: gradient reduce-scatters overlapped with the backward and (distributed optimizer)
    parameter all-gathers with the next forward, as `--overlap-grad-reduce --overlap-param-gather`."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module

    ps = _ps()
    tp = ps.get_tensor_model_parallel_world_size()
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError("fp32 or bf16 only (fp16 would need a loss scaler)")
    if vocab % tp or kv_heads % tp or ffn % tp:
        raise ValueError("vocab, kv_heads and ffn must be divisible by the TP size")  # see tp_slice
    model_parallel_cuda_manual_seed(seed)
    config = transformer_config(hidden, ffn, len(hybrid) if hybrid else layers, heads, kv_heads, dtype, **(moe or {}))
    common = dict(config=config, vocab_size=vocab, max_sequence_length=SEQ_LEN, pre_process=ps.is_pipeline_first_stage(),
                  post_process=ps.is_pipeline_last_stage(), share_embeddings_and_output_weights=tied,
                  position_embedding_type="rope", parallel_output=True)
    if hybrid:
        from megatron.core.models.hybrid.hybrid_model import HybridModel
        gpt = HybridModel(hybrid_stack_spec=hybrid_stack_spec(config), hybrid_layer_pattern=hybrid, **common)
    else:
        gpt = GPTModel(transformer_layer_spec=layer_spec(config), **common)
    init_weights(gpt, seed)
    gpt.to(device())  # megatron's get_model moves it to the GPU as this does
    module = Float16Module(config, gpt) if dtype == torch.bfloat16 else gpt
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=overlap,
                                               overlap_param_gather=overlap and distributed_optimizer,
                                               use_distributed_optimizer=distributed_optimizer)
    model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=module)
    return model


def unwrap(model):
    """The GPTModel inside DDP (and Float16Module)."""
    from megatron.core.utils import unwrap_model
    return unwrap_model(model)


def global_name(gpt, local_name: str) -> str:
    """`decoder.layers.<local i>.rest` -> `decoder.layers.<global i>.rest` (PP offset applied),
    `local_experts.<local j>` -> `local_experts.<global e>`; other names unchanged. The tied output
    weight on a PP>1 last stage maps to the embedding."""
    parts = local_name.split(".")
    if parts[:2] == ["decoder", "layers"]:
        parts[2] = str(gpt.decoder.layers[int(parts[2])].layer_number - 1)  # layer_number is global, 1-based
    if "local_experts" in parts:
        at = parts.index("local_experts") + 1
        local = gpt.config.num_moe_experts // _ps().get_expert_model_parallel_world_size()
        parts[at] = str(_ps().get_expert_model_parallel_rank() * local + int(parts[at]))
    name = ".".join(parts)
    if name == "output_layer.weight" and gpt.share_embeddings_and_output_weights:
        name = "embedding.word_embeddings.weight"
    return name


def tp_slice(param, name: str, full: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This TP rank's piece of a global tensor, as megatron lays it out locally."""
    if not getattr(param, "tensor_model_parallel", False) or tp_size == 1:
        return full
    dim = param.partition_dim
    if name.endswith("linear_fc1.weight"):  # SwiGLU: global [gate; up], local [gate_r; up_r]
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp_size, 0)[tp_rank], up.chunk(tp_size, 0)[tp_rank]], dim=0)
    # linear_qkv rows are grouped per query group ([q heads, k, v] x groups), so with
    # kv_heads % tp == 0 a rank's groups are a contiguous block of rows.
    return full.chunk(tp_size, dim=dim)[tp_rank]


def global_shape(param, name: str, tp_size: int):
    shape = list(param.shape)
    if getattr(param, "tensor_model_parallel", False):
        shape[param.partition_dim] *= tp_size
    return shape


@torch.no_grad()
def init_weights(gpt, seed: int) -> None:
    """Overwrite every parameter with values drawn for the global model (see module docstring):
    matrices N(0, INIT_STD), norm weights 1 + N(0, 0.1) (not all ones, so a mixed-up norm shows)."""
    ps = _ps()
    for local, param in gpt.named_parameters():
        name = global_name(gpt, local)
        expert = ".experts." in name  # split over expert-TP
        tp_rank = ps.get_expert_tensor_parallel_rank() if expert else ps.get_tensor_model_parallel_rank()
        tp_size = (ps.get_expert_tensor_parallel_world_size() if expert
                   else ps.get_tensor_model_parallel_world_size())
        gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
        shape = global_shape(param, name, tp_size)
        full = torch.randn(shape, generator=gen, dtype=torch.float32)
        full = 1.0 + 0.1 * full if param.dim() == 1 else INIT_STD * full
        param.copy_(tp_slice(param, name, full, tp_rank, tp_size))


def build_optimizer(model, distributed: bool | None = None, lr: float = 1e-2):
    """megatron's optimizer (torch AdamW fallback: no TE/apex): DistributedOptimizer when
    distributed, else FP32Optimizer (fp32) / Float16OptimizerWithFloat16Params (bf16).
    distributed=None follows the DDP config the model was built with."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    built_for = model.ddp_config.use_distributed_optimizer
    if distributed is None:
        distributed = built_for
    if distributed != built_for:
        raise ValueError(f"model was wrapped for use_distributed_optimizer={built_for}")
    cfg = model.config
    ocfg = OptimizerConfig(optimizer="adam", lr=lr, min_lr=lr, weight_decay=0.1, adam_beta1=0.9,
                           adam_beta2=0.95, adam_eps=1e-8, clip_grad=1.0, bf16=cfg.bf16,
                           params_dtype=cfg.params_dtype, use_distributed_optimizer=distributed)
    optimizer = get_megatron_optimizer(ocfg, [model])
    build_scheduler(optimizer, lr, ocfg.weight_decay)  # applies wd_mult: no weight decay on norms
    return optimizer


def build_scheduler(optimizer, lr: float = 1e-2, weight_decay: float = 0.1):
    """megatron's OptimizerParamScheduler with constant lr and weight decay. Constructing it sets
    every param group's lr and weight_decay (times the group's lr_mult / wd_mult: 0 for norms);
    without it the groups keep OptimizerConfig's values. Stepping it changes nothing."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(optimizer, init_lr=lr, max_lr=lr, min_lr=lr, lr_warmup_steps=0,
                                   lr_decay_steps=1, lr_decay_style="constant", start_wd=weight_decay,
                                   end_wd=weight_decay, wd_incr_steps=1, wd_incr_style="constant")


def device() -> torch.device:
    """The GPU where there is one (the CPU shim keeps megatron's CUDA calls on the CPU)."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def global_batch(step_index: int, vocab: int = 96) -> torch.Tensor:
    """The step's token ids, [GLOBAL_BATCH, SEQ_LEN + 1] (inputs are [:, :-1], labels [:, 1:])."""
    gen = torch.Generator().manual_seed(1000 + step_index)
    return torch.randint(0, vocab, (GLOBAL_BATCH, SEQ_LEN + 1), generator=gen)


def _forward_step(data_iterator, model):
    tokens = next(data_iterator)
    ids, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    b, s = ids.shape
    position_ids = torch.arange(s, device=ids.device).unsqueeze(0).expand(b, s)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool, device=ids.device), diagonal=1).view(1, 1, s, s)  # True = masked
    output = model(ids, position_ids, mask, labels=labels)  # last stage: per-token loss [b, s]

    def loss_func(per_token):
        loss = per_token.float().mean()
        return loss, {"loss": loss.detach().clone()}  # clone: the schedule divides `loss` in place

    return output, loss_func


def train_step(model, optimizer, step_index: int, micro_batch_size: int | None = None) -> float:
    """One forward/backward/step through megatron's schedule on batch `step_index` (this DP rank's
    rows); returns the global mean loss (same float on every rank)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.distributed import finalize_model_grads

    ps = _ps()
    dp_rank, dp = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    if GLOBAL_BATCH % dp:
        raise ValueError(f"global batch {GLOBAL_BATCH} does not split over {dp} DP ranks")
    rows = global_batch(step_index, unwrap(model).vocab_size).to(device())
    per_dp = GLOBAL_BATCH // dp
    local = rows[dp_rank * per_dp:(dp_rank + 1) * per_dp]
    pp = ps.get_pipeline_model_parallel_world_size()
    mbs = micro_batch_size or (1 if pp > 1 else min(2, per_dp))
    if per_dp % mbs:
        raise ValueError("micro batch size must divide the per-DP batch")
    n_micro = per_dp // mbs
    micro = iter([local[i * mbs:(i + 1) * mbs] for i in range(n_micro)])

    config = model.config
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = model.no_sync
    model.zero_grad_buffer()
    optimizer.zero_grad()
    losses = get_forward_backward_func()(
        forward_step_func=_forward_step, data_iterator=micro, model=[model], num_microbatches=n_micro,
        seq_length=SEQ_LEN, micro_batch_size=mbs, forward_only=False)
    ok, grad_norm, _ = optimizer.step()
    if not ok:
        raise RuntimeError("optimizer step skipped")

    # Mean over micro-batches on the last stage, then over the last-stage ranks (TP copies agree).
    value = torch.zeros(1, dtype=torch.float64, device=rows.device)
    if ps.is_pipeline_last_stage():
        value += sum(float(d["loss"]) for d in losses) / n_micro
    dist.all_reduce(value)
    last_stage_ranks = dist.get_world_size() // pp
    return value.item() / last_stage_ranks


def assert_losses_continue(model, optimizer, first_step: int, ref, dtype, what) -> None:
    """The next len(ref) steps' losses match the uninterrupted run's `ref`: fp32 within 2e-6
    relative (only the summation order differs between layouts), bf16 within 2e-3 (a layout change
    changes bf16 roundings)."""
    losses = [train_step(model, optimizer, first_step + i) for i in range(len(ref))]
    tol = 2e-6 if dtype == torch.float32 else 2e-3
    for got, want in zip(losses, ref):
        assert abs(got - want) <= tol * abs(want), (what, losses, ref)


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary logits of `ids` (the same on every rank), gathered over TP, in eval mode."""
    ps = _ps()
    b, s = ids.shape
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1).view(1, 1, s, s)
    model.eval()
    with torch.no_grad():
        local = model(ids, torch.arange(s).unsqueeze(0).expand(b, s), mask)
    model.train()
    parts = [torch.empty_like(local) for _ in range(ps.get_tensor_model_parallel_world_size())]
    dist.all_gather(parts, local.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)


def megatron_train_step(model, optimizer, scheduler, step_index: int) -> None:
    """One step through Megatron's own `megatron.training.training.train_step` (what pretrain()
    calls, and what `megatron_ext.training.install()` wraps), on batch `step_index`."""
    from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator, unset_num_microbatches_calculator
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.distributed import finalize_model_grads
    from megatron.training import get_args, global_vars, training

    args = get_args()
    ps = _ps()
    dp_rank, dp = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    mbs = args.micro_batch_size
    unset_num_microbatches_calculator()
    init_num_microbatches_calculator(dist.get_rank(), None, GLOBAL_BATCH, mbs, dp)
    if global_vars._GLOBAL_TIMERS is None:
        global_vars._set_timers(args)
    rows = global_batch(step_index, unwrap(model).vocab_size).to(device())
    per_dp = GLOBAL_BATCH // dp
    local = rows[dp_rank * per_dp:(dp_rank + 1) * per_dp]
    micro = iter([local[i * mbs:(i + 1) * mbs] for i in range(per_dp // mbs)])
    config = model.config
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = model.no_sync
    training.train_step(_forward_step, micro, [model], optimizer, scheduler, config, get_forward_backward_func(),
                        iteration=step_index)
