#!/usr/bin/env bash
# Which commit changed a bench row, on one GPU machine: the same `raytrain.tools.bench` arguments run from the
# tree of each commit, in order, then the first and the last again (one machine's spread). Session 50 ran it on
# 1.1B at micro-batch 4 x GA 4 (ZeRO-3, fused layers), 66.6k tokens/s where the row of 2026-12-02 measured
# 37.2k: every commit from then to now ran 66.4-66.7k, so the machine, not the code, had changed
# (benchmarks/results/2026-12-05-h200/s50-bisect; docs/benchmarks.md, "a host that keeps up").
#   here:            bash benchmarks/host_bisect.sh prepare 857bcfc 222c566 0007be5 HEAD   # trees into .gpu/trees
#   on the GPU host: source .gpu/setup.sh; bash .gpu/trees/host_bisect.sh run                # (~2 min)
set -u
case ${1:?prepare COMMIT... | run} in
prepare)
  shift; root=$(git rev-parse --show-toplevel); rm -rf "$root/.gpu/trees"; mkdir -p "$root/.gpu/trees"
  for c in "$@"; do
    mkdir -p "$root/.gpu/trees/$c" && git -C "$root" archive "$c" raytrain pyproject.toml | tar -x -C "$root/.gpu/trees/$c"
    echo "$c" >> "$root/.gpu/trees/order"
  done
  cp "$0" "$root/.gpu/trees/host_bisect.sh" ;;
run)
  D=$(cd "$(dirname "$0")" && pwd); W=${OUT:-/tmp/out}/bisect; mkdir -p "$W"; export TORCH_EXTENSIONS_DIR=/tmp/torch_ext
  A=(--paths deepspeed --liger all --steps 4 --warmup-steps 2 --window 2 --micro-batch 4 --grad-accum 4
     --set deepspeed.zero_optimization.reduce_bucket_size=500000000
     --set deepspeed.zero_optimization.stage3_prefetch_bucket_size=200000000
     --set deepspeed.zero_optimization.stage3_param_persistence_threshold=10000000
     --set scaling.cpus_per_worker=14 --no-profile ${BISECT_ARGS:-})
  mapfile -t trees < "$D/order"
  for tree in "${trees[@]}" "${trees[0]}" "${trees[-1]}"; do
    ( cd "$D/$tree" && export PYTHONPATH=/tmp/site:$PWD
      timeout 80 python -m raytrain.tools.bench --out "$W" --label "$tree" --timeout-s 75 "${A[@]}" > "$W/$tree.log" 2>&1
      echo "$tree rc=$?" )
  done
  grep -h "^| " "$W/results.md" | grep -v "^| variant\|^| ---" ;;
esac
