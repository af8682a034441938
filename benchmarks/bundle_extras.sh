#!/usr/bin/env bash
# Wheels benchmarks/gpu_x1.sh's optional variants need on the GPU machine, added to the bundle that
# ../shared/gpu/bundle.sh wrote (its setup.sh installs every .whl in the bundle directory).
#   ../shared/gpu/bundle.sh && benchmarks/bundle_extras.sh        # DEST defaults to .gpu
# torchao 0.18.0 (3.4 MB, cp310-abi3 manylinux_2_28: runs on the image's python3.12; its C++ ops need
# torch >= 2.11, the image's): float8 training for `gpu_x1.sh mfu62` (variant 1b-float8).
# accelerate (pure Python): transformers' HfDeepSpeedConfig needs it for model.pretrained=true under ZeRO-3.
set -euo pipefail
DEST=${1:-.gpu}
[ -d "$DEST" ] || { echo "$DEST does not exist: run ../shared/gpu/bundle.sh first"; exit 2; }
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d "$DEST" "torchao==${TORCHAO_VERSION:-0.18.0}"
python3 -m pip download -q --no-deps -d "$DEST" "accelerate==${ACCELERATE_VERSION:-1.15.0}"
du -sh "$DEST"
