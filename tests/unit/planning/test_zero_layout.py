"""raytrain.planning.zero_layout mirrors DeepSpeed 0.19.8's sub-groups and offload split: the source it
mirrors is pinned here, the arithmetic checked by hand and on the issue's models (the split against
DeepSpeed's own sub-group sizes runs in tests/unit/worker/test_engine_offload.py)."""

import inspect
import json

import pytest

from raytrain.config import load_config
from raytrain.model import load_model_config, param_stats
from raytrain.planning import zero_layout


def test_the_mirrored_deepspeed_code_is_unchanged():
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Stage3

    subs = inspect.getsource(Stage3._create_fp16_sub_groups)
    assert "if sub_group_size is None or sub_group_size >= params_group_numel:" in subs
    assert "if local_sub_group_size >= sub_group_size or id(param) == id(params_group[-1]):" in subs
    split = inspect.getsource(Stage3._create_fp32_partitions)
    assert "if i >= int((1 - self.partial_offload) * sub_group_size):" in split


def test_the_default_sub_group_size_is_deepspeeds_and_the_first_the_planner_tries():
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    assert zero_layout.DEFAULT_SUB_GROUP_SIZE == DeepSpeedZeroConfig().sub_group_size == 1_000_000_000
    assert zero_layout.SUB_GROUP_SIZES[0] == zero_layout.DEFAULT_SUB_GROUP_SIZE


def test_sub_groups_close_after_the_parameter_that_crosses_the_size():
    assert zero_layout.sub_groups([[4, 4, 4, 4, 3]], world_size=1, sub_group_size=7) == [8, 8, 3]
    assert zero_layout.sub_groups([[4, 4, 4, 4, 3]], world_size=1, sub_group_size=19) == [19]  # fits: one group
    # numbered across param groups; each parameter's partition is ceil(numel / world)
    assert zero_layout.sub_groups([[9, 9], [3]], world_size=2, sub_group_size=5) == [5, 5, 2]
    # a group no larger than the size is one sub-group before any cutting: a trailing empty parameter (the running
    # size reaching sub_group_size at the one before it) opens no second, empty sub-group
    assert zero_layout.sub_groups([[4, 3, 0]], world_size=1, sub_group_size=7) == [7]


def test_split_is_deepspeeds_expression_with_its_float_rounding():
    subs = [1] * 7
    assert zero_layout.num_on_gpu(7, 0.6) == 2  # int((1 - 0.6) * 7) = int(2.8000000000000003)
    assert zero_layout.num_on_gpu(3, 1 - 1 / 3) == 0  # the naive ratio for 1 of 3 keeps none: 0.9999999999999998
    assert zero_layout.split(subs, 1.0) == ([], subs)
    for num in (1, 2, 3, 7, 14, 66, 131, 500, 2000):  # 4 decimals split up to thousands of sub-groups exactly
        for k in range(num):
            ratio = zero_layout.ratio_for(num, k)
            assert zero_layout.num_on_gpu(num, ratio) == k and round(ratio, 4) == ratio
    # the middle of the interval that keeps 2 of 7 on the GPU, (1 - 3/7, 1 - 2/7] = (0.5714, 0.7143]
    assert zero_layout.ratio_for(7, 2) == 0.6429
    with pytest.raises(ValueError):
        zero_layout.ratio_for(3, 3)
    # 1 of 30,000 sub-groups on the GPU needs a ratio in (1 - 2/30000, 1 - 1/30000] = (0.99993, 0.99997]: no
    # 4-decimal number lies there (0.9999 keeps 2 in float, 1.0 none)
    with pytest.raises(ValueError, match="no 4-decimal ratio keeps 1 of 30000"):
        zero_layout.ratio_for(30_000, 1)


@pytest.mark.parametrize("shape, two_groups, one_group", [
    ({"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22, "num_attention_heads": 32,
      "num_key_value_heads": 4}, [1011.4, 88.6, 0.1], [1011.4, 88.6]),
    ({"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
      "num_key_value_heads": 8}, [1003.5, 1031.8, 1031.8, 1006.6, 1015.0, 1031.8, 1120.9, 0.3],
     [1003.5, 1031.8, 1031.8, 1006.7, 1015.1, 1031.8, 1121.0]),
], ids=["1.1B", "7.24B"])
def test_the_issues_models_at_the_default_sub_group_size(shape, two_groups, one_group):
    cfg = load_config(None, [f"model.config={json.dumps({**shape, 'vocab_size': 32000})}"])
    stats = param_stats(load_model_config(cfg.model))
    for raytrain_optimizer, expected in ((True, two_groups), (False, one_group)):
        groups = zero_layout.param_groups(stats.param_numels, stats.param_ndims, raytrain_optimizer)
        subs = zero_layout.sub_groups(groups, world_size=1, sub_group_size=zero_layout.DEFAULT_SUB_GROUP_SIZE)
        assert [round(x / 1e6, 1) for x in subs] == expected
    # the issue's ratios 0.5 and 0.25 split the 1.1B model's one group the same way (its two rows' equal peaks)
    if len(one_group) == 2:
        assert zero_layout.num_on_gpu(2, 0.5) == zero_layout.num_on_gpu(2, 0.25) == 1
