"""`bcp import-megatron`: registered with the core's `bcp` through an entry point."""
from __future__ import annotations


def cmd_import(args) -> int:
    from ckpt_plugins.ext import progress_bar

    from .native import import_megatron
    progress = progress_bar(0, "import")
    metadata = import_megatron(args.megatron_dir, args.path, weights_only=args.weights_only,
                               overwrite=args.overwrite, progress=progress.update, hf_config_path=args.hf_config)
    progress.close()
    layout = metadata.layout
    where = f"Megatron TP{layout['tp']} x PP{layout['pp']} x EP{layout['ep']}, " if "tp" in layout else ""
    print(f"wrote checkpoint {args.path}: {len(metadata.tensors)} tensors, {metadata.total_bytes:,} bytes "
          f"({where}iteration {metadata.step})")
    return 0


def register(sub) -> None:
    p = sub.add_parser("import-megatron", help="turn a native Megatron torch_dist checkpoint into a ckpt_plugins "
                                               "checkpoint under the HF family's names (no GPU, no process group)")
    p.add_argument("megatron_dir", help="an iter_NNNNNNN directory, or the save dir holding "
                                        "latest_checkpointed_iteration.txt")
    p.add_argument("path")
    p.add_argument("--weights-only", action="store_true",
                   help="import the weights only (optimizer state in a format other than dp_reshardable)")
    p.add_argument("--hf-config", metavar="CONFIG_JSON",
                   help="the model's HF config.json: its sizes, for a checkpoint without run arguments (written by "
                        "megatron.core.dist_checkpointing.save outside megatron.training: Megatron-Bridge, NeMo)")
    p.add_argument("--overwrite", action="store_true", help="replace a committed checkpoint at PATH")
    p.set_defaults(func=cmd_import)
