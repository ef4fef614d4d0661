"""`bcp export` and `bcp import-hf`: registered with the core's `bcp` through an entry point."""
from __future__ import annotations

import math
import re

import torch

SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)?\s*$", re.IGNORECASE)
UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
         "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str) -> int:
    match = SIZE.match(text)
    unit = (match.group(2) or "").upper() if match else None
    if unit is not None and unit and not unit.endswith("B"):
        unit += "B"
    if not match or unit not in UNITS:
        raise ValueError(f"{text!r} is not a size (examples: 5GB, 500MB, 2GiB, 1000000)")
    return int(float(match.group(1)) * UNITS[unit])


def cmd_export(args) -> int:
    from ckpt_plugins.ext import progress_bar
    from ckpt_plugins.ext import dtype_from_name, open_checkpoint

    from .safetensors_io import export_hf, export_peft
    if args.format == "dcp":
        from ckpt_plugins.ext import export_dcp
        keys = export_dcp(args.path, args.out, optimizer=args.optimizer)
        print(f"wrote a DCP checkpoint to {args.out}: {len(keys)} tensors "
              f"({'model and optimizer' if args.optimizer else 'model'}; dcp.load, then set_state_dict)")
        return 0
    if args.format == "peft":
        files = export_peft(args.path, args.out, args.adapter)
        print(f"wrote adapter {args.adapter!r} to {args.out}: {', '.join(files)}")
        return 0
    _, metadata = open_checkpoint(args.path)
    dtype = getattr(torch, args.dtype) if args.dtype else None
    total = sum(math.prod(t.shape) * (dtype or dtype_from_name(t.dtype)).itemsize
                for k, t in metadata.tensors.items() if k.startswith("model/"))  # the bytes written
    progress = progress_bar(total, "export")
    files = export_hf(args.path, args.out, max_shard_bytes=parse_size(args.max_shard_size), dtype=dtype,
                      merge_adapter=args.adapter if args.merge_adapters else None, progress=progress.update)
    progress.close()
    print(f"wrote {len(files)} file(s) to {args.out}: {', '.join(files)}")
    return 0


def cmd_import_hf(args) -> int:
    import os

    from ckpt_plugins.ext import progress_bar

    from .safetensors_io import import_hf
    progress = progress_bar(sum(os.path.getsize(os.path.join(args.hf_dir, f)) for f in os.listdir(args.hf_dir)
                            if f.endswith(".safetensors")), "import")
    metadata = import_hf(args.hf_dir, args.path, overwrite=args.overwrite, adapter=args.adapter,
                         progress=progress.update)
    progress.close()
    print(f"wrote checkpoint {args.path}: {len(metadata.tensors)} tensors, {metadata.total_bytes:,} bytes")
    return 0


def register(sub) -> None:
    p = sub.add_parser("export", help="write a checkpoint's model weights as an HF model directory "
                                      "(model.safetensors, sharded above --max-shard-size, and config.json), "
                                      "or as a PyTorch DCP checkpoint")
    p.add_argument("path", help="ckpt_plugins checkpoint")
    p.add_argument("out", help="output directory")
    p.add_argument("--format", choices=["hf", "peft", "dcp"], default="hf",
                   help="hf: the model (a PEFT run's base, from the base checkpoint it refers to); peft: one "
                        "adapter as PEFT saves it (adapter_model.safetensors, adapter_config.json); dcp: "
                        "get_state_dict's layout for torch.distributed.checkpoint.load")
    p.add_argument("--optimizer", action="store_true", help="--format dcp: the optimizer's state too")
    p.add_argument("--merge-adapters", action="store_true", help="--format hf: merge the adapter into the weights")
    p.add_argument("--adapter", default="default", help="the PEFT adapter to export or merge (default: default)")
    p.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (default 5GB)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                   help="convert the weights (fp32 masters are used where the checkpoint has them)")
    p.set_defaults(func=cmd_export)
    p = sub.add_parser("import-hf", help="turn an HF model directory (safetensors) into a ckpt_plugins checkpoint")
    p.add_argument("hf_dir")
    p.add_argument("path")
    p.add_argument("--overwrite", action="store_true", help="replace a committed checkpoint at PATH")
    p.add_argument("--adapter", default="default", help="a PEFT adapter directory's adapter name (default: default)")
    p.set_defaults(func=cmd_import_hf)
