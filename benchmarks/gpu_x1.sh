#!/usr/bin/env bash
# Device calls on a 1 x H200 machine (the `run` tool, kind nvidia-h200, carry .gpu), one per part:
#   source .gpu/setup.sh; bash benchmarks/gpu_x1.sh reader     # then offload, compile, compile-noliger, offload-max
# reader:  raytrain's full path vs plain DeepSpeed (1.1B, mb 24, Liger, tuned ZeRO-3), sampling which
#          processes hold a CUDA context; then micro-batch 32.
# compile: torch.compile and DeepCompile on the plain DeepSpeed path, against the same without;
#          compile-noliger: the same without Liger's kernels (and torch.compile on plain PyTorch).
# offload: raytrain's path with gradient accumulation 4, without and with optimizer offload, the
#          latter with scaling.cpus_per_worker 14 and 1 (CPU Adam runs on the worker's OpenMP threads).
# offload-max: a 6.74B model with optimizer offload, sampling the host's used memory.
# checks:  fp16 (with and without optimizer offload) and bf16 executed and asserted (benchmarks/gpu_checks.py).
# Each variant gets what is left of the part's time budget (BUDGET_S), so one hang cannot eat the
# call; everything lands in $OUT/<part>.tgz (the tool brings back few files) and results.md is printed.
set -u
part=${1:?reader, offload, compile, compile-noliger, checks or offload-max}
OUT=${OUT:-/tmp/out}; W=/tmp/bench_$part; mkdir -p "$OUT" "$W"
END=$(( $(date +%s) + ${BUDGET_S:-560} ))
export TORCH_EXTENSIONS_DIR=/tmp/torch_ext
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$W/gpus.csv" 2>&1
echo "TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST-unset} nproc=$(nproc)" >> "$W/status.txt"
Z=(--liger all --set deepspeed.zero_optimization.reduce_bucket_size=500000000
   --set deepspeed.zero_optimization.stage3_prefetch_bucket_size=200000000
   --set deepspeed.zero_optimization.stage3_param_persistence_threshold=10000000)
GAS4=(--micro-batch 24 --grad-accum 4 --steps 4 --warmup-steps 2 --window 2)

variant() {  # variant NAME MAX_S bench-args...: one bench invocation, bounded by MAX_S and the budget
  local name=$1 max=$2; shift 2
  local left=$(( END - $(date +%s) - 5 ))
  (( left < max )) && max=$left
  if (( max < 30 )); then echo "$name: skipped, budget spent" >> "$W/status.txt"; return; fi
  local t0=$(date +%s)
  timeout "$max" python -m raytrain.tools.bench --out "$W" --label "$name" --timeout-s $(( max - 5 )) "$@" \
    > "$W/$name.log" 2>&1
  echo "$name: rc=$? ${max}s budget, took $(( $(date +%s) - t0 ))s" >> "$W/status.txt"
}

case $part in
reader)
  nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader -lms 2000 > "$W/apps.csv" &
  smi=$!
  variant liger+zero 260 --paths deepspeed,raytrain --micro-batch 24 "${Z[@]}"
  kill $smi
  variant mb32 90 --paths deepspeed --micro-batch 32 "${Z[@]}"
  ;;
compile)
  # Liger's SwiGLU kernel does not trace under dynamo (see docs/benchmarks.md): compile with the
  # Liger loss only, against the same without compile. DeepSpeed 0.19.8 cannot parse the image's
  # TORCH_CUDA_ARCH_LIST (a "9.0a" entry) when it builds DeepCompile's op: give it plain 9.0.
  L=("${Z[@]/all/loss}")
  variant liger-loss 100 --paths deepspeed --micro-batch 24 "${L[@]}"
  variant compile 200 --paths deepspeed --micro-batch 24 "${L[@]}" --set model.compile=true
  TORCH_CUDA_ARCH_LIST=9.0 variant deepcompile 200 --paths deepspeed --micro-batch 24 "${L[@]}" \
    --set model.compile=true --set deepspeed.compile.deepcompile=true
  ;;
compile-noliger)  # the same without any Liger kernel, at micro-batch 16 (logits in memory)
  N=("${Z[@]:2}")
  variant compile-noliger 220 --paths deepspeed,torch --micro-batch 16 "${N[@]}" --set model.compile=true
  TORCH_CUDA_ARCH_LIST=9.0 variant deepcompile-noliger 200 --paths deepspeed --micro-batch 16 "${N[@]}" \
    --set model.compile=true --set deepspeed.compile.deepcompile=true
  ;;
offload)
  variant gas4 150 --paths raytrain "${GAS4[@]}" "${Z[@]}" --set scaling.cpus_per_worker=14
  variant gas4-offload-cpus14 200 --paths raytrain "${GAS4[@]}" "${Z[@]}" --offload --set scaling.cpus_per_worker=14
  variant gas4-offload-cpus1 200 --paths raytrain "${GAS4[@]}" "${Z[@]}" --offload --set scaling.cpus_per_worker=1
  ;;
checks)  # fp16 (the seed's precision) with and without optimizer offload, and bf16, on the worker's own
  # engine: flags on, losses finite and falling (benchmarks/gpu_checks.py; CPU tests cannot run fp16)
  timeout "${CHECKS_S:-300}" python benchmarks/gpu_checks.py fp16 fp16-offload bf16 > "$W/checks.log" 2>&1
  echo "checks: rc=$?" >> "$W/status.txt"
  grep '^GPU_CHECK' "$W/checks.log" | cut -c11- > "$W/checks.jsonl"; cat "$W/checks.jsonl"
  ;;
offload-max)  # the largest model with optimizer offload: host RAM (16 bytes/parameter pinned) is the limit
  (while sleep 5; do free -m | awk 'NR==2{print $3}'; done) > "$W/host_used_mib.txt" &
  mem=$!
  variant 7b-offload 290 --paths deepspeed --micro-batch 1 --hidden-size 4096 --num-layers 32 --num-heads 32 \
    --num-kv-heads 32 --intermediate-size 11008 "${Z[@]}" --set model.gradient_checkpointing=true --offload \
    --steps 2 --warmup-steps 2 --window 2 --no-profile
  kill $mem; echo "host used MiB, max: $(sort -n "$W/host_used_mib.txt" | tail -1) of $(free -m | awk 'NR==2{print $2}')" >> "$W/status.txt"
  ;;
*) echo "unknown part $part"; exit 2 ;;
esac
cat "$W/status.txt"; cat "$W/results.md" 2>/dev/null
tar czf "$OUT/$part.tgz" -C /tmp "bench_$part"
