"""DeepSpeed on CPU for the tests: engines over a tiny Llama, and whole-state snapshots by
canonical name that compare across stages, dtypes and world sizes."""
from __future__ import annotations

import importlib

import torch
import torch.distributed as dist

from hf_models import canonical, tiny_llama

GLOBAL_ROWS = 6  # the global batch: 6 rows split evenly over 1, 2 or 3 ranks


def cpu_friendly_deepspeed() -> None:
    """DeepSpeed's first init_distributed() compiles a shared-memory op training never uses
    (130-165 s here); skip it. Patched on the module object DeepSpeed itself uses."""
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda *a, **k: None


def _stand_in_fused_adam():
    from deepspeed.ops.adam import FusedAdam

    class StandInFusedAdam(FusedAdam):
        """DeepSpeed's FusedAdam as DeepSpeed sees it (stage 0 then runs its FP16_Optimizer), with
        torch's Adam arithmetic instead of the kernel it would compile (minutes, on this CPU)."""

        def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
            torch.optim.Optimizer.__init__(self, params, dict(lr=lr, bias_correction=True, betas=betas, eps=eps,
                                                              weight_decay=weight_decay))
            self.adam_w_mode, self.set_grad_none = 1, True

        @torch.no_grad()
        def step(self, closure=None):
            for group in self.param_groups:
                (b1, b2), lr = group["betas"], group["lr"]
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    state = self.state[p]
                    if not state:
                        state.update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
                    state["step"] += 1
                    state["exp_avg"].mul_(b1).add_(p.grad, alpha=1 - b1)
                    state["exp_avg_sq"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                    denom = (state["exp_avg_sq"].sqrt() / (1 - b2 ** state["step"]) ** 0.5).add_(group["eps"])
                    p.mul_(1 - lr * group["weight_decay"]).addcdiv_(state["exp_avg"], denom,
                                                                   value=-lr / (1 - b1 ** state["step"]))

    return StandInFusedAdam


def __getattr__(name):
    if name == "StandInFusedAdam":  # built on first use: importing DeepSpeed's ops costs seconds
        return _stand_in_fused_adam()
    raise AttributeError(name)


def autoep_compatible_transformers() -> None:
    """DeepSpeed 0.19.8's AutoEP presets key transformers' output-capture registry by a string
    (`auto_ep_presets/base.py` calls `registry.get(key, default)` and `registry[key] = ...`), while
    transformers 5.23's `_CanRecordRegistry` takes a model there: accept string keys as well, as
    the registry dict itself does."""
    from transformers.utils.output_capturing import _CanRecordRegistry
    if getattr(_CanRecordRegistry, "_accepts_strings", False):
        return
    by_model_get, by_model_set = _CanRecordRegistry.get, _CanRecordRegistry.__setitem__

    def get(self, key, *default):
        return dict.get(self, key, *default) if isinstance(key, str) else by_model_get(self, key)

    def setitem(self, key, value):
        return dict.__setitem__(self, key, value) if isinstance(key, str) else by_model_set(self, key, value)

    _CanRecordRegistry.get, _CanRecordRegistry.__setitem__, _CanRecordRegistry._accepts_strings = get, setitem, True


def autoep_groups(model, groups: list, ep_size: int) -> list:
    """`groups` with transformers' fused expert tensors moved into one MoE group, as AutoEP wants:
    the engine swaps them for its grouped local experts in place, and ZeRO partitions a group
    marked `moe` over the expert-data-parallel group it names."""
    experts = {id(p) for n, p in model.named_parameters() if ".mlp.experts." in n}
    out = [{**g, "params": [p for p in g["params"] if id(p) not in experts]} for g in groups]
    moved = [p for g in groups for p in g["params"] if id(p) in experts]
    decay = next(g["weight_decay"] for g in groups if any(id(p) in experts for p in g["params"]))
    return out + [{"params": moved, "weight_decay": decay, "moe": True, "name": f"ep_size_{ep_size}"}]


def config(stage: int, bf16: bool, world: int, backend: bool = True, fp32_accumulation: bool = False) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": GLOBAL_ROWS // world, "gradient_accumulation_steps": 1,
           "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
           "bf16": {"enabled": bf16}, "steps_per_print": 10**9}
    if fp32_accumulation:  # with ZeRO-1 + bf16 this selects DeepSpeed's BF16_Optimizer
        cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    if backend:
        cfg["checkpoint"] = {"backend": "bytecheckpoint"}
    return cfg


def engine(stage: int, bf16: bool, seed: int = 0, backend: bool = True, fp32_accumulation: bool = False,
           extra: dict = None, model=None):
    """A DeepSpeed engine over a tiny Llama with one frozen parameter (or over `model`), AdamW and
    an LR schedule; `extra`: more top-level config sections (a monitor, say)."""
    import deepspeed_ext
    cpu_friendly_deepspeed()
    if model is None:
        model = tiny_llama(seed)
        model.model.layers[0].input_layernorm.weight.requires_grad_(False)  # frozen: must survive too
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1,
                            betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    world = dist.get_world_size() if dist.is_initialized() else 1
    eng, *_ = deepspeed_ext.initialize(model=model, optimizer=opt, lr_scheduler=sched,
                                       config={**config(stage, bf16, world, backend, fp32_accumulation),
                                               **(extra or {})})
    return eng


def step(eng, index: int) -> float:
    """One training step on this rank's share of global batch `index`; the global mean loss."""
    from hf_models import batch
    ids = batch(index, GLOBAL_ROWS)
    world, rank = dist.get_world_size(), dist.get_rank()
    ids = ids[rank::world].to(eng.device)
    loss = eng(input_ids=ids, labels=ids).loss
    eng.backward(loss)
    eng.step()
    total = loss.detach().float().reshape(1) * ids.shape[0]
    dist.all_reduce(total)
    return total.item() / GLOBAL_ROWS


def full_state(eng) -> dict:
    """Weights (training dtype), fp32 masters, Adam moments and step, whole, by canonical name
    (collective: every rank calls it)."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    stage3 = eng.zero_optimization_stage() == 3
    out = {}
    base = getattr(eng.optimizer, "optimizer", eng.optimizer)
    hp_of = {}  # stage 0 in bf16 (FP16_UnfusedOptimizer): one fp32 copy per parameter
    for lp_group, hp_group in zip(getattr(eng.optimizer, "fp16_groups", []), getattr(eng.optimizer, "fp32_groups", [])):
        if eng.zero_optimization_stage() == 0:
            hp_of.update((id(lp), hp) for lp, hp in zip(lp_group, hp_group))
    for n, p in eng.module.named_parameters():
        name = canonical(n)
        if stage3:
            with deepspeed.zero.GatheredParameters([p]):
                weight = p.detach().clone()
        else:
            weight = p.detach().clone()
        out[f"w/{name}"] = weight
        if not p.requires_grad:
            continue
        hp = hp_of.get(id(p), p)
        master = safe_get_full_fp32_param(p)
        out[f"m/{name}"] = (master if master is not None else hp).detach().float().clone()
        for key in ("exp_avg", "exp_avg_sq") if base.state else ():  # (none before a step or a load)
            value = safe_get_full_optimizer_state(p, key)
            out[f"o/{name}/{key}"] = (value if value is not None else base.state[hp][key]).detach().clone()
    if base.state:
        out["step"] = next(iter(base.state.values()))["step"].clone()
    out["lr"] = base.param_groups[0]["lr"]
    return out


def assert_same_training_state(ref: dict, got: dict, same_dtype: bool = True) -> None:
    """Masters, moments, step equal bit for bit; weights too when the dtypes match (a bf16 -> fp32
    load takes the masters as weights)."""
    assert sorted(ref) == sorted(got), sorted(set(ref) ^ set(got))
    for key in ref:
        a, b = ref[key], got[key]
        if key.startswith("w/") and not same_dtype:
            name = key[2:]
            a = ref.get(f"m/{name}", a).to(b.dtype) if f"m/{name}" in ref else a.to(b.dtype)
        if isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), (key, a.dtype, b.dtype)
        else:
            assert a == b, (key, a, b)
