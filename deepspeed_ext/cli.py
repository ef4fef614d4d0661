"""`bcp import-deepspeed`: registered with the core's `bcp` through an entry point."""
from __future__ import annotations


def cmd_import(args) -> int:
    from ckpt_plugins.ext import progress_bar

    from .native import import_deepspeed
    progress = progress_bar(0, "import")
    metadata = import_deepspeed(args.ds_dir, args.path, overwrite=args.overwrite, progress=progress.update)
    progress.close()
    print(f"wrote checkpoint {args.path}: {len(metadata.tensors)} tensors, {metadata.total_bytes:,} bytes "
          f"(ZeRO stage {metadata.layout['zero_stage']}, {metadata.layout['dp_world_size']} ranks, "
          f"{metadata.layout['dtype']})")
    return 0


def cmd_zero_to_fp32(args) -> int:
    from .zero_to_fp32 import main
    argv = [args.checkpoint_dir, args.output_dir, "--max_shard_size", args.max_shard_size]
    return main(argv + (["-t", args.tag] if args.tag else []))


def register(sub) -> None:
    p = sub.add_parser("zero-to-fp32", help="what DeepSpeed's zero_to_fp32.py does, for a DeepSpeed run that saved "
                                            "through ckpt_plugins: the model's fp32 weights as safetensors")
    p.add_argument("checkpoint_dir", help="the save directory (holding `latest`)")
    p.add_argument("output_dir")
    p.add_argument("-t", "--tag", help="the checkpoint's tag (default: the one `latest` names)")
    p.add_argument("--max-shard-size", dest="max_shard_size", default="5GB")
    p.set_defaults(func=cmd_zero_to_fp32)
    p = sub.add_parser("import-deepspeed", help="turn a native DeepSpeed ZeRO 1-3 checkpoint into a ckpt_plugins "
                                                "checkpoint (no GPU, no process group)")
    p.add_argument("ds_dir", help="a checkpoint tag directory (global_stepN), or the save dir holding `latest`")
    p.add_argument("path")
    p.add_argument("--overwrite", action="store_true", help="replace a committed checkpoint at PATH")
    p.set_defaults(func=cmd_import)
