#!/usr/bin/env bash
# Device calls on a 1 x H200 machine (the `run` tool, kind nvidia-h200, carry .gpu), one per part:
#   source .gpu/setup.sh; bash benchmarks/gpu_x1.sh reader     # then offload, compile, compile-noliger, offload-max,
#   plan13b, plan7b, plan1b, fp16, mfu62, profile (BUDGET_S=560 by default: one part per call of at most 10 minutes)
# reader:  raytrain's full path vs plain DeepSpeed (1.1B, mb 24, Liger, tuned ZeRO-3), sampling which
#          processes hold a CUDA context; then micro-batch 32.
# compile: torch.compile and DeepCompile on the plain DeepSpeed path, against the same without;
#          compile-noliger: the same without Liger's kernels (and torch.compile on plain PyTorch).
# offload: raytrain's path with gradient accumulation 4, without and with optimizer offload, the
#          latter with scaling.cpus_per_worker 14 and 1 (CPU Adam runs on the worker's OpenMP threads).
# offload-max: a 6.74B model with optimizer offload, sampling the host's used memory.
# checks:  fp16 (with and without optimizer offload) and bf16 executed and asserted (benchmarks/gpu_checks.py).
# zeropp:  ZeRO++ hpZ + qwZ + qgZ executed and asserted on 4 ranks sharing the one GPU over gloo, beside plain
#          ZeRO-3 (benchmarks/gpu_checks.py; BUDGET_S=450 is enough).
# superoffload: DeepSpeed's SuperOffload on 1.1B (mb 24 x GA 4) against plain offload and no offload (~6.5 min).
# zenflow: 1.1B at 20 GiB on ZeRO stage 2 with ZenFlow (CPU Adam overlapped with the GPU), its controls (~9 min).
# stage2:  ZeRO stage 2's host work per micro-batch: 1.1B at micro-batch 1-8 beside stage 3 (~4 min), then zenflow's ui24.
# hostexp: the host-bound rows (1.1B mb 4, 7.24B mb 1) with the workers' expandable segments and without (~7 min).
# cap20b:  1.1B at 20 GiB (offload forced): micro-batch 6 with full offload and no checkpointing, the pick, references
#          (~6 min; not yet run: its one call of session 50 came on an H100 before caps followed the GPU).
# Issue 14 (the planner; docs/plan-accuracy.md has each variant's predictions, in order of value):
# plan13b:   configs/llama-13b-1gpu.yaml trains 10 steps through raytrain.main (~6 min); then plain
#            DeepSpeed at the same planner-chosen settings if the budget is left (~4 min more).
# plan13b-twin: the same 13B settings on the bench's plain-DeepSpeed and raytrain paths (~8 min).
# main1b:    configs/llama-1b-1gpu.yaml through raytrain.main for 16 steps (~3 min).
# files1b:   the same on a user's files (JSONL, CSV, one large text file) and BPE tokenizer, beside the built-in corpus.
# activ:     the no-Liger logits at a 128k vocabulary and GPT-2's dropout, each beside its control: peaks vs the plan.
# moe:       a Mixtral-shaped 4.8B MoE (transformers' experts) at micro-batch 4 and at the planner's pick: peak and tokens/s vs predicted.
# twin1b:    the shipped 1.1B setting on the bench's plain-DeepSpeed and raytrain paths (fused layers), then
#            plain DeepSpeed with transformers' layers (~4 min).
# fa4:       attention alone at the shipped shape per backend, time and energy (benchmarks/attention_backends.py),
#            then the shipped 1.1B step on the plain-DeepSpeed path with cuDNN SDPA and with FlashAttention-4 (~4 min);
#            fa4rt: the same step on raytrain's path, FlashAttention-4 and SDPA twice each (~8 min);
#            fa4twin: each backend on both paths in one variant, FlashAttention-4, SDPA, FlashAttention-4 (~10 min: on
#            an H200 the first two fill one call, ONLY='^both-fa4b$' takes the third to another);
#            fa4main: the shipped config through raytrain.main, 16 steps with each (~5 min);
#            fa4doc: raytrain's path with data.position_ids=per_document (the worker gives flash attention each
#            micro-batch as one row, for which transformers runs FlashAttention-4's varlen kernel; SDPA masks
#            documents with a 4D mask, slower and larger: micro-batch 12), FlashAttention-4, SDPA, FlashAttention-4
#            (~7 min). All need flash-attn-4 on PYTHONPATH
#            (benchmarks/fa4_setup.sh; docs/benchmarks.md, "FlashAttention-4").
# convert1b: a 4-step 1.1B run's checkpoint through DeepSpeed's ds_to_universal, timed (elastic resizes run it).
# plan7b:    the 7.24B shape with micro-batch, checkpointing and offload "auto", deepspeed + raytrain (~4.5 min).
# plan1b:    1.1B with the GPU capped at 24 GiB (the full optimizer states plus the shipped micro-batch
#            cannot fit), "auto", deepspeed + raytrain, then the uncapped no-offload reference at GA 4
#            (~4.5 min); then the planner's runner-up forced, and a cap of 84 GiB (~2 min more).
# alloc1b:   1.1B with the workers' allocator default (expandable segments) and without, at the shipped step and
#            the 24 GiB pick; then the 24 GiB runner-up that ran out of memory without it (~6 min).
# caps1b:    1.1B uncapped, then "auto" at 70 GiB (the shipped micro-batch cannot fit; offload is optional) and at
#            24 GiB (offload forced), then 70 GiB with the best offload setting forced (~6 min).
# eta1b:     1.1B without offload at micro-batch 4, 8, 12, 16, then 24 with checkpointing: the throughput model's
#            micro-batch curve and checkpointing cost (~5 min).
# eta2:      host-bound micro-batches: 1.1B mb 4 with checkpointing and with transformers' layers, 7.24B mb 1
#            without and with checkpointing (~5 min).
# fp16:      the seed's fp16 with full offload vs bf16 at the same settings (with and without DeepSpeed's host
#            overflow scan), and fp16 without offload (~6 min).
# mfu62:     1.1B mb 24 x GA 4 bf16: as shipped, ZeRO stage 2, every parameter persistent, torchao float8 (~4.5 min).
# fp8main:   configs/llama-1b-1gpu.yaml through raytrain.main, 70 steps, bf16 then model.fp8=true: the loss side by side (~9 min).
# fp8-13b:   configs/llama-13b-1gpu.yaml through raytrain.main, 10 steps, bf16 then model.fp8=true (~7 min);
#            fp8-13b-twin: the 13B at the planner's pick on the plain-DeepSpeed bench path, bf16 then fp8 (~8 min).
# fp8:       1.1B as shipped and 7.24B at mb 15 x 2 + checkpointing, bf16 against FP8 GEMMs in the fused layers (~9 min; ONLY=1b / 7b).
# profile:   the same 1.1B step under torch.profiler (benchmarks/profile_step.py): GPU time by kernel category, idle
#            time, GEMM TFLOP/s; as shipped, fused q/k/v + gate/up projections, SDPA flash only, expandable segments,
#            all three (~8 min).
# layers:    raytrain's model.fused_layers (one GEMM for q/k/v and one for gate/up over the unrenamed weights,
#            the residual add fused into the RMSNorm) beside the shipped step, profiled like `profile` (~6 min).
# Each variant gets what is left of the part's time budget (BUDGET_S), so one hang cannot eat the
# call (ONLY=REGEX runs only the variants whose names match); everything lands in $OUT/<part>.tgz (the tool brings back few files) and results.md is printed.
# Every bench record carries the planner's prediction ("predicted"), the GPU peak (max_memory_allocated)
# and the host's used memory sampled every 2 s; host_used_mib.txt samples the whole part the same way.
set -u
part=${1:?reader, offload, alloc1b, compile, compile-noliger, checks, zeropp, superoffload, zenflow, stage2, hostexp, cap20b, offload-max, plan13b, plan13b-twin, plan13b-nooff, plan7b, plan1b, caps1b, eta1b, eta2, fp16, mfu62, fp8, fp8main, fp8-13b, fp8-13b-twin, main1b, files1b, moe, twin1b, fa4, fa4rt, fa4twin, fa4main, fa4doc, convert1b, activ, profile or layers}
OUT=${OUT:-/tmp/out}; W=/tmp/bench_$part; mkdir -p "$OUT" "$W"
END=$(( $(date +%s) + ${BUDGET_S:-560} ))
export TORCH_EXTENSIONS_DIR=/tmp/torch_ext
# uuid and serial: which GPU a record came from, so that records of one machine and of several can be told apart
nvidia-smi --query-gpu=name,memory.total,driver_version,uuid,serial --format=csv > "$W/gpus.csv" 2>&1
# Power limit and clocks: the same shipped step ran 58.3-60.1% MFU on different H200 machines (docs/benchmarks.md)
nvidia-smi --query-gpu=power.limit,power.max_limit,clocks.max.sm,clocks.sm,clocks.mem,temperature.gpu,pstate \
  --format=csv >> "$W/gpus.csv" 2>&1
echo "TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST-unset} nproc=$(nproc)" >> "$W/status.txt"
# The host's CPU: ZeRO-3's per-layer host work at small micro-batches differed 1.8x between H200 machines
# (2026-12-02 against 2026-12-05, the same code: docs/benchmarks.md, "a host that keeps up")
lscpu | grep -E "^Model name|^CPU max MHz|^Thread\(s\) per core" | tr -s ' ' >> "$W/status.txt" 2>&1
Z=(--liger all --set deepspeed.zero_optimization.reduce_bucket_size=500000000
   --set deepspeed.zero_optimization.stage3_prefetch_bucket_size=200000000
   --set deepspeed.zero_optimization.stage3_param_persistence_threshold=10000000)
GAS4=(--micro-batch 24 --grad-accum 4 --steps 4 --warmup-steps 2 --window 2)
STEPS4=(--steps 4 --warmup-steps 2 --window 2)
AUTO=(--micro-batch auto --offload auto --set model.gradient_checkpointing=auto --set scaling.cpus_per_worker=14)
S7=(--hidden-size 4096 --num-layers 32 --num-heads 32 --num-kv-heads 8 --intermediate-size 14336)
S13=(--hidden-size 5120 --num-layers 40 --num-heads 40 --num-kv-heads 40 --intermediate-size 13824)
BF16_STATES=(--set deepspeed.bf16.bf16_master_weights_and_grads=true --set deepspeed.bf16.bf16_optimizer_states=true)
# 20, 24, 70 and 84 GiB of the H200's 143,771 MiB (torch.cuda.set_per_process_memory_fraction and the planner)
CAP20=0.1425; CAP24=0.171; CAP70=0.4986; CAP84=0.598
cap_of() {  # cap_of GIB: that many GiB as a fraction of the GPU that came (calls may land on an 80 GB H100)
  python -c "print(round($1 * 1024 / $(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1), 4))"
}
cap20_here() {  # CAP20 of this GPU, and refmb: the reference's micro-batch (24 does not fit an H100: 20 there)
  CAP20=$(cap_of 20); refmb=24; [[ $CAP20 > 0.2 ]] && refmb=20
  echo "20 GiB is fraction $CAP20 of this GPU; reference micro-batch $refmb" >> "$W/status.txt"
}
# the planner's pick and runner-up at 24 GiB since 2026-12-02 (plan1b, alloc1b)
AUTO24=(--paths deepspeed "${AUTO[@]}" --grad-accum 4 "${STEPS4[@]}" "${Z[@]}" --gpu-memory-fraction $CAP24 --no-profile)
RUNNERUP24=(--paths deepspeed --micro-batch 55 --grad-accum 4 "${STEPS4[@]}" "${Z[@]}" --offload
  --set model.gradient_checkpointing=true --set scaling.cpus_per_worker=14 --gpu-memory-fraction $CAP24 --no-profile)
case $part in plan*|zenflow|stage2|hostexp|cap20b|caps1b|alloc1b|eta*|fp16|fp8*|mfu62|main1b|files1b|activ|moe|twin1b|fa4*|convert1b|profile|layers|superoffload)
  (while true; do free -m | awk 'NR==2{print $3}'; sleep 2; done) > "$W/host_used_mib.txt" & hostmem=$!
  # The GPU's SM clock, power and why its clock is held down, every second: the same step made 58.3-62.1%
  # MFU on different H200s of one power limit and max clock, so what each one ran at under load is recorded
  nvidia-smi --query-gpu=utilization.gpu,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active \
    --format=csv,noheader,nounits -lms 1000 > "$W/gpu_samples.csv" 2>&1 & gpusamples=$!
  { python -c 'import torch; print("torch", torch.__version__)'; nproc; free -g | head -2; ulimit -l
    strings "$(python -c 'import torch, os; print(os.path.dirname(torch.__file__))')/lib/libc10.so" \
      | grep -c pinned_max_round_threshold_mb | sed 's/^/pinned_max_round_threshold_mb in libc10: /'
    python -c 'import torchao; print("torchao", torchao.__version__)' 2>&1 | tail -1; } >> "$W/status.txt" 2>&1 ;;
esac

variant() {  # variant NAME MAX_S bench-args...: one bench invocation, bounded by MAX_S and the budget
  local name=$1 max=$2; shift 2
  if [[ -n ${ONLY:-} && ! $name =~ $ONLY ]]; then return; fi  # ONLY='runnerup|cap84': just those variants
  local left=$(( END - $(date +%s) - 5 ))
  (( left < max )) && max=$left
  if (( max < 30 )); then echo "$name: skipped, budget spent" >> "$W/status.txt"; return; fi
  local t0=$(date +%s)
  timeout "$max" python -m raytrain.tools.bench --out "$W" --label "$name" --timeout-s $(( max - 5 )) "$@" \
    > "$W/$name.log" 2>&1
  echo "$name: rc=$? ${max}s budget, took $(( $(date +%s) - t0 ))s" >> "$W/status.txt"
}

pvariant() {  # pvariant NAME MAX_S profile_step.py-args...: one benchmarks/profile_step.py process, bounded like variant
  local name=$1 max=$2; shift 2
  if [[ -n ${ONLY:-} && ! $name =~ $ONLY ]]; then return; fi
  local left=$(( END - $(date +%s) - 5 ))
  (( left < max )) && max=$left
  if (( max < 45 )); then echo "$name: skipped, budget spent" >> "$W/status.txt"; return; fi
  local t0=$(date +%s)
  timeout -k 10 $(( max - 10 )) python benchmarks/profile_step.py --out "$W" --variant "$name" "$@" >> "$W/$name.log" 2>&1
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
  timeout "${CHECKS_S:-300}" python benchmarks/gpu_checks.py ${GPU_CHECKS:-fp16 fp16-offload bf16} > "$W/checks.log" 2>&1
  echo "checks: rc=$?" >> "$W/status.txt"
  grep '^GPU_CHECK' "$W/checks.log" | cut -c11- > "$W/checks.jsonl"; cat "$W/checks.jsonl"
  ;;
zeropp)  # ZeRO++ hpZ + qwZ + qgZ executed on the one GPU: 4 ranks share it over gloo (NCCL refuses two ranks on
  # one device); plain ZeRO-3 at the same world size for the losses (benchmarks/gpu_checks.py, GPU_CHECKS_SHARE_GPU)
  t0=$(date +%s)  # DeepSpeed's quantizer op first, timed on its own (nvcc; the four ranks would wait on one build)
  timeout 300 python -c 'from raytrain.worker.ops import fix_cuda_arch_list; fix_cuda_arch_list(log=print)
from raytrain import compat; compat.import_deepspeed_without_mlflow()
from deepspeed.ops.op_builder import QuantizerBuilder; QuantizerBuilder().load()' > "$W/quantizer_build.log" 2>&1
  echo "quantizer op build: rc=$? $(( $(date +%s) - t0 ))s" >> "$W/status.txt"
  left=$(( END - $(date +%s) - 10 ))
  GPU_CHECKS_SHARE_GPU=1 timeout "$left" torchrun --nproc-per-node 4 --master-port 29512 benchmarks/gpu_checks.py \
    zero3 zeropp > "$W/zeropp.log" 2>&1
  echo "zeropp: rc=$? ($(( $(date +%s) - t0 ))s since the build started)" >> "$W/status.txt"
  grep '^GPU_CHECK' "$W/zeropp.log" | cut -c11- > "$W/zeropp.jsonl"; cat "$W/zeropp.jsonl"
  ;;
superoffload)  # issue 14's must-offload lever: DeepSpeed's SuperOffload steps CPU Adam per sub-group while the
  # backward still runs (only without gradient clipping: superoffload_stage3.py), against the same offload without it
  # and the no-offload reference, 1.1B mb 24 x GA 4, 100M-parameter sub-groups (one 1.1B group would finish last)
  E=(--paths deepspeed "${GAS4[@]}" "${Z[@]}" --set scaling.cpus_per_worker=14 --no-profile)
  OFF=(--offload --set training.gradient_clipping=0 --set deepspeed.zero_optimization.sub_group_size=100000000)
  variant 1b-nooffload 110 "${E[@]}"
  variant 1b-superoffload 150 "${E[@]}" "${OFF[@]}" --set deepspeed.zero_optimization.offload_optimizer.super_offload=true
  variant 1b-offload-noclip 140 "${E[@]}" "${OFF[@]}"
  ;;
zenflow)  # issue 14's must-offload target with the one lever not yet measured: ZeRO stage 2 (no per-layer gather
  # hooks, so a small micro-batch is not host-bound) with DeepSpeed's ZenFlow, whose CPU Adam runs in its own process
  # while the GPU computes the next update_interval micro-batches (the top 10% gradient columns are updated on the GPU
  # every micro-batch). At 20 GiB (offload forced: 67.7% of uncapped at the planner's pick) only ~4 sequences of
  # activations fit without checkpointing, so one full update is mb 4 x update_interval 24 = 96 sequences, the
  # reference's mb 24 x GA 4. ZenFlow needs DeepSpeed to build the optimizer (a JSON "optimizer" section: it passes the
  # section's params to its GPU-side AdamW), so each ZenFlow variant runs at GA 1 with micro-steps as bench steps (~9 min)
  cap20_here
  variant 1b-ref-nocap 110 --paths deepspeed "${GAS4[@]}" --micro-batch $refmb "${Z[@]}" --set scaling.cpus_per_worker=14 \
    --no-profile
  S2=(--paths deepspeed --liger all --set deepspeed.zero_optimization.stage=2 --micro-batch 4
      --set deepspeed.zero_optimization.reduce_bucket_size=200000000 --set scaling.cpus_per_worker=14 --no-profile)
  JSONOPT=(--set deepspeed.optimizer.type=AdamW --set deepspeed.optimizer.params.lr=0.0003
           --set deepspeed.optimizer.params.weight_decay=0.1)
  zf() {  # zf UPDATE_INTERVAL: ZenFlow's keys, reselecting the top-k columns once per full update
    echo --offload --set deepspeed.zero_optimization.zenflow.topk_ratio=0.1 \
      --set deepspeed.zero_optimization.zenflow.update_interval=$1 --set deepspeed.zero_optimization.zenflow.overlap_step=true \
      --set deepspeed.zero_optimization.zenflow.select_strategy=step --set deepspeed.zero_optimization.zenflow.select_interval=$1 \
      --grad-accum 1 --steps $(( 2 * $1 )) --warmup-steps $(( 2 * $1 )) --window $1
  }
  variant 1b-cap20-s2-zenflow-ui24 200 "${S2[@]}" "${JSONOPT[@]}" $(zf 24) --gpu-memory-fraction $CAP20
  if grep -qi "out of memory" "$W/1b-cap20-s2-zenflow-ui24.log" 2>/dev/null; then  # planned by hand: 3 x 32 = 96
    variant 1b-cap20-s2-zenflow-mb3-ui32 130 "${S2[@]}" --micro-batch 3 "${JSONOPT[@]}" $(zf 32) --gpu-memory-fraction $CAP20
  fi
  # the same batch without ZenFlow: stage 2's CPU Adam after every 24 micro-batches, not overlapped
  variant 1b-cap20-s2-offload-ga24 110 "${S2[@]}" --offload --grad-accum 24 --steps 2 --warmup-steps 2 --window 2 \
    --gpu-memory-fraction $CAP20
  # ZenFlow's ceiling at this micro-batch: stage 2 with every state on the uncapped GPU, same batch
  variant 1b-nocap-s2-mb4-ga24 90 "${S2[@]}" --grad-accum 24 --steps 2 --warmup-steps 2 --window 2
  variant 1b-cap20-s2-zenflow-ui8 100 "${S2[@]}" "${JSONOPT[@]}" $(zf 8) --gpu-memory-fraction $CAP20
  ;;
stage2)  # ZeRO stage 2's host work per micro-batch (no per-layer gather/release hooks): 1.1B without offload at
  # micro-batch 1, 2, 4 and 8 (GA 8), beside stage 3 at micro-batch 4 (its host term: 9.5 ms a layer, row
  # 1b-mb4-1202b); then zenflow's update_interval 24 variant with the time left (~7 min)
  E2=(--paths deepspeed --liger all --grad-accum 8 "${STEPS4[@]}" --set scaling.cpus_per_worker=14 --no-profile)
  variant 1b-s3-mb4-ga8 60 "${E2[@]}" --micro-batch 4 "${Z[@]}"
  for mb in 1 2 4 8; do
    variant 1b-s2-mb$mb-ga8 55 "${E2[@]}" --micro-batch $mb --set deepspeed.zero_optimization.stage=2 \
      --set deepspeed.zero_optimization.reduce_bucket_size=200000000
  done
  BUDGET_S=$(( END - $(date +%s) )) ONLY=ui24 bash "$0" zenflow > /dev/null 2>&1
  cp /tmp/bench_zenflow/1b-cap20-s2-zenflow-ui24.log "$W/" 2>/dev/null
  grep -h '"1b-cap20-s2-zenflow-ui24"' /tmp/bench_zenflow/results.jsonl >> "$W/results.jsonl" 2>/dev/null
  sed -n '3,$p' /tmp/bench_zenflow/results.md >> "$W/results.md" 2>/dev/null
  cat /tmp/bench_zenflow/status.txt >> "$W/status.txt" 2>/dev/null
  ;;
hostexp)  # the throughput model's host term (ZeRO-3's per-layer work at small micro-batches, rows of 2026-12-02) was
  # measured before the workers' allocator default became expandable segments (raytrain.hardware.allocator_env); on
  # 2026-12-05 1.1B at micro-batch 4 ran 1.85x its row. The host-bound rows again, with the default and with torch's
  # own allocator (an empty PYTORCH_CUDA_ALLOC_CONF), one machine (~7 min)
  H=(--paths deepspeed --liger all "${STEPS4[@]}" "${Z[@]}" --set scaling.cpus_per_worker=14 --no-profile)
  variant 1b-mb4-exp 45 "${H[@]}" --micro-batch 4 --grad-accum 4
  PYTORCH_CUDA_ALLOC_CONF= variant 1b-mb4-noexp 45 "${H[@]}" --micro-batch 4 --grad-accum 4
  variant 7b-mb1-exp 100 "${H[@]}" "${S7[@]}" --micro-batch 1 --grad-accum 2
  PYTORCH_CUDA_ALLOC_CONF= variant 7b-mb1-noexp 100 "${H[@]}" "${S7[@]}" --micro-batch 1 --grad-accum 2
  variant 1b-mb4-ckpt-exp 45 "${H[@]}" --micro-batch 4 --grad-accum 4 --set model.gradient_checkpointing=true
  variant 1b-mb4-unfused-exp 45 "${H[@]}" --micro-batch 4 --grad-accum 4 --set model.fused_layers=false
  variant 1b-mb8-exp 45 "${H[@]}" --micro-batch 8 --grad-accum 4
  variant 7b-mb1-ckpt-exp 100 "${H[@]}" "${S7[@]}" --micro-batch 1 --grad-accum 2 --set model.gradient_checkpointing=true
  ;;
cap20b)  # the must-offload cap (20 GiB) on a machine whose host keeps up with micro-batch 4 (hostexp): the reference,
  # micro-batch 6 without offload uncapped (the ceiling of the largest micro-batch that fits at 20 GiB without
  # checkpointing), the same with full offload at 20 GiB (the planner: 16,766 tokens/s, host-bound), then the
  # planner's pick at 20 GiB (row 1b-mb37-cap20-ratio0.86-ckpt-1202f) on this machine (~6 min)
  H=(--paths deepspeed --liger all "${STEPS4[@]}" "${Z[@]}" --set scaling.cpus_per_worker=14 --no-profile)
  cap20_here
  variant 1b-ref-nocap 70 "${H[@]}" --micro-batch $refmb --grad-accum 4
  variant 1b-mb6-nocap 50 "${H[@]}" --micro-batch 6 --grad-accum 4
  variant 1b-mb6-cap20-offload 130 "${H[@]}" --micro-batch 6 --grad-accum 4 --offload --gpu-memory-fraction $CAP20
  variant 1b-mb37-cap20-pick 90 "${H[@]}" --micro-batch 37 --grad-accum 4 --offload \
    --set deepspeed.zero_optimization.offload_optimizer.ratio=0.8636 --set deepspeed.zero_optimization.sub_group_size=100000000 \
    --set model.gradient_checkpointing=true --gpu-memory-fraction $CAP20
  ;;
offload-max)  # the largest model with optimizer offload: host RAM (16 bytes/parameter pinned) is the limit
  (while sleep 5; do free -m | awk 'NR==2{print $3}'; done) > "$W/host_used_mib.txt" &
  mem=$!
  variant 7b-offload 290 --paths deepspeed --micro-batch 1 --hidden-size 4096 --num-layers 32 --num-heads 32 \
    --num-kv-heads 32 --intermediate-size 11008 "${Z[@]}" --set model.gradient_checkpointing=true --offload \
    --steps 2 --warmup-steps 2 --window 2 --no-profile
  kill $mem; echo "host used MiB, max: $(sort -n "$W/host_used_mib.txt" | tail -1) of $(free -m | awk 'NR==2{print $2}')" >> "$W/status.txt"
  ;;
plan13b)  # the shipped 13B config, 10 steps; stopped after step 10 (its final checkpoint would write ~100 GB)
  t0=$(date +%s)
  python -m raytrain.tools.plan --config configs/llama-13b-1gpu.yaml --gpu-memory-gib 139 --host-memory-gib 125 \
    --gpus-per-node 1 > "$W/13b-plan.txt" 2>&1; echo "plan tool rc=$?" >> "$W/status.txt"
  setsid python -m raytrain.main --config configs/llama-13b-1gpu.yaml training.max_steps=10 training.log_every_n_steps=1 \
    checkpoint.storage_path=/tmp/runs13b data.progress_every_s=0 tracking.tensorboard=false > "$W/13b.log" 2>&1 &
  main=$!
  while kill -0 $main 2>/dev/null && ! grep -q "step 10/10" "$W/13b.log" && (( $(date +%s) < END - 20 )); do sleep 2; done
  kill -- -$main 2>/dev/null; sleep 5; kill -9 -- -$main 2>/dev/null
  for _ in $(seq 30); do [ -z "$(nvidia-smi --query-compute-apps=pid --format=csv,noheader)" ] && break; sleep 2; done
  nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader | sed 's/^/still on the GPU: /' >> "$W/status.txt"
  echo "13b raytrain.main: $(grep -c '^.*step [0-9]*/10 ' "$W/13b.log") progress lines, $(( $(date +%s) - t0 ))s," \
       "host used MiB max $(sort -n "$W/host_used_mib.txt" | tail -1)" >> "$W/status.txt"
  grep -E "raytrain: plan:|step [0-9]+/10 |Error|error" "$W/13b.log" | tail -14 >> "$W/status.txt"
  variant 13b-deepspeed 240 --paths deepspeed "${S13[@]}" "${AUTO[@]}" "${BF16_STATES[@]}" "${Z[@]}" \
    --grad-accum 1 --steps 2 --warmup-steps 2 --window 2 --no-profile
  ;;
plan13b-twin)  # 13B at the planner's settings on both bench paths (the part plan13b's budget left no room for)
  T13=(--paths deepspeed "${S13[@]}" "${AUTO[@]}" "${BF16_STATES[@]}" "${Z[@]}" --grad-accum 1 --steps 4 --warmup-steps 2 --window 2 --no-profile)
  variant 13b-deepspeed 280 "${T13[@]}"
  variant 13b-raytrain 300 "${T13[@]}" --paths raytrain
  ;;
twin1b)  # the shipped 1.1B setting on both bench paths (fused layers, "auto"), then plain DeepSpeed with
  # transformers' layers: raytrain against plain DeepSpeed in one call (~4 min); micro-batch 20 on an H100
  cap20_here
  E=(--micro-batch $refmb --grad-accum 4 --steps 4 --warmup-steps 2 --window 2 "${Z[@]}" --set scaling.cpus_per_worker=14 --no-profile)
  variant 1b-fused-both 170 --paths deepspeed,raytrain "${E[@]}"
  variant 1b-plain-layers 80 --paths deepspeed "${E[@]}" --set model.fused_layers=false
  ;;
fa4)  # attention alone, then the shipped step with cuDNN SDPA (what "auto" runs) and with FlashAttention-4, one call
  cap20_here
  if [[ -z ${ONLY:-} ]]; then  # ONLY='^1b-sdpa$|^1b-fa4$': the step's pair alone
    timeout 200 python benchmarks/attention_backends.py --batch $refmb > "$W/attention.jsonl" 2> "$W/attention.log"
    echo "attention_backends: rc=$?" >> "$W/status.txt"; cat "$W/attention.jsonl" >> "$W/status.txt"
  fi
  E=(--paths deepspeed --micro-batch $refmb --grad-accum 4 --steps 4 --warmup-steps 2 --window 2 "${Z[@]}"
    --set scaling.cpus_per_worker=14 --no-profile)
  variant 1b-sdpa 100 "${E[@]}"
  variant 1b-fa4 150 "${E[@]}" --set model.attn_implementation=flash_attention_4
  variant 1b-sdpa-again 100 "${E[@]}"
  ;;
fa4rt)  # the same step on raytrain's path (Ray Train worker), alternating, each backend twice
  cap20_here
  E=(--paths raytrain --micro-batch $refmb --grad-accum 4 --steps 4 --warmup-steps 2 --window 2 "${Z[@]}"
    --set scaling.cpus_per_worker=14 --no-profile)
  for v in fa4 sdpa fa4b sdpab; do
    a=(); [[ $v == fa4* ]] && a=(--set model.attn_implementation=flash_attention_4)
    variant rt-$v 140 "${E[@]}" "${a[@]}"
  done
  ;;
fa4twin)  # the shipped step with FlashAttention-4 and with cuDNN SDPA, each on both bench paths (plain DeepSpeed,
  # then raytrain's Ray Train worker) in one variant: issue 14's 62% target side by side with plain DeepSpeed (~8 min)
  cap20_here
  E=(--paths deepspeed,raytrain --micro-batch $refmb --grad-accum 4 --steps 4 --warmup-steps 2 --window 2 "${Z[@]}"
    --set scaling.cpus_per_worker=14 --no-profile)
  # an H200 took 189 s for both-fa4 and 200 s for both-sdpa (session 66; 170 s cut SDPA's raytrain path off)
  variant both-fa4 220 "${E[@]}" --set model.attn_implementation=flash_attention_4
  variant both-sdpa 215 "${E[@]}"
  variant both-fa4b 200 "${E[@]}" --set model.attn_implementation=flash_attention_4
  ;;
fa4doc)  # raytrain's path, positions per document: the built-in corpus's documents are ~300 tokens, so each
  # 2048-token row is ~7 of them and varlen attention does ~1/7 of the causal attention's work (MFU still counts all)
  cap20_here
  E=(--paths raytrain --micro-batch $refmb --grad-accum 4 --steps 4 --warmup-steps 2 --window 2 "${Z[@]}"
    --set scaling.cpus_per_worker=14 --set data.position_ids=per_document --no-profile)
  for v in fa4 sdpa fa4b; do
    # SDPA's document mask: 3.1 GiB a sequence where packed rows take 2.5 (session 63: out of memory at 20 on an H100)
    a=(); [[ $v == fa4* ]] && a=(--set model.attn_implementation=flash_attention_4) || a=(--micro-batch 12)
    variant doc-$v 150 "${E[@]}" "${a[@]}"
  done
  ;;
fa4main)  # configs/llama-1b-1gpu.yaml through raytrain.main, 16 steps with FlashAttention-4, then with SDPA: the losses
  cap20_here
  for v in flash_attention_4 sdpa; do
    t0=$(date +%s); rm -rf /tmp/runs-fa4main  # one run's 12 GiB checkpoint at a time (the device's disk)
    timeout 270 python -m raytrain.main --config configs/llama-1b-1gpu.yaml training.max_steps=16 \
      training.micro_batch_size_per_gpu=$refmb training.log_every_n_steps=2 checkpoint.every_n_steps=1000 \
      checkpoint.storage_path=/tmp/runs-fa4main data.progress_every_s=0 model.attn_implementation=$v > "$W/$v.log" 2>&1
    echo "$v raytrain.main rc=$? in $(( $(date +%s) - t0 ))s" >> "$W/status.txt"
    grep -E "step [0-9]+/16 |raytrain: done" "$W/$v.log" | tail -9 >> "$W/status.txt"
  done
  ;;
fp8)  # FP8 GEMMs in the fused layers (model.fp8: raytrain.worker.fp8) beside the same bf16 step, plain
  # DeepSpeed path: the shipped 1.1B setting (casts compiled, then eager), then ONLY=7b: the 7.24B at the pick of session 35
  E=(--paths deepspeed --micro-batch 24 --grad-accum 4 --steps 4 --warmup-steps 2 --window 2 "${Z[@]}" --set scaling.cpus_per_worker=14 --no-profile)
  variant 1b-bf16 100 "${E[@]}"
  variant 1b-fp8 170 "${E[@]}" --set model.fp8=true
  RAYTRAIN_FP8_COMPILE=0 variant 1b-fp8-eager-casts 110 "${E[@]}" --set model.fp8=true
  S7E=(--paths deepspeed "${S7[@]}" --micro-batch 15 --grad-accum 2 --set model.gradient_checkpointing=true "${Z[@]}"
    --set scaling.cpus_per_worker=14 --steps 2 --warmup-steps 1 --window 1 --no-profile)
  variant 7b-bf16 230 "${S7E[@]}"
  variant 7b-fp8 260 "${S7E[@]}" --set model.fp8=true
  ;;
fp8main)  # the shipped 1.1B config through python -m raytrain.main, bf16 then model.fp8=true: the same data, seed and
  # schedule (warmup 10 instead of 200, so the learning rate is at its peak within the run), the loss every 5 steps
  for v in bf16:false fp8:true; do
    t0=$(date +%s); lim=$(( END - t0 - 5 )); [[ $v == bf16:* ]] && lim=$(( lim / 2 + 20 ))
    timeout $lim python -m raytrain.main --config configs/llama-1b-1gpu.yaml \
      training.max_steps=${FP8MAIN_STEPS:-70} training.warmup_steps=10 training.log_every_n_steps=5 checkpoint.every_n_steps=1000 \
      checkpoint.storage_path=/tmp/runs-${v%%:*} data.progress_every_s=0 model.fp8=${v##*:} > "$W/1b-main-${v%%:*}.log" 2>&1
    echo "1b raytrain.main ${v%%:*} rc=$? in $(( $(date +%s) - t0 ))s" >> "$W/status.txt"
    grep -E "raytrain: model|step [0-9]+/" "$W/1b-main-${v%%:*}.log" >> "$W/status.txt"
  done
  ;;
fp8-13b)  # the shipped 13B config through python -m raytrain.main, 10 steps each, bf16 then model.fp8=true (the planner
  # picks micro-batch 3 without offload for both on this machine; each stopped after step 10: a final save writes ~100 GB)
  for v in bf16:false fp8:true; do
    if [[ -n ${ONLY:-} && ! ${v%%:*} =~ $ONLY ]]; then continue; fi
    t0=$(date +%s); log="$W/13b-main-${v%%:*}.log"
    setsid python -m raytrain.main --config configs/llama-13b-1gpu.yaml training.max_steps=${FP8_13B_STEPS:-10} training.log_every_n_steps=1 \
      checkpoint.storage_path=/tmp/runs13b-${v%%:*} data.progress_every_s=0 tracking.tensorboard=false model.fp8=${v##*:} \
      > "$log" 2>&1 &
    main=$!; lim=$(( END - 20 )); [[ $v == bf16:* && -z ${ONLY:-} ]] && lim=$(( t0 + (END - t0) * 45 / 100 ))
    while kill -0 $main 2>/dev/null && ! grep -q "step ${FP8_13B_STEPS:-10}/${FP8_13B_STEPS:-10}" "$log" && (( $(date +%s) < lim )); do sleep 2; done
    kill -- -$main 2>/dev/null; sleep 5; kill -9 -- -$main 2>/dev/null
    for _ in $(seq 30); do [ -z "$(nvidia-smi --query-compute-apps=pid --format=csv,noheader)" ] && break; sleep 2; done
    echo "13b raytrain.main ${v%%:*}: $(grep -c 'step [0-9]*/[0-9]* ' "$log") progress lines in $(( $(date +%s) - t0 ))s" >> "$W/status.txt"
    grep -E "raytrain: plan: chose|raytrain: model|step [0-9]+/[0-9]+ |Error|error" "$log" | tail -24 >> "$W/status.txt"
  done
  ;;
fp8-13b-twin)  # the 13B at the planner's settings on the bench's plain-DeepSpeed path, bf16 then model.fp8=true
  T13=(--paths deepspeed "${S13[@]}" "${AUTO[@]}" "${BF16_STATES[@]}" "${Z[@]}" --grad-accum 1 --steps ${FP8_13B_BENCH_STEPS:-6} --warmup-steps 3
    --window 3 --no-profile)
  variant 13b-bf16-deepspeed 270 "${T13[@]}"
  variant 13b-fp8-deepspeed 290 "${T13[@]}" --set model.fp8=true
  variant 13b-fp8-raytrain 290 "${T13[@]}" --set model.fp8=true --paths raytrain  # ONLY=fp8: beside plain DeepSpeed's fp8
  ;;
main1b)  # the shipped 1.1B config through python -m raytrain.main, as a user runs it (after the merges of issues 12-15)
  t0=$(date +%s)
  timeout $(( END - $(date +%s) - 10 )) python -m raytrain.main --config configs/llama-1b-1gpu.yaml training.max_steps=16 \
    training.log_every_n_steps=2 checkpoint.every_n_steps=1000 checkpoint.storage_path=/tmp/runs1b data.progress_every_s=0 \
    > "$W/1b-main.log" 2>&1; echo "1b raytrain.main rc=$? in $(( $(date +%s) - t0 ))s, $(wc -l < "$W/1b-main.log") lines" >> "$W/status.txt"
  grep -E "raytrain:|step [0-9]+/16 " "$W/1b-main.log" | tail -16 >> "$W/status.txt"
  grep -c "falling back to serialize as pickled" "$W/1b-main.log" | sed 's/^/pickled-fallback lines: /' >> "$W/status.txt"
  ;;
files1b)  # the shipped 1.1B config through raytrain.main on a user's own files and BPE tokenizer (benchmarks/user_files.py:
  # the same documents as JSONL, CSV and one large text file read in pieces), beside the built-in corpus in the same
  # call; FILES1B="builtin jsonl" (the default) or "csv text": each run ~3.3 min, so two per call
  python benchmarks/user_files.py /tmp/files1b --mib 64 >> "$W/status.txt" 2>&1
  for v in ${FILES1B:-builtin jsonl}; do
    case $v in builtin) d=(); ;; jsonl) d=(data.path=/tmp/files1b/jsonl); ;; csv) d=(data.path=/tmp/files1b/csv); ;;
      text) d=(data.path=/tmp/files1b/one.txt); ;; esac
    [[ $v == builtin ]] || d+=(model.tokenizer=/tmp/files1b/tokenizer)
    left=$(( END - $(date +%s) - 10 )); (( left < 60 )) && { echo "$v: skipped, budget spent" >> "$W/status.txt"; continue; }
    t0=$(date +%s)
    timeout $left python -m raytrain.main --config configs/llama-1b-1gpu.yaml training.max_steps=16 \
      training.log_every_n_steps=2 checkpoint.every_n_steps=1000 checkpoint.storage_path=/tmp/runs1b-$v \
      data.progress_every_s=0 "${d[@]}" > "$W/1b-$v.log" 2>&1
    echo "1b $v (${d[*]}): rc=$? in $(( $(date +%s) - t0 ))s, $(wc -l < "$W/1b-$v.log") lines" >> "$W/status.txt"
    grep -E "raytrain:|step [0-9]+/16 |Error|error" "$W/1b-$v.log" | grep -v "DeepSpeed config (resolved" | tail -24 >> "$W/status.txt"
  done
  ;;
activ)  # the planner's terms the calibration rows never exercised, each beside its control in one call (~6 min):
  # HF's loss without Liger at a 128k vocabulary (the logits' bytes per vocabulary entry and token, against Liger's
  # fused loss, which keeps none), and GPT-2's dropout masks (0.1 against 0.0, a GPT-2-shaped 1.3B of its own config)
  V128=(--paths deepspeed "${Z[@]}" --vocab-size 128256 --micro-batch 4 --grad-accum 1 "${STEPS4[@]}" --no-profile)
  variant v128k-noliger 110 "${V128[@]}" --liger none
  variant v128k-loss 110 "${V128[@]}" --liger loss
  for p in 0.1 0.0; do
    python -c "from transformers import AutoConfig; from raytrain.model import byte_tokenizer
AutoConfig.for_model('gpt2', n_embd=2048, n_layer=24, n_head=16, n_positions=2048, resid_pdrop=$p, embd_pdrop=$p,
                     attn_pdrop=$p).save_pretrained('/tmp/gpt2-p$p'); byte_tokenizer().save_pretrained('/tmp/gpt2-p$p')"
    variant gpt2-dropout$p 110 --paths deepspeed "${Z[@]}" --liger none --model-dir /tmp/gpt2-p$p --micro-batch 8 \
      --grad-accum 1 "${STEPS4[@]}" --no-profile
  done
  ;;
moe)  # a user's own mixture-of-experts model: Mixtral-shaped (8 experts, top-2, 4.8B parameters, 1.4B active per token,
  # transformers' own experts code), on the bench's plain-DeepSpeed path: the planner's MoE activations and active-parameter
  # FLOPs against the measured GPU peak and tokens/s, at a fixed micro-batch and at the planner's "auto" pick (~5 min)
  # the built-in corpus and byte tokenizer, as the Llama rows (a model directory needs a tokenizer of its own)
  python -c 'from transformers import AutoConfig; from raytrain.model import byte_tokenizer
AutoConfig.for_model("mixtral", num_local_experts=8, num_experts_per_tok=2).save_pretrained("/tmp/moe_model")
byte_tokenizer().save_pretrained("/tmp/moe_model")'
  MOE=(--paths deepspeed "${Z[@]}" --liger none --hidden-size 2048 --num-layers 16 --num-heads 16 --num-kv-heads 8
       --intermediate-size 5632 --set model.name_or_path=/tmp/moe_model --steps 4 --warmup-steps 2 --window 2 --no-profile)
  variant moe-mb4 220 "${MOE[@]}" --micro-batch 4 --grad-accum 1
  variant moe-auto 280 "${MOE[@]}" "${AUTO[@]}" --grad-accum 4
  # the planner's runner-up at that pick (2026-12-05): checkpointing at micro-batch 45 (ONLY=runnerup: just it)
  variant moe-runnerup 200 "${MOE[@]}" --micro-batch 45 --grad-accum 4 --set model.gradient_checkpointing=true \
    --set scaling.cpus_per_worker=14
  ;;
convert1b)  # DeepSpeed's universal conversion (what an elastic resize runs) of a real 1.1B checkpoint on the GPU host
  timeout $(( END - $(date +%s) - 200 )) python -m raytrain.main --config configs/llama-1b-1gpu.yaml training.max_steps=4 \
    training.log_every_n_steps=2 checkpoint.storage_path=/tmp/runs1bc checkpoint.name=c data.progress_every_s=0 \
    > "$W/1b-main.log" 2>&1; echo "1b raytrain.main rc=$?" >> "$W/status.txt"
  ck=/tmp/runs1bc/c/checkpoint_step_00000004; tag=$(python -c "from raytrain.checkpoint import layout; print(layout.tag_for(4))")
  echo "checkpoint bytes $(du -sb "$ck/$tag" | cut -f1)" >> "$W/status.txt"
  t0=$(date +%s.%N)
  timeout $(( END - $(date +%s) - 5 )) python -m deepspeed.checkpoint.ds_to_universal --input_folder "$ck/$tag" \
    --output_folder /tmp/univ1b > "$W/convert.log" 2>&1
  echo "ds_to_universal rc=$? in $(python -c "print(round($(date +%s.%N) - $t0, 1))") s (nproc $(nproc)), universal bytes $(du -sb /tmp/univ1b | cut -f1)" >> "$W/status.txt"
  ;;
plan7b)
  variant 7b-auto 420 --paths deepspeed,raytrain "${S7[@]}" "${AUTO[@]}" "${Z[@]}" --grad-accum 2 \
    --steps 2 --warmup-steps 1 --window 1 --no-profile
  ;;
plan1b)  # in order of value: the decision under test, its reference, its runner-up, a cap that does not force offload
  variant 1b-cap24-auto 250 --paths deepspeed,raytrain "${AUTO[@]}" --grad-accum 4 "${STEPS4[@]}" "${Z[@]}" \
    --gpu-memory-fraction $CAP24 --no-profile
  variant 1b-ref-nocap 110 --paths deepspeed "${GAS4[@]}" "${Z[@]}" --set scaling.cpus_per_worker=14 --no-profile
  # the recalibrated planner's runner-up at 24 GiB (2026-12-02): full offload + checkpointing at mb 55
  variant 1b-cap24-runnerup 140 "${RUNNERUP24[@]}"
  # 20 GiB: no setting without offload fits; "auto" picks partial offload + checkpointing (both paths)
  variant 1b-cap20-auto 330 --paths deepspeed,raytrain "${AUTO[@]}" --grad-accum 4 "${STEPS4[@]}" "${Z[@]}" \
    --gpu-memory-fraction $CAP20 --no-profile
  variant 1b-cap84-auto 100 --paths deepspeed "${AUTO[@]}" --grad-accum 4 "${STEPS4[@]}" "${Z[@]}" \
    --gpu-memory-fraction $CAP84 --no-profile
  ;;
alloc1b)  # the workers' allocator default (expandable segments: raytrain.hardware.allocator_env) against torch's own
  # (PYTORCH_CUDA_ALLOC_CONF set empty: the user's opt-out), at the shipped step and the 24 GiB pick; then the 24 GiB
  # runner-up that ran out of memory under torch's default (6.2 GiB reserved, unusable) (~6 min)
  variant 1b-ref-nocap-exp 110 --paths deepspeed "${GAS4[@]}" "${Z[@]}" --set scaling.cpus_per_worker=14 --no-profile
  PYTORCH_CUDA_ALLOC_CONF= variant 1b-ref-nocap-noexp 110 --paths deepspeed "${GAS4[@]}" "${Z[@]}" \
    --set scaling.cpus_per_worker=14 --no-profile
  variant 1b-cap24-auto-exp 110 "${AUTO24[@]}"
  PYTORCH_CUDA_ALLOC_CONF= variant 1b-cap24-auto-noexp 110 "${AUTO24[@]}"
  variant 1b-cap24-runnerup-exp 150 "${RUNNERUP24[@]}"
  ;;
caps1b)  # the uncapped reference, then "auto" under a cap that leaves the shipped micro-batch no room (70 GiB: the
  # planner keeps every state on the GPU at a smaller micro-batch) and one that forces offload (24 GiB), then the
  # fastest offload setting at 70 GiB forced (the planner's pick with offload on; mb 24 does not fit there even with
  # full offload): one call, plain-DeepSpeed path (~6 min)
  variant 1b-ref-nocap 110 --paths deepspeed "${GAS4[@]}" "${Z[@]}" --set scaling.cpus_per_worker=14 --no-profile
  variant 1b-cap70-auto 110 --paths deepspeed "${AUTO[@]}" --grad-accum 4 "${STEPS4[@]}" "${Z[@]}" \
    --gpu-memory-fraction $CAP70 --no-profile
  variant 1b-cap24-auto 170 --paths deepspeed "${AUTO[@]}" --grad-accum 4 "${STEPS4[@]}" "${Z[@]}" \
    --gpu-memory-fraction $CAP24 --no-profile
  variant 1b-cap70-offload 110 --paths deepspeed --micro-batch 22 --grad-accum 4 "${STEPS4[@]}" "${Z[@]}" --offload \
    --set scaling.cpus_per_worker=14 --set deepspeed.zero_optimization.offload_optimizer.ratio=0.8636 \
    --set deepspeed.zero_optimization.sub_group_size=100000000 --gpu-memory-fraction $CAP70 --no-profile
  ;;
eta1b)  # the throughput model's micro-batch curve (planning/throughput.py ETA_POINTS) at today's 1.1B step: no offload,
  # GA 4, fused layers ("auto"), micro-batch 4 to 16, then the shipped micro-batch with checkpointing (~5 min)
  for mb in 4 8 12 16; do
    variant 1b-mb$mb 75 --paths deepspeed --micro-batch $mb --grad-accum 4 "${STEPS4[@]}" "${Z[@]}" \
      --set scaling.cpus_per_worker=14 --no-profile
  done
  variant 1b-mb24-ckpt 90 --paths deepspeed "${GAS4[@]}" "${Z[@]}" --set scaling.cpus_per_worker=14 \
    --set model.gradient_checkpointing=true --no-profile
  ;;
eta2)  # where a micro-batch is host-bound (ZeRO-3's hooks and launches per layer): 1.1B at micro-batch 4 with
  # checkpointing and with transformers' layers, 7.24B at micro-batch 1 without and with checkpointing (~5 min)
  variant 1b-mb4-ckpt 60 --paths deepspeed --micro-batch 4 --grad-accum 4 "${STEPS4[@]}" "${Z[@]}" \
    --set scaling.cpus_per_worker=14 --set model.gradient_checkpointing=true --no-profile
  variant 1b-mb4-unfused 60 --paths deepspeed --micro-batch 4 --grad-accum 4 "${STEPS4[@]}" "${Z[@]}" \
    --set scaling.cpus_per_worker=14 --set model.fused_layers=false --no-profile
  variant 7b-mb1 100 --paths deepspeed "${S7[@]}" --micro-batch 1 --grad-accum 2 "${STEPS4[@]}" "${Z[@]}" \
    --set scaling.cpus_per_worker=14 --no-profile
  variant 7b-mb1-ckpt 100 --paths deepspeed "${S7[@]}" --micro-batch 1 --grad-accum 2 "${STEPS4[@]}" "${Z[@]}" \
    --set scaling.cpus_per_worker=14 --set model.gradient_checkpointing=true --no-profile
  ;;
plan13b-nooff)  # 13B at the setting the recalibrated planner picks on the H200 (micro-batch 3, bf16 states on the GPU,
  # no offload, checkpointing): does it fit and how fast (~2 min on the plain-DeepSpeed path)
  variant 13b-mb3-nooffload 200 --paths deepspeed "${S13[@]}" --micro-batch 3 --grad-accum 1 "${BF16_STATES[@]}" "${Z[@]}" \
    --set model.gradient_checkpointing=true --set scaling.cpus_per_worker=14 --steps 2 --warmup-steps 1 --window 1 \
    --no-profile
  ;;
fp16)  # the seed JSON's precision and offload at the shipped batch; bf16 the same; fp16 without offload
  # FP16_PATHS=deepspeed,raytrain: both paths, each variant given twice the time
  E=(--paths "${FP16_PATHS:-deepspeed}" "${GAS4[@]}" "${Z[@]}" --set scaling.cpus_per_worker=14 --no-profile)
  n=$(( $(tr -cd , <<< "${FP16_PATHS:-deepspeed}" | wc -c) + 1 ))
  FP16=(--set training.precision=fp16 --set deepspeed.fp16.enabled=true)
  variant 1b-bf16-offload $(( 140 * n )) "${E[@]}" --offload
  variant 1b-fp16-offload $(( 140 * n )) "${E[@]}" --offload "${FP16[@]}"
  # the same with DeepSpeed's inf/nan scan of the host gradient buffer, which raytrain drops since 2026-12-02
  # (the deepspeed path only: it puts DeepSpeed's method back after build_engine)
  variant 1b-fp16-offload-dsscan 140 "${E[@]/raytrain/}" --offload "${FP16[@]}" --deepspeed-overflow-scan
  variant 1b-fp16-nooffload $(( 110 * n )) "${E[@]}" "${FP16[@]}"
  ;;
mfu62)  # levers for 62% MFU at the shipped setting (issue 14 SPEC section 4); accumulation does not count
  B=(--paths deepspeed "${GAS4[@]}" "${Z[@]}")
  # the base on both paths: issue 13's re-measure of raytrain against plain DeepSpeed after the layout
  variant 1b-base 170 --paths deepspeed,raytrain "${GAS4[@]}" "${Z[@]}" --set scaling.cpus_per_worker=14
  variant 1b-stage2 110 "${B[@]}" --no-profile --set deepspeed.zero_optimization.stage=2
  variant 1b-persistent 110 "${B[@]}" --no-profile --set deepspeed.zero_optimization.stage3_param_persistence_threshold=100000000
  if python -c 'import torchao' 2>/dev/null; then variant 1b-float8 140 "${B[@]}" --no-profile --float8
  else echo "1b-float8: skipped, no torchao" >> "$W/status.txt"; fi
  ;;
profile)  # where one optimizer step's GPU time goes at the shipped setting, and bf16 levers (issue 14); one process
  # per variant, each appending its JSON line to results.jsonl (benchmarks/profile_step.py --report: results.md)
  pvariant shipped 150 --shapes
  pvariant fused 110
  pvariant flash 100
  pvariant expandable 100
  pvariant fused+flash+expandable 100
  python benchmarks/profile_step.py --report "$W" > /dev/null 2>> "$W/status.txt"
  ;;
layers)  # raytrain's model.fused_layers against the shipped step, profiled like `profile` (~6 min): shipped,
  # layers, then layers with one piece undone each (Liger's one program per SM in the RMSNorm backward; the
  # residual add and RMSNorm as two kernels; the residual add outside down_proj's GEMM), then shipped and
  # layers once more (the spread between two runs of one setting)
  pvariant shipped 100
  pvariant layers 100
  pvariant layers+norm1 80
  pvariant layers+noaddnorm 80
  pvariant layers+noaddmm 80
  pvariant shipped 90
  pvariant layers 90
  python benchmarks/profile_step.py --report "$W" > /dev/null 2>> "$W/status.txt"
  ;;
*) echo "unknown part $part"; exit 2 ;;
esac
if [ -n "${hostmem:-}" ]; then
  kill $hostmem; echo "host used MiB during the part: max $(sort -n "$W/host_used_mib.txt" | tail -1) of $(free -m | awk 'NR==2{print $2}')" >> "$W/status.txt"
fi
if [ -n "${gpusamples:-}" ]; then  # over the seconds the GPU was >= 90% busy: median SM clock, mean power, reasons
  kill $gpusamples
  python - "$W/gpu_samples.csv" >> "$W/status.txt" <<'PY'
import collections, statistics, sys
rows = [[f.strip() for f in line.split(",")] for line in open(sys.argv[1]) if line.count(",") == 4]
busy = [r for r in rows if r[0].isdigit() and int(r[0]) >= 90]
if not busy:
    print("gpu samples: none >= 90% busy", rows[:1])
else:
    clocks, power = [int(r[1]) for r in busy], [float(r[2]) for r in busy]
    print(f"gpu samples >= 90% busy: {len(busy)} s, SM clock median {statistics.median(clocks):.0f} MHz "
          f"(min {min(clocks)}), power mean {statistics.mean(power):.0f} W (max {max(power):.0f}), "
          f"max {max(int(r[3]) for r in busy)} C; clock event reasons: {dict(collections.Counter(r[4] for r in busy))}")
PY
fi
cat "$W/status.txt"; cat "$W/results.md" 2>/dev/null
tar czf "$OUT/$part.tgz" -C /tmp "bench_$part"
