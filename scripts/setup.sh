#!/usr/bin/env bash
# Fresh machine -> working install in .venv (core, every framework extension, tests), then a demo
# save -> reshard -> load.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
pip() { .venv/bin/pip install -q -c constraints.txt "$@"; }
# torch first and pinned on every line: an unpinned torch would pull several GB of CUDA wheels.
pip torch==2.13.0
# HF side and DeepSpeed. DeepSpeed is an sdist whose build imports torch: no build isolation (else
# the build pulls a CUDA torch), no ops compiled (DS_BUILD_OPS=0; tests use torch's AdamW).
pip numpy "packaging>=24.2" psutil
DS_BUILD_OPS=0 pip --no-build-isolation deepspeed==0.19.8 "transformers>=5,<6" accelerate==1.15.0 safetensors peft==0.21.2
# megatron-core 0.19.2 declares Requires-Python >= 3.12 but its wheel is built for 3.11 and runs on
# it; with its dependencies resolved pip would pick a numpy sdist that needs 3.12, so --no-deps.
pip --no-deps --ignore-requires-python megatron-core==0.19.2
pip -e ".[test,docs]"
.venv/bin/python examples/demo.py
