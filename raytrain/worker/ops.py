"""DeepSpeed's JIT-compiled ops: build the ones a run needs once per node, before the engine exists.

Why this module exists: torch's cpp_extension guards each op build with a plain lock file
(torch.utils.file_baton) that only the process holding it removes. A process killed while
compiling (a worker fault, a preemption, a test timeout) leaves that file behind, and every later
load of the op from the same TORCH_EXTENSIONS_DIR waits on it forever, silently: a restarted
worker that needs CPU Adam would hang instead of resuming. raytrain therefore builds the ops a
run needs itself, one process at a time per extensions directory under an flock (which the kernel
releases when its holder dies, however it dies); whoever holds the flock knows any torch lock
file it finds is stale, and removes it. What the dead build left half written is ninja's to redo:
torch runs ninja in every process's first load of an op, and ninja rebuilds every output its log
does not record as finished (a truncated object or .so included), so the work that did finish is
kept. The cost: a build outside raytrain on the same node at the same moment could be disturbed
(it would wait on nothing, or build twice), and ops build one after another, which they do anyway
(each build already uses every core through ninja).

Entry point: `ensure_built(required_ops(facts), log)`; call it after
`raytrain.worker.engine.import_deepspeed`, before `deepspeed.initialize`.
"""

from __future__ import annotations

import fcntl
import os
import re
import time
from typing import Callable, Iterable

from raytrain import compat
from raytrain.deepspeed_config import DeepSpeedFacts

# DeepSpeed optimizer types -> the op builder DeepSpeed loads for them, with optimizer offload (its
# CPU optimizers) and without (its fused ones); torch's own optimizers need no build.
_CPU_OPTIMIZER_OPS = {"adam": "CPUAdamBuilder", "adamw": "CPUAdamBuilder", "adagrad": "CPUAdagradBuilder",
                      "lion": "CPULionBuilder"}
_FUSED_OPTIMIZER_OPS = {"adam": "FusedAdamBuilder", "adamw": "FusedAdamBuilder", "lamb": "FusedLambBuilder",
                        "lion": "FusedLionBuilder"}


def required_ops(facts: DeepSpeedFacts) -> list[str]:
    """The DeepSpeed op builders a resolved config makes DeepSpeed (or raytrain) load."""
    ops = []
    offloaded = facts.offload_optimizer != "none"
    kind = (facts.optimizer_type or "").lower()
    if facts.optimizer_type is None:
        # raytrain's own optimizer (raytrain.worker.engine.build_optimizer): DeepSpeed's CPU Adam when
        # offloaded, else torch's AdamW (no build).
        if offloaded:
            ops.append("CPUAdamBuilder")
    elif offloaded:
        ops.append(_CPU_OPTIMIZER_OPS.get(kind))
    elif not (kind in ("adam", "adamw") and facts.torch_adam):
        ops.append(_FUSED_OPTIMIZER_OPS.get(kind))
    if "nvme" in (facts.offload_optimizer, facts.offload_param):
        ops.append("AsyncIOBuilder")  # DeepSpeed's libaio swapper
    if os.environ.get("DS_PIN_MEMORY_BACKEND") == "native":
        ops.append("PinMemoryBuilder")  # DeepSpeed pins through its own op only when asked to
    return [op for op in dict.fromkeys(ops) if op]


def arch_list_deepspeed_can_parse(value: str) -> str | None:
    """TORCH_CUDA_ARCH_LIST without arch-specific suffixes ("9.0a" -> "9.0"), or None if it has none.

    DeepSpeed 0.19.8 sorts the entries with int(minor.split('+')[0]) before every CUDA op build and
    raises `ValueError: invalid literal for int() with base 10: '0a'` on Hopper's "9.0a" (seen in the
    H200 image raytrain is benchmarked on). "+PTX" stays. Upstream fix pending: deepspeedai/DeepSpeed
    PR #8619 (open); drop this once the pinned DeepSpeed parses suffixes.
    """
    entries = [e.strip() for e in value.replace(" ", ";").split(";") if e.strip()]
    fixed = list(dict.fromkeys(re.sub(r"^(\d+\.\d+)[a-z]+", r"\1", e) for e in entries))
    return None if fixed == entries else ";".join(fixed)


def fix_cuda_arch_list(log: Callable[[str], None]) -> None:
    """Make TORCH_CUDA_ARCH_LIST parsable for DeepSpeed in this process, saying so, before any CUDA op build.

    Process-wide because DeepSpeed re-reads it at every op load (and rewrites it itself after parsing);
    it only steers CUDA extension builds.
    """
    value = os.environ.get("TORCH_CUDA_ARCH_LIST")
    fixed = arch_list_deepspeed_can_parse(value) if value else None
    if fixed is not None:
        log(f"raytrain: TORCH_CUDA_ARCH_LIST={value!r} -> {fixed!r} in this worker: DeepSpeed's op builder "
            f"cannot parse arch suffixes such as 9.0a (ValueError when it compiles a CUDA op)")
        os.environ["TORCH_CUDA_ARCH_LIST"] = fixed


def ensure_built(ops: Iterable[str], log: Callable[[str], None]) -> None:
    """Load (building where needed) each op, one process at a time per extensions directory.

    A cache hit takes milliseconds; a first build on a node takes 30 s to a few minutes, and says so.
    """
    ops = list(ops)
    if not ops:
        return
    from deepspeed.accelerator import get_accelerator
    from deepspeed.git_version_info import installed_ops

    builders = [get_accelerator().create_op_builder(name) for name in ops]
    # Ops installed prebuilt (DS_BUILD_OPS=1 pip install deepspeed) need no build; an op this machine
    # cannot build is left to DeepSpeed, which raises its own error naming it.
    todo = [(name, b) for name, b in zip(ops, builders)
            if b is not None and not installed_ops.get(b.name) and b.is_compatible(verbose=False)]
    if not todo:
        return
    build_dirs = [compat.torch_extension_build_dir(b.name) for _, b in todo]  # creates them
    with open(build_dirs[0].parent / "raytrain-build.flock", "w") as flock:
        fcntl.flock(flock, fcntl.LOCK_EX)  # released by the kernel if this process dies
        for (name, builder), build_dir in zip(todo, build_dirs):
            if (build_dir / "lock").exists():
                # Its owner died mid-build. What it left half written (a truncated .so would load and
                # crash) ninja rebuilds in the load below: an output its log does not record as
                # finished is out of date. (Deleting the directory instead cost a whole build, ~90
                # CPU-seconds for the smallest op, the test suite's one stale lock included.)
                log(f"raytrain: removing {build_dir / 'lock'}: a process was killed while it compiled DeepSpeed's "
                    f"{builder.name} op there, leaving a lock torch would wait on forever; ninja finishes that build")
                (build_dir / "lock").unlink(missing_ok=True)
            if not any(build_dir.glob("*.so")):
                log(f"raytrain: compiling DeepSpeed's {builder.name} op ({name}) into {build_dir}: "
                    "30 s to a few minutes, once per node and version")
            start = time.perf_counter()
            builder.load(verbose=False)
            took = time.perf_counter() - start
            if took > 5:
                log(f"raytrain: {builder.name} op ready in {took:.0f} s")
