#!/usr/bin/env bash
# One device call on a 2 x H200 machine (the `run` tool, kind nvidia-h200-x2, carry .gpu):
#   source .gpu/setup.sh; bash benchmarks/gpu_x2.sh
# 1. preflight on 2 GPUs (NVLink collectives), 2. weak scaling of raytrain's full path 1 -> 2 GPUs
# (1.1B Llama, mb 24, Liger, tuned ZeRO-3 thresholds), 3. checkpoint save, sync vs async upload,
# 4. ZeRO++ hpZ + qwZ + qgZ executed and asserted on 2 ranks (benchmarks/gpu_checks.py zeropp; DeepSpeed
# JIT-compiles its quantizer op with nvcc first, a few minutes once per machine).
# Results: $OUT/*.jsonl, $OUT/*.log. Each step has its own timeout so one hang can't eat the call.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export TORCH_EXTENSIONS_DIR=/tmp/torch_ext
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpus.csv" 2>&1
Z=(--set deepspeed.zero_optimization.reduce_bucket_size=500000000
   --set deepspeed.zero_optimization.stage3_prefetch_bucket_size=200000000
   --set deepspeed.zero_optimization.stage3_param_persistence_threshold=10000000)

timeout 100 python -m raytrain.tools.preflight --use-gpu --num-workers 2 --sizes 1M,16M,256M,1G \
  > "$OUT/preflight_2gpu.log" 2>&1; echo "preflight rc=$?" >> "$OUT/status.txt"

for n in 2 1; do
  timeout 170 python -m raytrain.tools.bench --paths raytrain --num-gpus $n --micro-batch 24 --liger all "${Z[@]}" \
    --steps 8 --warmup-steps 4 --window 4 --label "weak-$n" --out "$OUT/bench_$n" > "$OUT/bench_$n.log" 2>&1
  echo "bench $n rc=$?" >> "$OUT/status.txt"
done

LLAMA1B='{hidden_size: 2048, num_hidden_layers: 22, num_attention_heads: 32, num_key_value_heads: 4, intermediate_size: 5632, vocab_size: 32000, max_position_embeddings: 2048}'
for mode in false true; do
  timeout 150 python -m raytrain.main scaling.use_gpu=true scaling.num_workers=1 scaling.cpus_per_worker=4 \
    "model.config=$LLAMA1B" model.liger_kernel=all data.seq_len=2048 data.num_builtin_documents=6000 \
    training.micro_batch_size_per_gpu=24 training.max_steps=16 training.log_every_n_steps=4 \
    checkpoint.every_n_steps=8 checkpoint.num_to_keep=1 checkpoint.upload_async=$mode \
    checkpoint.storage_path=/tmp/ckpt_runs checkpoint.name=async-$mode tracking.tensorboard=false \
    > "$OUT/ckpt_async_$mode.log" 2>&1
  echo "ckpt async=$mode rc=$?" >> "$OUT/status.txt"
  rm -rf /tmp/ckpt_runs
done

timeout 600 torchrun --nproc-per-node 2 benchmarks/gpu_checks.py zeropp > "$OUT/zeropp.log" 2>&1
echo "zeropp rc=$?" >> "$OUT/status.txt"
grep '^GPU_CHECK' "$OUT/zeropp.log" | cut -c11- > "$OUT/zeropp.jsonl"
