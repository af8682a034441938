"""What every logged window reports (raytrain.worker.metrics): StepMeter's numbers from a window of steps,
and TrainMetrics over a real one-rank gloo process group (CPU). The loop's windows on two ranks:
tests/unit/worker/test_loop.py."""

import math
import time

import psutil
import pytest
import torch

from raytrain.worker.metrics import StepMeter, TrainMetrics, _memory_gib

CPU = torch.device("cpu")


@pytest.mark.parametrize("peak, mfu", [(None, None), (8e6, 0.25)])
def test_a_window_reports_its_throughput_timing_eta_and_mfu_where_the_peak_is_known(peak, mfu):
    meter = StepMeter(max_steps=10, tokens_per_step=500, flops_per_token=2000.0, peak_flops_total=peak)
    for wait in (0.25, 0.5, 0.25, 0.0):
        meter.step(wait)
    m = meter.collect(step=4, loss=2.5, lr=1e-3, grad_norm=None, device=CPU, elapsed=2.0)
    assert {k: m[k] for k in ("step", "loss", "lr", "tokens_per_s", "step_time_s", "data_wait_frac", "eta_s")} == {
        "step": 4, "loss": 2.5, "lr": 1e-3, "tokens_per_s": 1000.0, "step_time_s": 0.5, "data_wait_frac": 0.5,
        "eta_s": 3.0}
    assert math.isnan(m["grad_norm"])  # no grad norm this window: nan, which the tracker leaves out
    assert m.get("mfu") == mfu  # 1000 tokens/s x 2000 FLOPs / 8e6 FLOP/s; none on CPU (no peak)
    assert meter.steps_done == 4
    # the next window counts only its own steps and data wait
    meter.step(0.1)
    m = meter.collect(step=5, loss=2.0, lr=1e-3, grad_norm=0.75, device=CPU, elapsed=1.0)
    assert (m["tokens_per_s"], m["step_time_s"], m["data_wait_frac"], m["eta_s"], m["grad_norm"]) == (
        500.0, 1.0, 0.1, 5.0, 0.75)
    assert meter.steps_done == 5


def test_a_window_times_itself_from_its_start():
    meter = StepMeter(max_steps=10, tokens_per_step=100, flops_per_token=1.0, peak_flops_total=None)
    meter.window_start = time.perf_counter() - 1000.0
    assert meter.window_elapsed_s() >= 1000.0
    meter.step(0.0)
    meter.step(0.0)
    m = meter.collect(step=2, loss=1.0, lr=1e-3, grad_norm=1.0, device=CPU)  # 200 tokens in 1000 s
    assert 0.15 < m["tokens_per_s"] <= 0.2 and m["tokens_per_s"] * m["step_time_s"] == pytest.approx(100.0)
    assert meter.window_elapsed_s() < 500.0  # collect started the next window
    meter.window_start = time.perf_counter() + 100.0  # a clock that went nowhere: never zero or negative
    assert meter.window_elapsed_s() == 1e-9


def test_memory_on_cpu_is_the_process_resident_memory_in_gib():
    assert _memory_gib(CPU) == pytest.approx(psutil.Process().memory_info().rss / 2**30, rel=0.1)


def test_train_metrics_windows_average_their_losses_and_carry_the_resume_once(one_rank, capfd):
    meter = StepMeter(max_steps=8, tokens_per_step=100, flops_per_token=1.0, peak_flops_total=None)
    metrics = TrainMetrics(meter, every_n_steps=2, device=CPU, start_step=4, announce=True)
    assert [s for s in range(1, 9) if metrics.due(s)] == [2, 4, 6, 8]
    meter.window_start = time.perf_counter() - 1000.0  # a window of 1000 s, half of it waiting for data
    metrics.record(5, torch.tensor(3.0), data_wait_s=200.0)
    started = psutil.Process().create_time()
    metrics.record(6, torch.tensor(1.0), data_wait_s=300.0)
    first = metrics.collect(6, lr=1e-3, grad_norm=1.0)
    assert first["loss"] == 2.0 and first["world_size"] == 1 and first["step"] == 6
    assert 0.4 < first["data_wait_frac"] <= 0.5 and 0.15 < first["tokens_per_s"] <= 0.2  # 200 tokens
    # the first step after a restore: the step restored from and the restart's cost, in this window only
    assert first["resumed_from_step"] == 4 and 0 < first["resume_s"] <= time.time() - started
    assert capfd.readouterr().out.startswith("raytrain: resumed from step 4; first step done ")
    metrics.record(7, torch.tensor(5.0), data_wait_s=0.0)
    second = metrics.collect(7, lr=1e-3, grad_norm=1.0)
    assert second["loss"] == 5.0 and "resumed_from_step" not in second and "resume_s" not in second


@pytest.mark.parametrize("start_step, announce", [(0, True), (4, False)])
def test_a_fresh_start_carries_no_resume_and_a_quiet_one_says_nothing(one_rank, capfd, start_step, announce):
    metrics = TrainMetrics(StepMeter(max_steps=8, tokens_per_step=100, flops_per_token=1.0, peak_flops_total=None),
                           every_n_steps=1, device=CPU, start_step=start_step, announce=announce)
    metrics.record(start_step + 1, torch.tensor(1.0), data_wait_s=0.0)
    assert ("resumed_from_step" in metrics.collect(start_step + 1, lr=1e-3, grad_norm=1.0)) == bool(start_step)
    assert capfd.readouterr().out == ""
