"""Megatron's contract with `--ckpt-backend bytecheckpoint`: its own `save_checkpoint`/
`load_checkpoint` (megatron.training.checkpointing, as pretrain() calls them) give what they give
natively (torch_dist): the iter_N directories and the tracker file, the returned iteration and
FLOPs, consumed samples, the scheduler, the resumed step's loss, and the flags --ckpt-step,
--finetune, --no-load-optim, --use-checkpoint-args; with the plugin on, a native checkpoint in
--load (with --auto-detect-ckpt-format) still loads through Megatron's own code."""
import copy
import os

import torch

from distributed import run_ranks
from test_megatron_training import megatron_args


def contract(rank, world, root, result_path):
    seen = {}
    for backend in ("native", "bytecheckpoint"):
        record = seen.setdefault(backend, {})
        save = os.path.join(root, backend)
        args = megatron_args(1, 1, save, "--ckpt-backend", backend)  # (installs the test shim first)
        import megatron_util as mu
        import megatron_ext.training as bcp
        from megatron.training import checkpointing, training
        bcp.install()
        mu.init_parallel(1, 1)
        model = mu.build_gpt(0, dtype=torch.bfloat16)
        opt = mu.build_optimizer(model)
        sched = mu.build_scheduler(opt)
        for iteration in (1, 2):
            mu.megatron_train_step(model, opt, sched, iteration - 1)
            sched.step(increment=4)
            args.consumed_train_samples = 4 * iteration
            training.save_checkpoint(iteration, [model], opt, sched, 10.0 * iteration)
        record["next_loss"] = mu.train_step(model, opt, 2)
        record["tracker"] = open(os.path.join(save, bcp.TRACKER)).read()
        record["dirs"] = sorted(d for d in os.listdir(save) if d.startswith("iter_"))

        def load(**flags):
            for name, value in {"ckpt_step": None, "finetune": False, "no_load_optim": False, **flags}.items():
                setattr(args, name, value)
            args.consumed_train_samples = 0
            fresh = mu.build_gpt(9, dtype=torch.bfloat16)
            opt = mu.build_optimizer(fresh)
            sched = mu.build_scheduler(opt)
            mu.train_step(fresh, opt, 5)  # Megatron's own load fails on an optimizer that never stepped
            result = checkpointing.load_checkpoint([fresh], opt, sched)
            return fresh, opt, (result, args.consumed_train_samples, sched.num_steps)

        fresh, opt, record["load"] = load()
        record["resumed_loss"] = mu.train_step(fresh, opt, 2)
        record["ckpt_step"] = load(ckpt_step=1)[2]
        record["no_load_optim"] = load(no_load_optim=True)[2]
        record["finetune"] = load(finetune=True)[2]
        # --use-checkpoint-args: the model's arguments come back from the checkpoint by Megatron's rules
        other = copy.deepcopy(args)
        other.num_query_groups, other.swiglu, other.ckpt_step = 4, False, None
        checkpointing.load_args_from_checkpoint(other)
        record["checkpoint_args"] = (other.num_query_groups, other.swiglu, other.iteration)
        # a native checkpoint in --load, with --auto-detect-ckpt-format: Megatron's own load, with the
        # plugin on as without it
        args.load, args.auto_detect_ckpt_format = os.path.join(root, "native"), True
        record["native_in_load"] = load()[2]
        mu.destroy()
    if rank == 0:
        torch.save(seen, result_path)


def test_megatron_users_see_the_same_checkpointing_with_the_plugin(tmp_path):
    run_ranks(2, contract, str(tmp_path), tmp_path / "seen.pt")
    seen = torch.load(tmp_path / "seen.pt")
    native, ours = seen["native"], seen["bytecheckpoint"]
    assert native["tracker"] == ours["tracker"] == "2" and native["dirs"] == ours["dirs"] == ["iter_0000001", "iter_0000002"]
    for key in ("load", "ckpt_step", "no_load_optim", "finetune", "checkpoint_args", "next_loss", "resumed_loss",
                "native_in_load"):
        assert ours[key] == native[key], (key, native[key], ours[key])
    assert ours["load"] == ((2, 20.0), 8, 16) and ours["ckpt_step"] == ((1, 10.0), 4, 8)
    assert ours["resumed_loss"] == ours["next_loss"]
    assert ours["native_in_load"] == native["native_in_load"]
