#!/usr/bin/env bash
# The whole test suite (CPU, gloo on 127.0.0.1). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1  # one intra-op thread per process: faster on this 2-core machine
exec .venv/bin/python -m pytest -q --durations=25 "$@"
