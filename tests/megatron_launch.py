"""Run a Megatron script on CPU under the tests' shim: `torchrun ... tests/megatron_launch.py SCRIPT ARGS...`.
Megatron calls CUDA where a GPU run would; `megatron_shim` redirects those calls (tests only)."""
import runpy
import sys

import megatron_shim  # this file's directory is first on sys.path

megatron_shim.install()  # before anything imports megatron
script = sys.argv.pop(1)
sys.argv[0] = script
runpy.run_path(script, run_name="__main__")
