"""raytrain.compat: each private API raytrain uses still exists and still has the shape raytrain
relies on, for the versions installed. A failure here means a dependency moved: re-check the entry
(its docstring says what it is for) and bump compat.CHECKED."""

import inspect
from importlib import metadata

import pytest

from raytrain import compat


@pytest.mark.parametrize("dist", sorted(compat.CHECKED))
def test_installed_versions_are_the_checked_ones(dist):
    installed = metadata.version(dist).split("+")[0]
    assert installed == compat.CHECKED[dist], f"{dist} {installed} is not the checked {compat.CHECKED[dist]}"


def test_ray_trains_torch_backend_starts_the_process_group_in_on_start():
    from ray.train.backend import Backend

    assert issubclass(compat.TorchBackend, Backend)
    assert list(inspect.signature(compat.TorchBackend.on_start).parameters) == ["self", "worker_group", "backend_config"]


def test_ray_train_keeps_coordinators_of_stream_split_iterators():
    from ray.train.v2._internal.data_integration import dataset_manager

    source = inspect.getsource(dataset_manager)
    # the isinstance check and the attribute raytrain's ShardGroup poses with
    assert "isinstance(iterator, StreamSplitDataIterator)" in source and "iterator._coord_actor" in source
    owner = compat.SplitCoordinatorOwner("coordinator")
    assert owner._coord_actor == "coordinator"


def test_a_split_keeps_its_coordinator_in_the_attribute_compat_reads():
    from ray.data._internal.iterator.stream_split_iterator import StreamSplitDataIterator

    assert "self._coord_actor = coord_actor" in inspect.getsource(StreamSplitDataIterator.__init__)


def test_ray_trains_report_logger_is_keyed_by_the_context_modules_path():
    import logging

    from ray.train.v2._internal.execution import context

    assert "logger = logging.getLogger(__file__)" in inspect.getsource(context)
    compat.quiet_ray_train_report_log()
    assert logging.getLogger(context.__file__).level == logging.WARNING


def test_torch_extension_build_dir_is_per_op(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    build_dir = compat.torch_extension_build_dir("raytrain_probe_op")
    assert build_dir.is_dir() and build_dir.name == "raytrain_probe_op" and tmp_path in build_dir.parents


def test_deepspeed_compatible_ops_has_the_shm_comm_entry():
    import deepspeed.ops

    assert "deepspeed_shm_comm" in deepspeed.ops.__compatible_ops__
    before = deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"]
    try:
        compat.disable_deepspeed_op("deepspeed_shm_comm")
        assert deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] is False
    finally:
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = before


def test_deepspeed_builds_the_gpu_side_optimizer_with_a_copy_of_group_0():
    """The bug compat.share_backup_optimizer_param_groups works around (DeepSpeed 0.19.8, stage3.py:313-326):
    group 0's hyper-parameters are copied into a new AdamW, groups 1+ are the CPU optimizer's dicts. When
    this construction changes (upstream fixed it, or moved it), re-check the workaround."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    source = inspect.getsource(DeepSpeedZeroOptimizer_Stage3.__init__)
    assert "self.backup_optimizer = torch.optim.AdamW([backup_gpu_param]," in source
    assert 'lr=self.optimizer.param_groups[0]["lr"],' in source
    assert "self.backup_optimizer.add_param_group(self.optimizer.param_groups[i])" in source
    step = inspect.getsource(DeepSpeedZeroOptimizer_Stage3._optimizer_step)
    assert "self.backup_optimizer.param_groups[param_group_id]['params'] = [fp32_param]" in step
    # The workaround itself runs on a real DeepSpeed optimizer in tests/unit/worker/test_engine_offload.py.
