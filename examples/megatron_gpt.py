"""Megatron-core GPT pre-training that checkpoints through ckpt_plugins with Megatron's `--ckpt-backend bytecheckpoint`.

    torchrun --standalone --nproc-per-node 2 examples/megatron_gpt.py --ckpt-dir /tmp/ckpt_megatron_gpt --steps 4
    torchrun --standalone --nproc-per-node 1 examples/megatron_gpt.py --ckpt-dir /tmp/ckpt_megatron_gpt --steps 6

The first trains iterations 1-4 on 2 processes (data parallel, distributed optimizer) and saves iter_0000004; the
second resumes on 1 process from latest_checkpointed_iteration.txt and trains to 6. In a real pretrain_gpt.py, these
lines switch it on (then run with --ckpt-backend bytecheckpoint; --save/--load work as before):

    import megatron_ext.training as bcp
    bcp.install()                                   # before pretrain()
    pretrain(..., extra_args_provider=bcp.add_arguments)

pretrain() requires CUDA, so this example runs what it runs step by step (arguments, parallel state, model,
distributed optimizer, scheduler, Megatron's pipeline schedule, load_checkpoint, save_checkpoint): gloo without a GPU.
`--ckpt-dir` is --save and --load, `--steps` is --train-iters; other Megatron arguments are passed through.
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.transformer.module import Float16Module
from megatron.training import checkpointing, global_vars
from megatron.training.arguments import core_transformer_config_from_args, parse_args, validate_args
from megatron.training.training import (get_megatron_ddp_config, get_megatron_optimizer_config,
                                        get_optimizer_param_scheduler)

import megatron_ext.training as bcp

# A tiny Llama-shaped GPT from Megatron-core's own modules (local layer spec, no Transformer Engine, no fused kernels).
TINY_GPT = ("--num-layers 2 --hidden-size 32 --ffn-hidden-size 64 --num-attention-heads 4 --group-query-attention "
            "--num-query-groups 2 --seq-length 12 --max-position-embeddings 12 --vocab-size 96 --micro-batch-size 1 "
            "--global-batch-size 4 --lr 0.01 --min-lr 0.001 --lr-decay-style cosine --bf16 --use-distributed-optimizer "
            "--swiglu --normalization RMSNorm --position-embedding-type rope --disable-bias-linear "
            "--untie-embeddings-and-output-weights --transformer-impl local --use-cpu-initialization "
            "--hidden-dropout 0 --attention-dropout 0 --no-bias-dropout-fusion --no-bias-swiglu-fusion "
            "--no-rope-fusion --no-masked-softmax-fusion --no-gradient-accumulation-fusion --no-persist-layer-norm "
            # The schedule's length must not follow --train-iters, which a resume changes: Megatron refuses a
            # checkpoint whose scheduler lengths differ unless told to take the arguments' values.
            "--lr-decay-iters 100 --override-opt-param-scheduler").split()
EVAL_SEED = 10**6  # the held-out batch: never a training iteration's


def batch(seed, args, device):
    """Synthetic token ids, [global batch, seq + 1], the same for every world size."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, args.vocab_size, (args.global_batch_size, args.seq_length + 1), generator=gen).to(device)


def gpt_inputs(tokens):
    """GPTModel's inputs and labels: next-token prediction with a causal mask (True = masked)."""
    b, s = tokens.shape[0], tokens.shape[1] - 1
    positions = torch.arange(s, device=tokens.device).expand(b, s)
    mask = torch.ones(s, s, dtype=torch.bool, device=tokens.device).triu(1).view(1, 1, s, s)
    return tokens[:, :-1], positions, mask, tokens[:, 1:]


def forward_step(data_iterator, model):
    ids, positions, mask, labels = gpt_inputs(next(data_iterator))
    per_token = model(ids, positions, mask, labels=labels)  # the GPTModel computes the cross entropy itself

    def loss_func(output):
        loss = output.float().mean()
        return loss, {"loss": loss.detach().clone()}  # clone: the schedule scales `loss` in place

    return per_token, loss_func


def train_step(model, optimizer, scheduler, args, iteration, device):
    """One iteration as Megatron's train_step runs it; returns the loss averaged over the global batch."""
    dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    rows = batch(iteration, args, device).chunk(dp)[dp_rank]  # this DP rank's share of the iteration's batch
    micro = rows.split(args.micro_batch_size)
    model.zero_grad_buffer()
    optimizer.zero_grad()
    losses = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(micro), model=[model], num_microbatches=len(micro),
        seq_length=args.seq_length, micro_batch_size=args.micro_batch_size, forward_only=False)
    optimizer.step()
    scheduler.step(increment=args.global_batch_size)
    args.consumed_train_samples += args.global_batch_size  # saved in the checkpoint, as train() does
    loss = torch.stack([d["loss"] for d in losses]).mean()
    dist.all_reduce(loss, group=parallel_state.get_data_parallel_group())
    return loss.item() / dp


@torch.no_grad()
def eval_loss(model, args, device):
    """The loss of a fixed held-out batch, whole, on every rank: the same for any DP size (another TP size changes
    the order of reductions, so only about the same; pipeline parallelism would need the schedule here too)."""
    ids, positions, mask, labels = gpt_inputs(batch(EVAL_SEED, args, device))
    model.eval()
    loss = model(ids, positions, mask, labels=labels).float().mean().item()
    model.train()
    return loss


def main():
    ours = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ours.add_argument("--ckpt-dir", required=True, help="Megatron's --save and --load")
    ours.add_argument("--steps", type=int, required=True, help="Megatron's --train-iters")
    opts, passthrough = ours.parse_known_args()
    cuda = torch.cuda.is_available()
    # Megatron parses sys.argv; the arguments passed through come last, so they win
    sys.argv = [sys.argv[0], *TINY_GPT, "--distributed-backend", "nccl" if cuda else "gloo",
                "--ckpt-backend", "bytecheckpoint", "--ckpt-verify", "--save", opts.ckpt_dir, "--load", opts.ckpt_dir,
                "--train-iters", str(opts.steps), "--save-interval", str(opts.steps), *passthrough]

    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # Megatron's requirement for TP, as its scripts set
    bcp.install()  # before any load_checkpoint/save_checkpoint call, as before pretrain()
    args = parse_args(extra_args_provider=bcp.add_arguments)  # Megatron's parser, with --ckpt-backend added
    validate_args(args)
    global_vars.set_args(args)  # what save_checkpoint/load_checkpoint read

    if cuda:
        torch.cuda.set_device(args.local_rank)
    device = torch.cuda.current_device() if cuda else "cpu"
    dist.init_process_group(args.distributed_backend)  # torchrun's environment
    parallel_state.initialize_model_parallel(args.tensor_model_parallel_size, args.pipeline_model_parallel_size)
    torch.manual_seed(args.seed)
    model_parallel_cuda_manual_seed(args.seed)  # Megatron's TP RNG tracker: initialisation, dropout

    config = core_transformer_config_from_args(args)
    gpt = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(normalization=args.normalization),
                   vocab_size=args.vocab_size, max_sequence_length=args.max_position_embeddings,
                   position_embedding_type=args.position_embedding_type,
                   share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                   pre_process=parallel_state.is_pipeline_first_stage(),
                   post_process=parallel_state.is_pipeline_last_stage())
    if cuda:
        gpt.cuda()
    module = Float16Module(config, gpt) if args.bf16 or args.fp16 else gpt
    model = DistributedDataParallel(config=config, ddp_config=get_megatron_ddp_config(args), module=module)
    opt_config, overrides = get_megatron_optimizer_config(args)
    optimizer = get_megatron_optimizer(opt_config, [model], config_overrides=overrides)
    scheduler = get_optimizer_param_scheduler(optimizer)
    config.no_sync_func, config.finalize_model_grads_func = model.no_sync, finalize_model_grads  # DP grad reduction

    # as setup_model_and_optimizer() does: iteration 0 when --load holds no checkpoint yet
    args.iteration, args.num_floating_point_operations_so_far = checkpointing.load_checkpoint(
        [model], optimizer, scheduler, checkpointing_context={})
    rank0 = dist.get_rank() == 0
    if args.iteration:
        loss = eval_loss(model, args, device)  # every rank: TP ranks compute it together
        if rank0:
            print(f"resumed at step {args.iteration} on {dist.get_world_size()} processes")
            print(f"eval loss {loss!r}")

    iteration = args.iteration
    while iteration < args.train_iters:
        iteration += 1
        loss = train_step(model, optimizer, scheduler, args, iteration, device)
        if rank0:
            print(f"step {iteration} loss {loss!r}")

    loss = eval_loss(model, args, device)
    if rank0:
        print(f"eval loss {loss!r}")
    # as train() calls it (through save_checkpoint_and_time)
    checkpointing.save_checkpoint(iteration, [model], optimizer, scheduler, args.num_floating_point_operations_so_far,
                                  checkpointing_context={})
    if rank0:
        print(f"saved step {iteration}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
