"""raytrain.hardware: this machine's GPUs as nvidia-smi lists them and the plan target they make (an
nvidia-smi of our own on PATH stands in for the driver's), and allocator_env: the GPU workers' allocator
default and who may override it."""

import os
import sys

import psutil
import pytest

from raytrain.hardware import Gpu, Target, allocator_env, gpus, this_machine

MIB = 2**20


@pytest.fixture
def nvidia_smi(tmp_path, monkeypatch):
    """Puts an `nvidia-smi` that prints `stdout` and exits with `rc` first on PATH; returns its setter."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")

    def install(stdout, rc=0):
        (bin_dir / "nvidia-smi").write_text(f"#!/bin/sh\ncat <<'END'\n{stdout}END\nexit {rc}\n")
        (bin_dir / "nvidia-smi").chmod(0o755)
    return install


def test_every_gpu_nvidia_smi_lists_is_read_with_its_memory_in_bytes(nvidia_smi):
    nvidia_smi("NVIDIA H100 80GB HBM3, 550.54.15, 81559\n\nNVIDIA A100-SXM4-40GB, 550.54.15, 40960\n")
    assert gpus(use_torch=False) == [Gpu("NVIDIA H100 80GB HBM3", "550.54.15", 81559 * MIB),
                                     Gpu("NVIDIA A100-SXM4-40GB", "550.54.15", 40960 * MIB)]


def test_this_machine_is_planned_against_its_smallest_gpu_its_gpu_count_and_its_ram(nvidia_smi):
    nvidia_smi("NVIDIA A100-SXM4-40GB, 550.54.15, 40960\nNVIDIA H100 80GB HBM3, 550.54.15, 81559\n")
    ram = psutil.virtual_memory().total
    assert this_machine() == Target(gpu_memory_bytes=40960 * MIB, host_memory_bytes=ram, gpus_per_node=2)
    assert this_machine(with_gpus=False) == Target(host_memory_bytes=ram)  # the RAM only: GPUs not asked


@pytest.mark.parametrize("stdout,rc", [
    ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n", 9),
    ("NVIDIA H100 80GB HBM3, 550.54.15, [N/A]\n", 0),  # a value it could not read
    (None, 0)])  # not installed
def test_without_a_gpu_nvidia_smi_can_read_and_torch_not_to_be_asked_there_are_none(
        stdout, rc, nvidia_smi, monkeypatch):
    if stdout is not None:
        nvidia_smi(stdout, rc)
    else:
        monkeypatch.setenv("PATH", "")
    monkeypatch.setitem(sys.modules, "torch", None)  # use_torch=False: torch is not imported (nor CUDA initialised)
    assert gpus(use_torch=False) == []
    assert this_machine(with_gpus=False) == Target(host_memory_bytes=psutil.virtual_memory().total)


def test_gpu_workers_get_expandable_segments_by_default():
    assert allocator_env(True, {}) == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


def test_any_allocator_setting_of_the_user_wins_even_an_empty_one():
    """An empty PYTORCH_CUDA_ALLOC_CONF is the documented opt-out (torch's own default allocator)."""
    for env in ({"PYTORCH_CUDA_ALLOC_CONF": ""}, {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"},
                {"PYTORCH_ALLOC_CONF": "expandable_segments:False"}):
        assert allocator_env(True, env) == {}, env


def test_cpu_runs_get_nothing():
    assert allocator_env(False, {}) == {}
