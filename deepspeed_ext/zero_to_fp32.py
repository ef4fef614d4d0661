#!/usr/bin/env python
"""zero_to_fp32.py for checkpoints saved through ckpt_plugins.

A DeepSpeed run whose config has "checkpoint": {"backend": "bytecheckpoint"} saves ckpt_plugins
checkpoints, which DeepSpeed's own zero_to_fp32.py cannot read. The plugin writes this script
where DeepSpeed writes its own (the save directory, beside `latest`), with the same arguments and
the same result: the model's fp32 weights in `output_dir`, here always as safetensors (the fp32
masters where the checkpoint has them, frozen parameters included). It runs `bcp export` and
prints that command, which does the same for any ckpt_plugins checkpoint:

    python zero_to_fp32.py . out/            # or: bcp zero-to-fp32 . out/
"""
import argparse
import os
import shlex
import sys


def export_args(checkpoint_dir: str, output_dir: str, tag=None, max_shard_size: str = "5GB",
                dtype: str = "float32") -> list:
    """The `bcp export` arguments that write the checkpoint's weights in `dtype` (`tag`: the one
    `latest` names)."""
    if tag is None:
        latest = os.path.join(checkpoint_dir, "latest")
        if not os.path.isfile(latest):
            raise ValueError(f"no 'latest' file in {checkpoint_dir}: pass the checkpoint's tag with -t")
        with open(latest) as f:
            tag = f.read().strip()
    return ["export", os.path.join(checkpoint_dir, tag), output_dir, "--dtype", dtype,
            "--max-shard-size", max_shard_size]


def parser(prog: str, description: str) -> argparse.ArgumentParser:
    """The arguments DeepSpeed's scripts take (zero_to_torch.py adds --dtype)."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("checkpoint_dir", help="the save directory (holding `latest`), e.g. path/checkpoint-12")
    parser.add_argument("output_dir", help="where the weights go")
    parser.add_argument("--max_shard_size", default="5GB", help="largest safetensors file (default 5GB)")
    parser.add_argument("--safe_serialization", action="store_true", help="accepted: the output is always safetensors")
    parser.add_argument("-t", "--tag", default=None, help="the checkpoint's tag, e.g. global_step1 (default: latest)")
    parser.add_argument("--exclude_frozen_parameters", action="store_true",
                        help="not supported: frozen parameters are written too")
    parser.add_argument("-d", "--debug", action="store_true", help="accepted, no effect")
    return parser


def run(args, dtype: str) -> int:
    """Export the weights `args` name in `dtype` ("float32", "bfloat16" or "float16")."""
    if args.exclude_frozen_parameters:
        print("note: --exclude_frozen_parameters is ignored; frozen parameters are written too", file=sys.stderr)
    try:
        command = export_args(args.checkpoint_dir, args.output_dir, args.tag, args.max_shard_size, dtype)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print("this checkpoint is a ckpt_plugins checkpoint; running: bcp " + " ".join(map(shlex.quote, command)))
    from ckpt_plugins.ext import bcp
    return bcp(command)


def main(argv=None) -> int:
    return run(parser("zero_to_fp32.py", __doc__.split("\n\n")[0]).parse_args(argv), "float32")


if __name__ == "__main__":
    sys.exit(main())
