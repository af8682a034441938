#!/usr/bin/env bash
# FlashAttention-4's wheels for the GPU machine (python 3.12, CUDA 13), in two parts that each fit one device call's
# 64 MiB carry: .fa4/a (39 MiB) and .fa4/b (41 MiB). The CUDA 13 libraries of nvidia-cutlass-dsl are a 92 MB wheel,
# 61 MiB as tar.xz (~3 min of xz here). Add .fa4/ to .git/info/exclude. Install there with benchmarks/fa4_setup.sh.
#   bash benchmarks/fa4_bundle.sh [DEST=.fa4]
set -euo pipefail
DEST=${1:-.fa4}
DSL=4.8.1
plat=(--python-version 3.12 --only-binary=:all: --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
# the versions measured on 2026-12-06 (flash-attn-4's own requirements, with cuda-bindings for CUDA 13)
python3 -m pip download -q --no-deps "${plat[@]}" -d "$tmp/w" flash-attn-4==4.0.0b40 nvidia-cutlass-dsl==$DSL \
  nvidia-cutlass-dsl-libs-base==$DSL nvidia-cutlass-dsl-libs-core==$DSL apache-tvm-ffi==0.1.15.post2 \
  torch-c-dlpack-ext==0.1.5 quack-kernels==0.6.5 einops==0.8.2 cuda-bindings==13.5.0 cuda-pathfinder==1.9.1 \
  protobuf==6.33.6
python3 -m pip download -q --no-deps "${plat[@]}" -d "$tmp/cu13" nvidia-cutlass-dsl-libs-cu13==$DSL
(cd "$tmp/cu13" && unzip -q ./*.whl && rm ./*.whl && tar -cf ../cu13-distinfo.tar ./*.dist-info \
  && tar -cf - nvidia_cutlass_dsl | xz -9 -T2 > ../cu13.tar.xz)
split -b 40000000 "$tmp/cu13.tar.xz" "$tmp/cu13.part."
rm -rf "$DEST/a" "$DEST/b" && mkdir -p "$DEST/a" "$DEST/b"
mv "$tmp/cu13.part.aa" "$DEST/a/" && mv "$tmp/cu13.part.ab" "$tmp/cu13-distinfo.tar" "$tmp"/w/*.whl "$DEST/b/"
du -sh "$DEST/a" "$DEST/b"
