"""raytrain.hardware.allocator_env: the GPU workers' allocator default and who may override it."""

from raytrain.hardware import allocator_env


def test_gpu_workers_get_expandable_segments_by_default():
    assert allocator_env(True, {}) == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


def test_any_allocator_setting_of_the_user_wins_even_an_empty_one():
    """An empty PYTORCH_CUDA_ALLOC_CONF is the documented opt-out (torch's own default allocator)."""
    for env in ({"PYTORCH_CUDA_ALLOC_CONF": ""}, {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"},
                {"PYTORCH_ALLOC_CONF": "expandable_segments:False"}):
        assert allocator_env(True, env) == {}, env


def test_cpu_runs_get_nothing():
    assert allocator_env(False, {}) == {}

