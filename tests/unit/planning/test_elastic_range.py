"""An elastic range (scaling.num_workers: [min, max]) resolved on the driver (raytrain.planning.resolve):
the DeepSpeed plan of every world size, and the one-line refusals before anything starts, each
naming the sizes that fail. In-process `raytrain.main.main` calls, as a user's `--dry-run`."""

import json

import pytest

from raytrain.main import main

GOOD = ["scaling.num_workers=[2, 4]", "data.num_shards=12", "training.micro_batch_size_per_gpu=2",
        "deepspeed.train_batch_size=24"]


def dry_run(capsys, *args):
    code = main(["--dry-run", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_every_world_size_keeps_the_batch_with_its_own_accumulation(capsys):
    code, out, err = dry_run(capsys, *GOOD)
    assert code == 0, err
    plan = json.loads(out)
    assert (plan["cluster"]["min_workers"], plan["cluster"]["num_workers"]) == (2, 4)
    sizes = {p["world_size"]: p["ds_config"] for p in plan["world_sizes"]}
    assert {w: (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"])
            for w, ds in sizes.items()} == {2: (24, 2, 6), 3: (24, 2, 4), 4: (24, 2, 3)}
    assert sizes[4] == plan["config"]["deepspeed"]  # the top-level plan is the maximum's
    # the note that says what a node loss costs (a setting that runs, not an error)
    assert "raytrain: note: scaling.num_workers=[2, 4] is elastic (workers x gradient accumulation: 2 x 6, 3 x 4, " \
           "4 x 3); every node lost without notice costs one of checkpoint.max_failures=3" in err


@pytest.mark.parametrize("args, needle", [
    (["scaling.num_workers=[4, 2]"], "scaling.num_workers=[4, 2] has the minimum 4 above the maximum 2: write [2, 4]"),
    (["scaling.num_workers=[0, 2]"], "scaling.num_workers=[0, 2] has the minimum 0: an elastic range needs at least 1 worker"),
    (["scaling.num_workers=[1, 2, 3]"], "scaling.num_workers=[1, 2, 3] is neither a number of workers nor [min, max]"),
    (["scaling.num_workers=[2, 4]"], "scaling.num_workers=[2, 4]: an elastic run needs data.num_shards, divisible by "
                                     "every world size of the range (e.g. 12)"),
    ([*GOOD[:1], *GOOD[2:], "data.num_shards=8"], "scaling.num_workers=[2, 4]: data.num_shards=8 is not divisible by world size(s) "
                                   "[3]: use a multiple of 12 shards"),
    (["scaling.num_workers=[2, 4]", "data.num_shards=24", "training.micro_batch_size_per_gpu=1",
      "deepspeed.train_batch_size=12"], "deepspeed.train_batch_size=12 is not divisible by data.num_shards=24"),
    (["scaling.num_workers=[2, 4]", "data.num_shards=12", "training.micro_batch_size_per_gpu=8",
      "deepspeed.train_batch_size=48"],
     "scaling.num_workers=[2, 4]: train_batch_size=48 with micro-batch 8 needs a whole gradient accumulation at every "
     "world size, and [4] do(es) not divide 6: use a train_batch_size that is a multiple of 96"),
    (["scaling.num_workers=[2, 3]", "data.num_shards=6", "training.micro_batch_size_per_gpu=3",
      "deepspeed.train_batch_size=30"], "and [3] do(es) not divide 10"),
    ([*GOOD, "deepspeed.gradient_accumulation_steps=3"],
     "deepspeed.gradient_accumulation_steps=3 is fixed, and an elastic run changes it with the world size"),
    # host RAM per node grows with the workers on it: the range's minimum fits, 3 workers do not
    ([*GOOD, "--host-memory-gib", "3"], "scaling.num_workers=[2, 4], at world size 3: this run needs 3.1 GiB host RAM "
                                        "per node (3 workers x "),
    ([*GOOD, "scaling.replacement_timeout_s=-5"],
     "scaling.replacement_timeout_s must be a number in [0, 1000000000], got -5"),
    # "wait for ever": Ray's placement-group wait returned False at once from ~9e15 s (measured, Ray 2.60), so the
    # first group never started and the controller retried it without end, a traceback each time
    ([*GOOD, "scaling.replacement_timeout_s=1e18"],
     "scaling.replacement_timeout_s must be a number in [0, 1000000000], got 1e+18"),
    (["scaling.use_gpu=true", "scaling.num_workers=[8, 9]", "data.num_shards=72", "training.micro_batch_size_per_gpu=1",
      "deepspeed.train_batch_size=72", "deepspeed.zero_optimization.zero_hpz_partition_size=8"],
     "scaling.num_workers=[8, 9], at world size 9: deepspeed.zero_optimization.zero_hpz_partition_size=8 does not "
     "divide world size 9"),
    # below the maximum: the per-size plans (raytrain.planning.resolve.resolve_world_sizes) name the size
    (["scaling.use_gpu=true", "scaling.num_workers=[2, 4]", "data.num_shards=12", "training.micro_batch_size_per_gpu=1",
      "deepspeed.train_batch_size=12", "deepspeed.zero_optimization.zero_hpz_partition_size=4"],
     "scaling.num_workers=[2, 4], at world size 2: deepspeed.zero_optimization.zero_hpz_partition_size=4 does not "
     "divide world size 2"),
    (["scaling.num_workers=[3, 4]", *GOOD[1:], "deepspeed.gradient_accumulation_steps=3"],
     "scaling.num_workers=[3, 4]: deepspeed.gradient_accumulation_steps=3 is fixed"),
    (["scaling.num_workers=[1, 2]", "data.num_shards=2", "training.micro_batch_size_per_gpu=1",
      "deepspeed.train_batch_size=1"],
     "scaling.num_workers=[1, 2]: train_batch_size=1 with micro-batch 1 needs a whole gradient accumulation at every "
     "world size, and [2] do(es) not divide 1"),
    # checked at every size, not divided by (the range's check of the batch skips a micro-batch it cannot divide by)
    ([*GOOD[:2], GOOD[3], "deepspeed.train_micro_batch_size_per_gpu=0"], "scaling.num_workers=[2, 4], at world size 4: "
     "deepspeed.train_micro_batch_size_per_gpu must be a positive integer or \"auto\", got 0"),
])
def test_a_range_that_cannot_run_is_refused_in_one_line(capsys, args, needle):
    code, _, err = dry_run(capsys, *args)
    assert code == 2 and needle in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_a_range_of_one_size_may_fix_the_gradient_accumulation(capsys):
    """[4, 4] never changes its world size: a fixed gradient_accumulation_steps keeps train_batch_size there."""
    code, out, err = dry_run(capsys, "scaling.num_workers=[4, 4]", *GOOD[1:], "deepspeed.gradient_accumulation_steps=3")
    assert code == 0, err
    assert [(p["world_size"], p["ds_config"]["gradient_accumulation_steps"]) for p in json.loads(out)["world_sizes"]] \
        == [(4, 3)]


def test_a_range_that_checkpoints_only_at_the_end_is_told_what_each_resize_discards(capsys):
    """Every resize restarts from the latest checkpoint: with checkpoint.every_n_steps=0 (the default) that is
    where the run started, so each grow went back to step 0 without a word."""
    told = ("raytrain: note: scaling.num_workers=[2, 4] restarts from the latest checkpoint at every resize (a grow "
            "too), and checkpoint.every_n_steps=0 saves only at the end: each resize would discard every step since "
            "the run started or resumed; set checkpoint.every_n_steps (what a resize rolls back)\n")
    code, _, err = dry_run(capsys, *GOOD)
    assert code == 0 and told in err, err
    code, _, err = dry_run(capsys, *GOOD, "checkpoint.every_n_steps=20")
    assert code == 0 and "every_n_steps" not in err, err
    # [4, 4] never resizes: a restart after a failure is a fixed-size run's
    code, _, err = dry_run(capsys, "scaling.num_workers=[4, 4]", *GOOD[1:])
    assert code == 0 and "every_n_steps" not in err, err


SPLITS_AT_THE_MAXIMUM_ONLY = (
    "raytrain: error: scaling.num_workers=[2, 3]: train_batch_size=24 with micro-batch 8 needs a whole gradient "
    "accumulation at every world size, and [2] do(es) not divide 3: use a train_batch_size that is a multiple of 48, "
    "or a range without those sizes")


@pytest.mark.parametrize("args, how", [
    ([], ' (train_batch_size is "auto": micro-batch x gradient accumulation x the maximum 3 workers; set '
         'deepspeed.train_batch_size)'),
    (["deepspeed.train_batch_size=24"], " (the micro-batch was derived at the maximum 3 workers; set "
                                        "training.micro_batch_size_per_gpu, fixed across sizes)"),
    # both in the DeepSpeed JSON: refused as written, before anything is derived
    (["deepspeed.train_batch_size=24", "deepspeed.train_micro_batch_size_per_gpu=8"], ""),
], ids=["both-derived", "micro-derived", "both-written"])
def test_a_batch_that_splits_at_the_maximum_alone_names_the_value_raytrain_derived(capsys, args, how):
    code, _, err = dry_run(capsys, "scaling.num_workers=[2, 3]", "data.num_shards=6", *args)
    assert (code, err) == (2, f"{SPLITS_AT_THE_MAXIMUM_ONLY}{how}\n")


def test_the_sizes_a_batch_does_not_split_at_are_listed_up_to_seven():
    from raytrain.config import ConfigError
    from raytrain.planning.resolve import _check_batch_sizes
    from raytrain.run_spec import ClusterShape

    for high, listed, common in [(8, "2, 3, 4, 5, 6, 7, 8", 840), (9, "2, 3, 4, 5, 6, 7, 8 and 1 more", 2520)]:
        with pytest.raises(ConfigError) as e:
            _check_batch_sizes(ClusterShape(num_workers=high, min_workers=1, use_gpu=False), 1, 1)
        assert str(e.value) == (f"scaling.num_workers=[1, {high}]: train_batch_size=1 with micro-batch 1 needs a whole "
                                f"gradient accumulation at every world size, and [{listed}] do(es) not divide 1: use a "
                                f"train_batch_size that is a multiple of {common}, or a range without those sizes")


def test_a_range_too_wide_for_any_practical_shard_count_is_told_a_narrower_one(capsys):
    from raytrain.planning.resolve import MAX_ADVISED_SHARDS, _common_multiple, _too_wide
    from raytrain.run_spec import ClusterShape

    assert [_common_multiple(range(2, 5)), _common_multiple(range(3, 4)), _common_multiple(range(1, 20))] == [
        12, 3, None]
    assert _common_multiple(range(MAX_ADVISED_SHARDS, MAX_ADVISED_SHARDS + 1)) == MAX_ADVISED_SHARDS  # the bound: in
    wide = "for a range this wide the smallest such count is over 100,000: narrow it"
    assert _too_wide(ClusterShape(num_workers=20, min_workers=1, use_gpu=False)) == (
        f"{wide}, e.g. scaling.num_workers=[17, 20] with data.num_shards=58140")  # 17 x 18 x 19 x 20 / 2 / 2
    assert _too_wide(ClusterShape(num_workers=317, min_workers=316, use_gpu=False)) == wide  # 316 x 317 > 100,000
    assert _too_wide(ClusterShape(num_workers=100_001, min_workers=100_001, use_gpu=False)) == wide  # one size
    code, _, err = dry_run(capsys, "scaling.num_workers=[1, 30]")
    assert (code, err) == (2, "raytrain: error: scaling.num_workers=[1, 30]: an elastic run needs data.num_shards "
                              "divisible by every world size of the range, so that its data position means the same "
                              f"at any size, and {wide}, e.g. scaling.num_workers=[28, 30] with "
                              "data.num_shards=12180\n")


def test_a_derived_train_batch_size_the_shards_do_not_divide_says_how_it_was_derived_and_what_to_set(capsys):
    # was: "deepspeed.train_batch_size=32 is not divisible by data.num_shards=12": a value the user never wrote
    # (8 x 1 x 4 workers), and a fix (a multiple of 12: 36) that fails again at world size 3
    code, _, err = dry_run(capsys, "scaling.num_workers=[2, 4]", "data.num_shards=12")
    assert (code, err) == (2, "raytrain: error: scaling.num_workers=[2, 4]: deepspeed.train_batch_size is \"auto\", and "
                              "raytrain derived 32 at the range's maximum (micro-batch 8 x gradient accumulation 1 x 4 "
                              "workers), which data.num_shards=12 does not divide: every optimizer step takes "
                              "train_batch_size / num_shards rows from each data shard, and an elastic run keeps "
                              "train_batch_size at every world size: set deepspeed.train_batch_size to a multiple of 96 "
                              "(divisible by 12, and by micro-batch 8 x each world size from 2 to 4) and "
                              "training.micro_batch_size_per_gpu=8\n")
    code, out, err = dry_run(capsys, "scaling.num_workers=[2, 4]", "data.num_shards=12",
                             "deepspeed.train_batch_size=96", "training.micro_batch_size_per_gpu=8")  # the fix runs
    assert code == 0, err
    assert {p["world_size"]: p["ds_config"]["gradient_accumulation_steps"] for p in json.loads(out)["world_sizes"]} \
        == {2: 6, 3: 4, 4: 3}
    # a fixed size: the same, with the shard count that divides the derived batch as the other way out
    code, _, err = dry_run(capsys, "scaling.num_workers=4", "data.num_shards=12", 'deepspeed={"zero_optimization": {}}')
    assert (code, err) == (2, "raytrain: error: deepspeed.train_batch_size is not set, and raytrain derived 32 "
                              "(micro-batch 8 x gradient accumulation 1 x 4 workers), which data.num_shards=12 does not "
                              "divide: every optimizer step takes train_batch_size / num_shards rows from each data "
                              "shard: set deepspeed.train_batch_size=96 and training.micro_batch_size_per_gpu=8 "
                              "(gradient accumulation 3), or data.num_shards=8\n")
    assert dry_run(capsys, "scaling.num_workers=4", "data.num_shards=12", "deepspeed.train_batch_size=96",
                   "training.micro_batch_size_per_gpu=8")[0] == 0
    # the fewer shards named divide the batch, and the workers: 8 of 10 (a multiple of the 2 workers) does not divide 4
    code, _, err = dry_run(capsys, "scaling.num_workers=2", "data.num_shards=10", "training.micro_batch_size_per_gpu=2")
    assert code == 2 and err.endswith("set deepspeed.train_batch_size=20 and training.micro_batch_size_per_gpu=2 "
                                      "(gradient accumulation 5), or data.num_shards=4\n"), err
    code, _, err = dry_run(capsys, "scaling.num_workers=1", "data.num_shards=2", "training.micro_batch_size_per_gpu=3")
    assert code == 2 and err.endswith("set deepspeed.train_batch_size=6 and training.micro_batch_size_per_gpu=3 "
                                      "(gradient accumulation 2), or data.num_shards=1\n"), err


def test_the_plan_tool_checks_every_size_of_the_range_too(capsys):
    from raytrain.tools.plan import main as plan_main

    # the minimum (2 workers) fits in 3 GiB of host RAM per node, 3 workers on one node do not
    assert plan_main([*GOOD, "--host-memory-gib", "3"]) == 1
    assert "at world size 3: this run needs 3.1 GiB host RAM per node" in capsys.readouterr().err
    assert plan_main([*GOOD, "--host-memory-gib", "8"]) == 0


def resolve_on_cpus(cpus_total, *overrides):
    """resolve_run on a CPU cluster of `cpus_total` CPUs, as Ray's cluster_resources() reports it (no Ray started)."""
    from raytrain.config import load_config
    from raytrain.planning.resolve import resolve_run, shape_from_cluster

    cfg = load_config(None, ["scaling.use_gpu=false", *overrides])
    gpus = 2 if cfg.scaling.use_gpu else 0
    return resolve_run(cfg, shape_from_cluster(cfg, {"CPU": cpus_total, "GPU": gpus}, gpus or None))


@pytest.mark.parametrize("cpus_total, overrides", [
    (3, ["scaling.num_workers=2"]),  # one CPU left for Ray Data is enough
    (1, ["scaling.num_workers=2"]),  # a group above the cluster's CPUs: the autoscaler adds nodes for it
    (2, ["scaling.num_workers=2", "scaling.cpus_per_worker=0.5"]),  # fractions: 2 x 0.5 leave 1 of 2
    (2, ["scaling.num_workers=2", "scaling.use_gpu=true"]),  # a GPU run: the rule is for CPU-only clusters
], ids=["one-spare", "autoscaler", "fractions", "gpus"])
def test_workers_that_leave_ray_data_a_cpu_or_wait_for_the_autoscaler_pass(cpus_total, overrides):
    assert resolve_on_cpus(cpus_total, *overrides).cluster.cpus_total == cpus_total


@pytest.mark.parametrize("cpus_total, overrides, message", [
    (2, ["scaling.num_workers=2"],
     "2 workers x scaling.cpus_per_worker=1 leave 0 of the cluster's 2 CPUs for Ray Data, which then hangs: lower "
     "scaling.cpus_per_worker (fractions work) or add CPUs"),
    (1.5, ["scaling.num_workers=3", "scaling.cpus_per_worker=0.5"], "3 workers x scaling.cpus_per_worker=0.5 leave 0 "
                                                                     "of the cluster's 1.5 CPUs for Ray Data"),
    (2, ["scaling.num_workers=2", "scaling.cpus_per_worker=0.6"], "2 workers x scaling.cpus_per_worker=0.6 leave 0.8 "
                                                                  "of the cluster's 2 CPUs for Ray Data"),
    # Ray Train's elastic policy starts the largest group the CPUs hold: the 1 that starts takes the only CPU
    (1, ["scaling.num_workers=[1, 2]"], "scaling.num_workers=[1, 2] starts as many workers as the cluster's 1 CPUs "
                                        "hold, 1 x scaling.cpus_per_worker=1, which leave 0 for Ray Data, which then "
                                        "hangs: lower scaling.cpus_per_worker (fractions work), or add CPUs"),
    (2, ["scaling.num_workers=[1, 3]"], "scaling.num_workers=[1, 3] starts as many workers as the cluster's 2 CPUs "
                                        "hold, 2 x scaling.cpus_per_worker=1, which leave 0 for Ray Data, which then "
                                        "hangs: lower scaling.cpus_per_worker (fractions work), the range's maximum "
                                        "to 1, or add CPUs"),
], ids=["fixed", "fixed-fractions", "fixed-fraction-left", "elastic-at-min", "elastic-above-min"])
def test_workers_that_leave_ray_data_no_cpu_are_refused_naming_the_count(cpus_total, overrides, message):
    from raytrain.config import ConfigError

    with pytest.raises(ConfigError) as e:
        resolve_on_cpus(cpus_total, *overrides)
    assert str(e.value).startswith(message), str(e.value)
