"""The planner against the H200 measurements it is calibrated on (raytrain.planning.calibration): GPU and
host peaks within 10% of every measured row, the throughput model reproducing the rows its constants
come from. Each row is rebuilt with raytrain.tools.bench's own argument parser and resolution, so the
DeepSpeed dict is the one that ran. docs/plan-accuracy.md records the same comparison."""

import pytest

from raytrain.planning import calibration, throughput
from raytrain.tools import bench, bench_paths

# The rows each throughput constant is fitted on (raytrain/planning/throughput.py names them): reproduced
# within 3% (constants fitted on several rows at once, one value for all, do not meet each row exactly).
FITTED = ("1b-mb24-ga4", "1b-mb24-ga4-offload", "1b-mb24-ga4-ratio0.5", "1b-mb24-ga4-ratio0.25", "7b-mb2-ga8-ckpt",
          "8.1b-mb1-ckpt", "1b-mb4-1202b", "7b-mb1-1202c", "1b-mb4-unfused-1202c")
# Rows whose tokens/s the model is not meant to reproduce: the first round's micro-batch 16 ran DeepSpeed's default
# ZeRO-3 buckets and thresholds at GA 1 (15-18% slower than the tuned ones the model is calibrated on); only
# their ratio is used (LIGER_FACTOR["none"]).
NOT_MODELLED = {"1b-mb16", "1b-mb16-liger"}
# Rows of a host that did ZeRO-3's per-layer work in under half the time of the machines the host term is fitted on
# (session 50): the model keeps the slower term, so their small micro-batches are under-predicted, never over.
FAST_HOST = {r.id for r in calibration.ROWS if r.id.endswith("-1205")}
# The micro-batch curve, checkpointing's cost and the planner's capped picks, as ratios of rows measured on one
# machine in one session: each row's tokens/s over the same machine's shipped micro-batch (its reference).
SAME_MACHINE = {**dict.fromkeys(("1b-mb18-cap70-1202b", "1b-mb16-1202b", "1b-mb12-1202b", "1b-mb8-1202b",
                                 "1b-mb4-1202b", "1b-mb24-ckpt-1202b", "1b-mb33-cap24-1202b",
                                 "1b-mb22-cap70-offload-1202b"), "1b-mb24-1202b"),
                "1b-mb12-cap24-ckpt-1202e": "1b-mb24-1202e",
                **dict.fromkeys(("1b-mb12-cap24-ckpt-1202f", "1b-mb55-cap24-offload-ckpt-1202f",
                                 "1b-mb37-cap20-ratio0.86-ckpt-1202f"), "1b-mb24-1202f")}


def prediction(row: calibration.Row) -> dict:
    args = bench.parse_args(row.argv())
    overrides = bench.overrides_for(args, use_gpu=True) + [f"scaling.cpus_per_worker={row.cpus}"]
    return bench_paths.predicted(bench_paths.resolve(overrides, 1, True), param_groups=row.param_groups)


@pytest.fixture(scope="module")
def predictions():
    return {row.id: prediction(row) for row in calibration.ROWS}


@pytest.mark.parametrize("row", [r for r in calibration.ROWS if r.gpu_peak_gib], ids=lambda r: r.id)
def test_gpu_peak_within_10_percent(row, predictions):
    predicted = predictions[row.id]["gpu_peak_gib"]
    assert predicted == pytest.approx(row.gpu_peak_gib, rel=0.10), (predicted, row.gpu_peak_gib)


@pytest.mark.parametrize("row", [r for r in calibration.ROWS if r.host_used_gib], ids=lambda r: r.id)
def test_host_peak_within_10_percent(row, predictions):
    predicted = predictions[row.id]["host_gib"]
    assert predicted == pytest.approx(row.host_used_gib, rel=0.10), (predicted, row.host_used_gib)


@pytest.mark.parametrize("row_id", FITTED)
def test_throughput_reproduces_the_rows_it_is_fitted_on(row_id, predictions):
    row = calibration.BY_ID[row_id]
    assert predictions[row_id]["tokens_per_s"] == pytest.approx(row.tokens_per_s, rel=0.03)


@pytest.mark.parametrize("row", [r for r in calibration.ROWS if r.id not in NOT_MODELLED | FAST_HOST],
                         ids=lambda r: r.id)
def test_throughput_within_11_percent_of_every_row(row, predictions):
    """Held-out rows included (the 7.24B and 13B planner choices, the capped and offloaded 1.1B runs). The
    worst are the host-bound checkpointed micro-batches (-10.5% and +8.1%: one factor for both models)."""
    assert predictions[row.id]["tokens_per_s"] == pytest.approx(row.tokens_per_s, rel=0.11)


@pytest.mark.parametrize("row_id", SAME_MACHINE)
def test_micro_batch_curve_and_checkpointing_match_one_machines_ratios(row_id, predictions):
    """Machines differ by a few percent at the same setting; within one machine the model must rank right."""
    ref = SAME_MACHINE[row_id]
    measured = calibration.BY_ID[row_id].tokens_per_s / calibration.BY_ID[ref].tokens_per_s
    predicted = predictions[row_id]["tokens_per_s"] / predictions[ref]["tokens_per_s"]
    # 4%: the offloaded row's constants come from other rows (-1.6% and +1.9% against this machine's)
    assert predicted == pytest.approx(measured, rel=0.04), (predicted, measured)


def test_the_24_gib_pick_beats_its_runner_up_as_measured(predictions):
    """The planner's choice at 24 GiB (no offload, checkpointing, mb 12) against the runner-up it printed (full
    offload, checkpointing, mb 55), measured on one machine 11.7% apart: the model keeps that order."""
    pick, runner_up = "1b-mb12-cap24-ckpt-1202f", "1b-mb55-cap24-offload-ckpt-1202f"
    assert predictions[pick]["tokens_per_s"] > 1.05 * predictions[runner_up]["tokens_per_s"]


def test_fp16_with_offload_is_planned_as_fast_as_bf16_as_measured(predictions):
    """raytrain drops DeepSpeed's host-side overflow scan (compat.skip_host_overflow_scan), so fp16 with the
    optimizer on the host steps as fast as bf16 (99.7% measured in one call; 78% with the scan): the model
    must not charge fp16 for it."""
    bf16, fp16 = (calibration.BY_ID[i] for i in ("1b-mb24x4-offload-1202g", "1b-mb24x4-fp16-offload-1202g"))
    ratio = predictions[fp16.id]["tokens_per_s"] / predictions[bf16.id]["tokens_per_s"]
    assert ratio == pytest.approx(fp16.tokens_per_s / bf16.tokens_per_s, rel=0.01)


def test_liger_none_factor_reproduces_its_pair_of_rows(predictions):
    none, liger = (calibration.BY_ID[i] for i in ("1b-mb16", "1b-mb16-liger"))
    ratio = predictions[none.id]["tokens_per_s"] / predictions[liger.id]["tokens_per_s"]
    assert ratio == pytest.approx(none.tokens_per_s / liger.tokens_per_s, rel=0.01)


@pytest.mark.parametrize("row_id", sorted(FAST_HOST))
def test_a_faster_host_is_under_predicted_never_over(row_id, predictions):
    """On a faster host the same settings ran up to 1.79x (ZeRO-3, micro-batch 4) and 4.1x (stage 2, micro-batch 1)
    their prediction: a small micro-batch's prediction is a floor over the hosts measured, and where the GPU bounds
    the micro-batch (8 sequences of 1.1B) the model stays within 11%."""
    row, predicted = calibration.BY_ID[row_id], predictions[row_id]["tokens_per_s"]
    assert predicted <= row.tokens_per_s
    if "-mb8-" in row_id:
        assert predicted == pytest.approx(row.tokens_per_s, rel=0.11)


def test_a_small_micro_batch_is_host_bound():
    """Below the micro-batch where the host's per-layer work exceeds the GPU's, a smaller micro-batch takes
    as long (1.1B at 4 and 8 sequences: 0.209 s and 0.227 s measured), so tokens/s fall in proportion."""
    assert throughput.host_s(22, True, False) == pytest.approx(0.209, rel=0.02)
    assert throughput.host_s(22, False, False) > 1.5 * throughput.host_s(22, True, False)
    assert throughput.host_s(22, True, True) > throughput.host_s(22, True, False)


def test_fused_layers_factor_reproduces_its_pair_of_rows(predictions):
    """The pair ran on another machine than the rows above (3.9% faster as shipped): only its ratio is fitted."""
    off, on = (calibration.BY_ID[i] for i in ("1b-ga4-layers-off-1202", "1b-ga4-layers-1202"))
    ratio = predictions[on.id]["tokens_per_s"] / predictions[off.id]["tokens_per_s"]
    assert ratio == pytest.approx(on.tokens_per_s / off.tokens_per_s, rel=0.002)
    assert "1b-ga4-layers-off-1202" in open(throughput.__file__).read()


def test_fp8_speedup_reproduces_both_pairs_of_rows(predictions):
    """One constant for all shapes: the projections' share of the flops (0.75 at 1.1B, 0.87 at 7.24B with
    checkpointing) carries the difference between +21% and +36%. The 13B pair (held out, session 41: +22.6%
    measured, +27.7% predicted) is the loosest: at micro-batch 3 the weights' casts, paid per micro-batch whatever
    its size, weigh more than at 15 or 24 (a reading, not profiled; the constant does not model them)."""
    for off, on in (("1b-mb24-bf16-1204", "1b-mb24-fp8-1204"), ("7b-mb15-ckpt-bf16-1204", "7b-mb15-ckpt-fp8-1204"),
                    ("13b-mb3-ckpt-bf16-1204", "13b-mb3-ckpt-fp8-1204")):
        ratio = predictions[on]["tokens_per_s"] / predictions[off]["tokens_per_s"]
        measured = calibration.BY_ID[on].tokens_per_s / calibration.BY_ID[off].tokens_per_s
        assert ratio == pytest.approx(measured, rel=0.05), (on, ratio, measured)
    assert predictions["1b-mb24-fp8-1204"]["gpu_peak_gib"] < predictions["1b-mb24-bf16-1204"]["gpu_peak_gib"] - 7


def test_every_fitted_row_is_named_by_a_constant():
    source = open(throughput.__file__).read()
    assert all(row_id in source for row_id in FITTED + tuple(SAME_MACHINE)[:4])
    named = {word.strip(",.():;") for word in source.split()}
    rows = {w for w in named if w.startswith(("1b-", "7b-", "8.1b-", "13b-"))}
    assert rows <= set(calibration.BY_ID), rows - set(calibration.BY_ID)  # no constant names a row that is gone
