#!/usr/bin/env python
"""zero_to_torch.py for checkpoints saved through ckpt_plugins.

DeepSpeed writes this script beside zero_to_fp32.py: the same conversion, in the `--dtype` asked
for. The plugin writes this one in its place, with the same arguments: the model's weights in that
dtype in `output_dir`, as safetensors, cast from the fp32 masters where the checkpoint has them.
It runs `bcp export --dtype` and prints that command:

    python zero_to_torch.py . out/ --dtype bf16
"""
import sys

if __package__:
    from . import zero_to_fp32
else:  # run from the save directory, beside our zero_to_fp32.py
    import zero_to_fp32

DTYPES = {"float32": "float32", "fp32": "float32", "float16": "float16", "fp16": "float16",
          "bfloat16": "bfloat16", "bf16": "bfloat16"}  # DeepSpeed's names: the export's


def main(argv=None) -> int:
    parser = zero_to_fp32.parser("zero_to_torch.py", __doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=sorted(DTYPES), required=True, help="the weights' dtype")
    args = parser.parse_args(argv)
    return zero_to_fp32.run(args, DTYPES[args.dtype])


if __name__ == "__main__":
    sys.exit(main())
