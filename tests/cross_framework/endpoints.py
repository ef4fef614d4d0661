"""The frameworks a checkpoint travels through, built over one of two tiny models whose configs are
equivalent everywhere: a Llama (Megatron GPTModel: local spec, RMSNorm, SwiGLU, RoPE, untied;
transformers' LlamaForCausalLM) or a Qwen3-MoE (4 experts, top-2, q/k norms, no auxiliary loss:
Megatron's MoE layer with SequentialMLP experts; transformers' Qwen3MoeForCausalLM, its experts
fused). Every endpoint gives the ckpt_plugins state of its job (handlers), one training step on the
same global batches, and its world size.

Optimizers agree everywhere: AdamW, lr 1e-2, betas (0.9, 0.95), eps 1e-8, weight decay 0.1 except on
1-D parameters (norms), gradients clipped to norm 1.0; Megatron's choices, made explicit elsewhere.
"""
from __future__ import annotations

import os
import re

import torch
import torch.distributed as dist

VOCAB, HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 96, 32, 64, 4, 4, 2
EXPERTS, TOPK, MOE_FFN = 4, 2, 24
LR, BETAS, EPS, WD, CLIP = 1e-2, (0.9, 0.95), 1e-8, 0.1, 1.0

# model -> endpoint name -> world size
WORLD = {"llama": {"megatron_tp2pp2": 4, "megatron_tp1": 1, "ds_zero1": 2, "ds_zero3": 2, "fsdp1": 2, "fsdp2": 2,
                   "ddp": 2, "single": 1},
         "qwen3_moe": {"megatron_ep2": 2, "ds_zero1": 2, "ds_zero3": 2, "ds_autoep2": 2, "fsdp1": 2, "fsdp2": 2,
                       "ddp": 2, "single": 1}}
TORCH_SCHEDULER = {"ds_zero1", "ds_zero3", "ds_autoep2", "fsdp1", "fsdp2", "ddp", "single"}


def hf_model(model: str, seed: int):
    """transformers' model of that kind, its weights drawn from `seed`."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                  num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=64,
                  tie_word_embeddings=False, rms_norm_eps=1e-5, rope_theta=10000.0)
    if model == "llama":
        return LlamaForCausalLM(LlamaConfig(**common))
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**common, head_dim=HIDDEN // HEADS, num_experts=EXPERTS,
                                              num_experts_per_tok=TOPK, moe_intermediate_size=MOE_FFN,
                                              norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[]))


def decoder_layer(model: str):
    """transformers' decoder-layer class: the FSDP unit."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeDecoderLayer
    return LlamaDecoderLayer if model == "llama" else Qwen3MoeDecoderLayer


def param_groups(model, vectors):
    """Weight decay on matrices only, as Megatron does. `vectors`: the 1-D parameters' canonical
    names, taken before wrapping (FSDP1 flattens every parameter it owns)."""
    from ckpt_plugins._src.state import canonical_name
    named = [(canonical_name(n.replace("module.", "", 1) if n.startswith("module.") else n), p)
             for n, p in model.named_parameters()]
    return [{"params": [p for n, p in named if n not in vectors], "weight_decay": WD},
            {"params": [p for n, p in named if n in vectors], "weight_decay": 0.0}]


def vectors_of(model) -> set:
    return {n for n, p in model.named_parameters() if p.dim() <= 1}


def adamw(model, vectors):
    return torch.optim.AdamW(param_groups(model, vectors), lr=LR, betas=BETAS, eps=EPS)


def batch(index: int) -> torch.Tensor:
    """Global batch `index`, the one megatron_util trains on: [4, 13] token ids."""
    import megatron_util
    return megatron_util.global_batch(index, VOCAB)


def _my_rows(rows: torch.Tensor) -> torch.Tensor:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return rows
    return rows.chunk(dist.get_world_size())[dist.get_rank()]


def _global_mean(loss: torch.Tensor, rows: int, total: int) -> float:
    value = loss.detach().float().reshape(1) * rows
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(value)
    return value.item() / total


class Endpoint:
    """One framework's job: `state` (what cp.save/cp.load take), `step(i)` -> global mean loss."""
    name: str
    scheduler = None

    def step(self, index: int) -> float:
        raise NotImplementedError

    def weights_state(self) -> dict:
        """What a weights-only load (an HF model) fills: the weights, and masters that follow them."""
        return {"model": self.state["model"]}


class HFEndpoint(Endpoint):
    """A plain, DDP, FSDP1 or FSDP2 transformers model with torch AdamW and a torch LR scheduler."""

    def __init__(self, name: str, seed: int, model_kind: str):
        self.name = name
        model = hf_model(model_kind, seed)
        vectors = vectors_of(model)
        if name == "fsdp1":
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
            from torch.distributed.fsdp.wrap import ModuleWrapPolicy
            import hf_ext  # noqa: F401  (registers the FSDP1 handler)
            model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({decoder_layer(model_kind)}),
                         device_id=torch.device("cpu"), use_orig_params=True)
        elif name == "fsdp2":
            from torch.distributed.fsdp import fully_shard
            for layer in model.model.layers:
                fully_shard(layer)
            model = fully_shard(model)
        elif name == "ddp":
            model = torch.nn.parallel.DistributedDataParallel(model)
        self.model, self.optimizer = model, adamw(model, vectors)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: 1.0)
        self.state = {"model": self.model, "optim": self.optimizer, "sched": self.scheduler}

    def step(self, index: int) -> float:
        rows = batch(index)
        mine = _my_rows(rows)
        loss = self.model(input_ids=mine, labels=mine).loss
        loss.backward()
        if self.name == "fsdp1":
            self.model.clip_grad_norm_(CLIP)
        else:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), CLIP)
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.scheduler.step()
        return _global_mean(loss, mine.shape[0], rows.shape[0])


class DeepSpeedEndpoint(Endpoint):
    """ZeRO-1 or ZeRO-3 over the transformers model, or AutoEP (experts regrouped over 2 EP ranks)
    with ZeRO-2."""

    def __init__(self, name: str, seed: int, model_kind: str):
        import deepspeed_ext
        from deepspeed_ext.engine import engine_state
        import ds_util
        self.name = name
        os.environ.setdefault("LOCAL_RANK", str(dist.get_rank()))  # DeepSpeed insists; the group exists already
        ds_util.cpu_friendly_deepspeed()
        model = hf_model(model_kind, seed)
        world = dist.get_world_size()
        groups = param_groups(model, vectors_of(model))
        config = {"train_micro_batch_size_per_gpu": 4 // world, "gradient_accumulation_steps": 1,
                  "zero_optimization": {"stage": {"ds_zero1": 1, "ds_zero3": 3, "ds_autoep2": 2}[name]},
                  "zero_allow_untested_optimizer": True, "gradient_clipping": CLIP, "steps_per_print": 10**9,
                  "checkpoint": {"backend": "bytecheckpoint"}}
        if name == "ds_autoep2":
            ds_util.autoep_compatible_transformers()
            config["expert_parallel"] = {"enabled": True, "autoep_size": 2, "use_grouped_mm": False}
            groups = ds_util.autoep_groups(model, groups, 2)
        optimizer = torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
        self.engine, *_ = deepspeed_ext.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                                   config=config)
        self.scheduler = self.engine.lr_scheduler
        self.state = {k: v for k, v in engine_state(self.engine).items() if k != "engine"}
        if name == "ds_autoep2":  # AutoEP did regroup: 2 of the 4 experts per rank, as w1/w2/w3
            w1 = dict(self.engine.module.named_parameters())["model.layers.0.mlp.experts.w1"]
            assert tuple(getattr(w1, "ds_shape", w1.shape)) == (EXPERTS // 2, MOE_FFN, HIDDEN)

    def weights_state(self) -> dict:
        from deepspeed_ext.zero import DeepSpeedOptimizer
        return {"model": self.state["model"], "optim": DeepSpeedOptimizer(self.engine, optimizer_state=False)}

    def step(self, index: int) -> float:
        rows = batch(index)
        mine = _my_rows(rows)
        loss = self.engine(input_ids=mine, labels=mine).loss
        self.engine.backward(loss)
        self.engine.step()
        return _global_mean(loss, mine.shape[0], rows.shape[0])


class MegatronEndpoint(Endpoint):
    """GPTModel at the TP/PP/EP sizes its name says (`megatron_tp2pp2`, `megatron_ep2`), with the
    distributed optimizer on more than one process."""

    def __init__(self, name: str, seed: int, model_kind: str):
        import megatron_util as mu
        from megatron_ext import MegatronModel, MegatronOptimizer
        self.name, self.mu = name, mu
        sizes = {k: int(v) for k, v in re.findall(r"(tp|pp|ep)(\d+)", name)}
        mu.init_parallel(sizes.get("tp", 1), sizes.get("pp", 1), sizes.get("ep", 1))
        distributed = dist.get_world_size() > 1
        moe = None if model_kind == "llama" else {**mu.MOE, "moe_ffn_hidden_size": MOE_FFN, "num_moe_experts": EXPERTS,
                                                  "moe_router_topk": TOPK, "moe_router_load_balancing_type": "none",
                                                  "moe_aux_loss_coeff": 0.0}
        self.model = mu.build_gpt(seed, vocab=VOCAB, hidden=HIDDEN, ffn=FFN, layers=LAYERS, heads=HEADS,
                                  kv_heads=KV_HEADS, distributed_optimizer=distributed, moe=moe)
        self.optimizer = mu.build_optimizer(self.model, lr=LR)
        self.state = {"model": MegatronModel(self.model), "optim": MegatronOptimizer(self.optimizer, self.model)}

    def step(self, index: int) -> float:
        return self.mu.train_step(self.model, self.optimizer, index)

    def close(self):
        self.mu.destroy()


def build(name: str, seed: int, model: str = "llama") -> Endpoint:
    if name.startswith("megatron"):
        return MegatronEndpoint(name, seed, model)
    if name.startswith("ds_"):
        return DeepSpeedEndpoint(name, seed, model)
    return HFEndpoint(name, seed, model)


def close(endpoint: Endpoint) -> None:
    if hasattr(endpoint, "close"):
        endpoint.close()


def pretrain(rank, world, root, name: str, model: str) -> None:
    """Two steps of Megatron job `name`, saved at `root/name` with its config.json: a pre-training
    checkpoint for the post-training tests."""
    from megatron_ext import hf_config_json
    import ckpt_plugins as cp
    endpoint = build(name, 0, model)
    for i in range(2):
        endpoint.step(i)
    cp.save(os.path.join(root, name), {**endpoint.state, "hf_config": hf_config_json(endpoint.model)})
    close(endpoint)


class Tokens(torch.utils.data.Dataset):
    """The rows of global batches first, first + 1, ... as a Trainer's dataset (labels = inputs)."""

    def __init__(self, first: int, batches: int):
        self.first, self.batches = first, batches

    def __len__(self):
        return 4 * self.batches

    def __getitem__(self, i):
        ids = batch(self.first + i // 4)[i % 4]
        return {"input_ids": ids, "labels": ids}
