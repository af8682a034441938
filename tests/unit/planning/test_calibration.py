"""The planner against the H200 measurements it is calibrated on (raytrain.planning.calibration): GPU and
host peaks within 10% of every measured row, the throughput model reproducing the rows its constants
come from. Each row is rebuilt with raytrain.tools.bench's own argument parser and resolution, so the
DeepSpeed dict is the one that ran. docs/plan-accuracy.md records the same comparison."""

from types import SimpleNamespace

import pytest

from raytrain.planning import calibration, throughput
from raytrain.planning.estimate import Estimate, MemoryFacts, Setting
from raytrain.tools import bench, bench_paths

# The rows each throughput constant is fitted on (raytrain/planning/throughput.py names them): reproduced
# within 3% (constants fitted on several rows at once, one value for all, do not meet each row exactly).
FITTED = ("1b-mb24-ga4", "1b-mb24-ga4-offload", "1b-mb24-ga4-ratio0.5", "1b-mb24-ga4-ratio0.25", "7b-mb2-ga8-ckpt",
          "8.1b-mb1-ckpt", "1b-mb4-1202b", "7b-mb1-1202c", "1b-mb4-unfused-1202c", "1b-mb12-docmask-1207h")
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


@pytest.mark.parametrize("row", [r for r in calibration.ROWS if "--gpu-memory-fraction" in r.argv()],
                         ids=lambda r: r.id)
def test_a_capped_row_ran_within_its_cap_and_fills_most_of_it(row):
    """The rows run under a GPU cap (a fraction of the H200's 143,771 MiB) are the planner's picks and runners-up for
    it: torch enforces the cap, and the largest setting that fits comes within 20% of it."""
    argv = row.argv()
    cap_gib = float(argv[argv.index("--gpu-memory-fraction") + 1]) * 143_771 / 1024
    assert 0.8 * cap_gib < row.gpu_peak_gib < cap_gib, (row.gpu_peak_gib, cap_gib)


@pytest.mark.parametrize("row", [r for r in calibration.ROWS if "zero_optimization.stage=2" in r.bench_args],
                         ids=lambda r: r.id)
def test_zero_stage_2_gpu_peaks_within_5_percent(row, predictions):
    predicted = predictions[row.id]["gpu_peak_gib"]
    assert predicted == pytest.approx(row.gpu_peak_gib, rel=0.05), (predicted, row.gpu_peak_gib)


def test_the_offload_ratio_leaves_one_param_groups_gpu_peak_as_measured(predictions):
    """The issue's plain runs (one param group) at offload ratios 0.5 and 0.25 peaked the same (79.0 GiB): one
    group's sub-groups, not the ratio, set the peak; raytrain's two groups would not."""
    half, quarter = (calibration.BY_ID[i] for i in ("1b-mb24-ga4-ratio0.5", "1b-mb24-ga4-ratio0.25"))
    assert half.gpu_peak_gib == quarter.gpu_peak_gib
    assert predictions[half.id]["gpu_peak_gib"] == pytest.approx(predictions[quarter.id]["gpu_peak_gib"], rel=1e-9)


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


@pytest.mark.parametrize("off_id, on_id", [("1b-ga4-layers-off-1202", "1b-ga4-layers-1202"),
                                           ("1b-ga4-layers-off-1202a", "1b-ga4-layers-1202a")])
def test_fused_layers_factor_reproduces_both_pairs_of_rows(off_id, on_id, predictions):
    """The pairs ran on other machines than the rows above (3.9% faster as shipped): only the first pair's ratio is
    fitted; machine "a"'s pair, held out, measured the same gain."""
    off, on = calibration.BY_ID[off_id], calibration.BY_ID[on_id]
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


# The 1.1B shape (configs/llama-1b-1gpu.yaml) as the model's formulas read it, for predictions pinned by hand.
TINYLLAMA = SimpleNamespace(model_type="llama", hidden_size=2048, num_hidden_layers=22, num_attention_heads=32,
                            num_key_value_heads=4, intermediate_size=5632, vocab_size=32000, tie_word_embeddings=False)
N_1B = 1_100_048_384


def by_hand(setting, *, on_host=0, **facts):
    f = MemoryFacts(**{"use_gpu": True, "world_size": 1, "workers_per_node": 1, "stats": SimpleNamespace(
        num_params=N_1B), "hf_config": TINYLLAMA, "seq_len": 2048, "precision": "bf16", "stage": 3, "zero": {},
        "liger_kernel": "all", **facts})
    n_rank = -(-N_1B // f.world_size)
    return f, Estimate(setting=setting, worker_bytes=0, host_bytes_per_node=0, breakdown=(),
                       params_on_gpu=n_rank - on_host, params_on_host=on_host)


def test_prediction_without_offload_by_hand():
    """t_step = GA t_micro + T_STEP_FIXED + 30 N / HBM (bf16, fp32 states); at 24 x 2048 tokens of hidden 2048
    eta is its plateau (Liger's kernels all on: LIGER_FACTOR 1), and the GPU's time and the host's blend at power
    HOST_GPU_BLEND_P."""
    p = throughput.predict(*by_hand(Setting(24, False)), grad_accum=4, cpus_per_worker=14)
    fpt = 6 * N_1B + 12 * 22 * 2048 * 2048
    t_gpu = fpt * 24 * 2048 / (989e12 * throughput.ETA_PLATEAU)
    t_host = 22 * throughput.HOST_S_PER_LAYER[False]
    t_micro = (t_gpu**8 + t_host**8) ** (1 / 8)
    assert p.compute_s == pytest.approx(4 * t_micro, rel=1e-12)
    assert p.optimizer_s == pytest.approx(throughput.T_STEP_FIXED + 30 * N_1B / throughput.HBM_ADAM_BYTES_PER_S,
                                          rel=1e-12)
    assert p.step_time_s == pytest.approx(p.compute_s + p.optimizer_s, rel=1e-12)
    assert p.tokens_per_s == pytest.approx(4 * 24 * 2048 / p.step_time_s, rel=1e-12)
    assert p.mfu == pytest.approx(p.tokens_per_s * fpt / 989e12, rel=1e-12)
    # on two GPUs each rank steps half the states
    two = throughput.predict(*by_hand(Setting(24, False), world_size=2), grad_accum=4, cpus_per_worker=14)
    assert two.optimizer_s == pytest.approx(throughput.T_STEP_FIXED + 15 * N_1B / throughput.HBM_ADAM_BYTES_PER_S,
                                            rel=1e-12)


def test_checkpointing_fused_layers_and_fp8_by_hand():
    """Checkpointing reruns the decoder layers' forward (2 N_layers + 4 L H S flops, at RECOMPUTE_COST a flop) and
    the host's hooks (HOST_CKPT_FACTOR); FP8 speeds up the projections' share g of the flops, recompute included."""
    p = throughput.predict(*by_hand(Setting(24, True), fused_layers=True, fp8=True), grad_accum=2,
                           cpus_per_worker=14)
    fpt = 6 * N_1B + 12 * 22 * 2048 * 2048
    recompute = 2 * (N_1B - 2 * 32000 * 2048 - 2048) + 4 * 22 * 2048 * 2048  # untied head, final norm
    ckpt = 1 + throughput.RECOMPUTE_COST * recompute / fpt
    # q, k, v and o (kv: 4 heads of 64) and the MLP's three, forward + backward; the recompute adds a forward
    projections = 6 * 22 * (2048 * (2048 + 2 * 256) + 2048 * 2048 + 3 * 2048 * 5632)
    g = projections * (1 + throughput.RECOMPUTE_COST / 3) / (fpt * ckpt)
    t_gpu = (fpt * 24 * 2048 * ckpt / (989e12 * throughput.ETA_PLATEAU * throughput.FUSED_LAYERS_FACTOR)
             * (1 - g + g / throughput.FP8_GEMM_SPEEDUP))
    t_host = 22 * throughput.HOST_S_PER_LAYER[True] * throughput.HOST_CKPT_FACTOR[True]
    assert p.compute_s == pytest.approx(2 * (t_gpu**8 + t_host**8) ** (1 / 8), rel=1e-12)
    assert p.mfu == pytest.approx(p.tokens_per_s * fpt / 989e12, rel=1e-12)  # model flops: no recompute


def test_optimizer_offload_by_hand():
    """The gradients' round trip (2N + 4N (GA - 1) bytes, K_VISIBLE of it visible), CPU Adam on the host's
    parameters and torch's AdamW (3 mw + 2 st + mw bytes) on the GPU's, per rank of two."""
    setting = Setting(24, False, offload_optimizer=True, ratio=0.5)
    f, e = by_hand(setting, on_host=400_000_000, world_size=2, bf16_states=True)
    p = throughput.predict(f, e, grad_accum=3, cpus_per_worker=4)
    pcie = throughput.K_VISIBLE * 2 * (N_1B // 2) * 5 / throughput.PCIE_BYTES_PER_S
    cpu = 400_000_000 * throughput.cpu_adam_s_per_param(4, True)
    gpu = (N_1B // 2 - 400_000_000) * (3 * 4 + 2 * 4 + 4) / throughput.HBM_ADAM_BYTES_PER_S
    assert p.optimizer_s == pytest.approx(throughput.T_STEP_FIXED + pcie + cpu + gpu, rel=1e-12)
    # the same facts without the offload step only the HBM pass
    p = throughput.predict(*by_hand(Setting(24, False), world_size=2, bf16_states=True), grad_accum=3,
                           cpus_per_worker=4)
    assert p.optimizer_s == pytest.approx(throughput.T_STEP_FIXED + (N_1B // 2) * 22 / throughput.HBM_ADAM_BYTES_PER_S,
                                          rel=1e-12)


@pytest.mark.parametrize("checkpointing, copies", [(False, 2), (True, 3)])
def test_parameter_offload_copies_the_parameters_each_pass(checkpointing, copies):
    """Every forward and backward (and with checkpointing the recompute) copies all N parameters H2D, per
    micro-batch, not overlapped."""
    off, on = (throughput.predict(*by_hand(Setting(8, checkpointing, offload_optimizer=True, offload_param=param),
                                           on_host=N_1B), grad_accum=4, cpus_per_worker=14)
               for param in (False, True))
    assert on.compute_s - off.compute_s == pytest.approx(4 * copies * 2 * N_1B / throughput.PCIE_BYTES_PER_S,
                                                         rel=1e-9)
    assert on.optimizer_s == off.optimizer_s


def test_eta_falls_linearly_below_the_reference_gemm_size():
    plateau, slope = throughput.ETA_PLATEAU, throughput.ETA_SLOPE
    assert throughput.eta(2048, 24, 2048) == throughput.eta(2048, 96, 2048) == pytest.approx(plateau, rel=1e-12)
    assert throughput.eta(2048, 12, 2048) == pytest.approx(plateau * (1 - slope / 2), rel=1e-12)
    # x scales with hidden squared: 4096 at a quarter of the tokens is the same x
    assert throughput.eta(4096, 3, 2048) == pytest.approx(throughput.eta(2048, 12, 2048), rel=1e-12)


def test_cpu_adam_scales_with_threads_between_1_and_16():
    base, exponent = throughput.CPU_ADAM_S_PER_PARAM_14_THREADS, throughput.CPU_ADAM_THREAD_EXPONENT
    assert throughput.cpu_adam_s_per_param(14, False) == pytest.approx(base, rel=1e-12)
    assert throughput.cpu_adam_s_per_param(0.5, False) == throughput.cpu_adam_s_per_param(1, False) == pytest.approx(
        base * 14**exponent, rel=1e-12)
    assert throughput.cpu_adam_s_per_param(64, False) == throughput.cpu_adam_s_per_param(16, False) == pytest.approx(
        base * (14 / 16) ** exponent, rel=1e-12)
    assert throughput.cpu_adam_s_per_param(14, True) == pytest.approx(base * throughput.CPU_ADAM_BF16_FACTOR,
                                                                      rel=1e-12)


def test_recompute_flops_leave_out_the_embedding_and_an_untied_head():
    cfg = SimpleNamespace(hidden_size=64, num_hidden_layers=2, vocab_size=100)
    attention = 4 * 2 * 64 * 16
    assert throughput.recompute_flops_per_token(cfg, 20_000, 16) == 2 * (20_000 - 6400 - 6400 - 64) + attention
    tied = SimpleNamespace(**vars(cfg), tie_word_embeddings=True)
    assert throughput.recompute_flops_per_token(tied, 20_000, 16) == 2 * (20_000 - 6400 - 64) + attention
    no_vocab = SimpleNamespace(hidden_size=64, num_hidden_layers=2)
    assert throughput.recompute_flops_per_token(no_vocab, 20_000, 16) == 2 * (20_000 - 64) + attention
    assert throughput.recompute_flops_per_token(cfg, 100, 16) == attention  # never negative
