#!/usr/bin/env bash
# The benchmark's peers, into the project's .venv (after scripts/setup.sh). torch stays pinned.
# ByteCheckpoint 0.0.2 declares torch<=2.5: installed without its dependencies, which are listed
# here; bench/peers/bytecheckpoint_peer.py patches what it needs at run time.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/pip install -q -c constraints.txt --no-deps bytecheckpoint==0.0.2
# protobuf stays as installed: the 3.20.3 it declares broke tensorboard (the suite's Trainer tests),
# and the peer passes its self-test with the newer one.
.venv/bin/pip install -q -c constraints.txt grpcio==1.69.0 "safetensors<=1.0.0" \
    "universal-pathlib>=0.2.2,<=1.0.0" "cachetools>=5.4.0,<=10.0.0" "mmh3>=4.1.0,<=4.2.0"
# bench/compression.py compares with zipnn (a C extension, built here)
.venv/bin/pip install -q -c constraints.txt zipnn==0.5.4
.venv/bin/python bench/peers/bytecheckpoint_peer.py  # self-test: 2 ranks, bit-exact round trips
