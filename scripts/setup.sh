#!/usr/bin/env bash
# Fresh machine -> working install in .venv, then a demo save -> reshard -> load.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
# torch first and pinned on every line: an unpinned torch would pull several GB of CUDA wheels.
.venv/bin/pip install -q -c constraints.txt torch==2.13.0
.venv/bin/pip install -q -c constraints.txt -e ".[test]"
.venv/bin/python examples/demo.py
