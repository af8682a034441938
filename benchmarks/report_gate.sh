#!/usr/bin/env bash
# What ray.train.report costs the training loop when windows are short (raytrain.worker.loop.ReportGate).
# CPU only, a few minutes: the built-in tiny Llama, 2 Ray Train workers, micro-batch 6 x GA 3, seq 128,
# 18 steps (6 untimed), a window every step and every 6 steps, on raytrain's path (Ray Train + Ray Data
# + ZeRO-3 on gloo), then plain DeepSpeed in one process at the same global batch (GA 6) for scale.
#   bash benchmarks/report_gate.sh [OUT_DIR]        # prints results.md; raw records in OUT_DIR
# Before the gate (Ray Train's controller takes one report per worker per 2 s poll, and report()
# blocks while the previous one waits) the window-every-step variant ran at one step per poll.
set -u
OUT=${1:-/tmp/report_gate}; mkdir -p "$OUT"
TINY=(--hidden-size 128 --num-layers 4 --num-heads 4 --num-kv-heads 2 --intermediate-size 352 --vocab-size 320
      --seq-len 128 --micro-batch 6 --steps 12 --warmup-steps 6 --no-profile --set data.num_builtin_documents=400)
for window in 1 6; do
  python -m raytrain.tools.bench --paths raytrain --num-gpus 2 --grad-accum 3 --window "$window" "${TINY[@]}" \
    --label "raytrain-2workers-window$window" --out "$OUT" > "$OUT/raytrain-window$window.log" 2>&1
  echo "raytrain window $window: rc=$?"
done
python -m raytrain.tools.bench --paths deepspeed --num-gpus 1 --grad-accum 6 --window 6 "${TINY[@]}" \
  --label "deepspeed-1process" --out "$OUT" > "$OUT/deepspeed.log" 2>&1
echo "deepspeed: rc=$?"
cat "$OUT/results.md"
