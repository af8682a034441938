"""`python -m raytrain.tools.build_ops`: DeepSpeed's ops compiled ahead of a run, in its own process (as a node's
setup command runs it), into a TORCH_EXTENSIONS_DIR of the test's; a mistake is one line, exit 2."""

import os
import subprocess
import sys


def build_ops(*args, extensions_dir, **extra_env):
    env = {**os.environ, **extra_env, "TORCH_EXTENSIONS_DIR": str(extensions_dir)}
    return subprocess.run([sys.executable, "-m", "raytrain.tools.build_ops", *args], capture_output=True, text=True,
                          env=env, timeout=600)


def test_an_op_is_built_once_and_then_found(tmp_path):
    # pin_memory: DeepSpeed's smallest CPU op (~25 s on 2 cores); the second call loads the built one
    first = build_ops("pin_memory", extensions_dir=tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    lines = first.stdout.splitlines()
    assert lines[0].startswith(f"raytrain: compiling DeepSpeed's pin_memory op (PinMemoryBuilder) into {tmp_path}")
    assert lines[-1] == "raytrain: ops ready: pin_memory (cpu accelerator)", lines
    assert (tmp_path / "pin_memory" / "pin_memory.so").is_file(), list(tmp_path.rglob("*"))
    again = build_ops("pin_memory", extensions_dir=tmp_path)
    assert again.returncode == 0 and again.stdout.splitlines() == [lines[-1]], again.stdout + again.stderr


def test_an_unknown_op_is_one_line_naming_the_ops_there_are(tmp_path):
    p = build_ops("pin_memory", "cpu_adamw", extensions_dir=tmp_path)
    assert p.returncode == 2 and p.stdout == "", p.stdout + p.stderr
    [line] = p.stderr.splitlines()
    assert line.startswith("raytrain: error: cpu_adamw: not an op of DeepSpeed's cpu accelerator here; its ops: "), line
    assert "cpu_adam, " in line and "async_io" in line, line
    assert not any(tmp_path.rglob("*.so"))  # nothing built before the mistake was found


def test_an_op_this_machine_cannot_build_is_an_error_or_with_if_buildable_a_note(tmp_path):
    # DeepSpeed decides async_io's buildability by compiling a probe against libaio with $CC: a C compiler that
    # always fails is a machine without libaio-dev, as far as it can tell
    p = build_ops("async_io", extensions_dir=tmp_path, CC="false")
    assert p.returncode == 2 and p.stdout == "", p.stdout + p.stderr
    assert p.stderr.splitlines() == ["raytrain: error: async_io: cannot be built on this machine (DeepSpeed's "
                                     "ds_report says what it lacks, e.g. libaio-dev for async_io)"], p.stderr
    p = build_ops("--if-buildable", "async_io", extensions_dir=tmp_path, CC="false")
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.splitlines() == ["raytrain: note: async_io: cannot be built on this machine (DeepSpeed's "
                                     "ds_report says what it lacks, e.g. libaio-dev for async_io); left out",
                                     "raytrain: ops ready: none (cpu accelerator)"], p.stdout
    assert not any(tmp_path.rglob("*.so"))
