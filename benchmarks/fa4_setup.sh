# FlashAttention-4 on the GPU machine, which reaches no package registry (docs/benchmarks.md, "FlashAttention-4").
# Source it from the repository root in each call: it copies what this call carried (.fa4/a, .fa4/b: made here by
# benchmarks/fa4_bundle.sh; each part fits one call's 64 MiB) to /tmp/fa4store, installs into /tmp/fa4site once both
# parts are there, and puts that on PYTHONPATH. The parts must come in calls on one warm machine (its 30 s idle release).
S=/tmp/fa4store; T=/tmp/fa4site; mkdir -p $S
for d in .fa4/a .fa4/b; do [ -d $d ] && cp -n $d/* $S/ 2>/dev/null; done
if [ ! -f $T/.done ] && [ -f $S/cu13.part.aa ] && [ -f $S/cu13.part.ab ]; then
  cat $S/cu13.part.aa $S/cu13.part.ab > /tmp/cu13.tar.xz && rm -rf $T && mkdir -p $T
  # pip first: --target skips a top-level directory that exists, and the CUDA 13 libraries share nvidia_cutlass_dsl/
  python3 -m pip install -q --no-index --no-deps --no-compile --target $T $S/*.whl
  tar xJf /tmp/cu13.tar.xz -C $T && tar xf $S/cu13-distinfo.tar -C $T && rm /tmp/cu13.tar.xz && touch $T/.done
fi
if [ -f $T/.done ]; then
  # nvidia-cutlass-dsl's .pth adds dsl_packages, but .pth files are read only in site directories, not on PYTHONPATH.
  # The compiled kernels are cached on disk (~7 s a process for the 1.1B's forward and backward otherwise).
  export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 PYTHONPATH=$T:$T/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}
  python3 -c "import flash_attn.cute, cutlass; print('fa4: flash_attn.cute imports')" 2>&1 | tail -3
else
  echo "fa4: in /tmp/fa4store: $(ls $S | tr '\n' ' '); the other part still to come"
fi
