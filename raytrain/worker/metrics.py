"""One metrics path: every N steps compute the numbers once; rank 0 prints them
(raytrain.console.format_progress) and every rank reports them.

`StepMeter` accumulates per-step timings cheaply (no device syncs); `collect` turns a window of
steps into the metrics dict. `TrainMetrics` is the loop's component: it keeps the window's losses
on the device, decides when a window ends, and reduces it across ranks (one device sync and two
tiny all-reduces per window, never per step).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import psutil
import torch

from raytrain.console import emit


@dataclass
class StepMeter:
    max_steps: int
    tokens_per_step: int
    """Global tokens per optimizer step (train_batch_size x seq_len)."""
    flops_per_token: float
    peak_flops_total: float | None
    """Peak FLOP/s of all devices together; None on CPU (no MFU)."""
    window_start: float = field(default_factory=time.perf_counter)
    window_steps: int = 0
    window_data_wait_s: float = 0.0
    run_start: float = field(default_factory=time.perf_counter)
    steps_done: int = 0

    def step(self, data_wait_s: float) -> None:
        self.window_steps += 1
        self.steps_done += 1
        self.window_data_wait_s += data_wait_s

    def window_elapsed_s(self) -> float:
        return max(time.perf_counter() - self.window_start, 1e-9)

    def collect(self, step: int, loss: float, lr: float, grad_norm: float | None, device,
                elapsed: float | None = None) -> dict[str, float]:
        """`elapsed`: the window's wall time to use (the slowest rank's, in TrainMetrics); default this
        process's own."""
        now = time.perf_counter()
        elapsed = self.window_elapsed_s() if elapsed is None else elapsed
        step_time = elapsed / max(self.window_steps, 1)
        tokens_per_s = self.tokens_per_step * self.window_steps / elapsed
        metrics = {
            "step": step,
            "loss": loss,
            "lr": lr,
            "grad_norm": float("nan") if grad_norm is None else grad_norm,
            "tokens_per_s": tokens_per_s,
            "step_time_s": step_time,
            "data_wait_frac": self.window_data_wait_s / elapsed,  # this rank's; the worker takes the max
            "eta_s": step_time * (self.max_steps - step),
            "memory_gib": _memory_gib(device),
        }
        if self.peak_flops_total:
            metrics["mfu"] = tokens_per_s * self.flops_per_token / self.peak_flops_total
        self.window_start, self.window_steps, self.window_data_wait_s = now, 0, 0.0
        return metrics


def _memory_gib(device) -> float:
    """Peak GPU memory allocated by torch, or this process's resident memory on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return psutil.Process(os.getpid()).memory_info().rss / 2**30


class TrainMetrics:
    """The loop's metrics: per step `record`, at the end of a window `collect` (a collective).

    After a restore, the first window also carries `resumed_from_step` and `resume_s` (from this
    worker process's start to its first step: what a restart cost), so every restart that reached a
    later checkpoint stays in the run's metrics history."""

    def __init__(self, meter: StepMeter, every_n_steps: int, device, start_step: int, announce: bool):
        self.meter, self.every, self.device = meter, every_n_steps, device
        self._pending: list[torch.Tensor] = []
        self._start_step, self._announce = start_step, announce
        self._resumed: dict[str, float] = {}

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def record(self, step: int, loss: torch.Tensor, data_wait_s: float) -> None:
        self._pending.append(loss)
        self.meter.step(data_wait_s)
        if self._start_step and step == self._start_step + 1:
            self._resumed = {"resumed_from_step": self._start_step,
                             "resume_s": time.time() - psutil.Process().create_time()}
            if self._announce:
                emit(f"raytrain: resumed from step {self._start_step}; first step done "
                     f"{self._resumed['resume_s']:.1f} s after the worker process started")

    def collect(self, step: int, lr: float, grad_norm: float | None) -> dict[str, float]:
        """The window's metrics, the same on every rank: mean loss over ranks, the slowest rank's data
        wait and wall time (what the step waits for; the loop's report decisions rest on the timing
        being equal on every rank, raytrain.worker.loop.ReportGate)."""
        window = torch.stack(self._pending).mean()
        torch.distributed.all_reduce(window, op=torch.distributed.ReduceOp.AVG)  # the window's one device sync
        self._pending.clear()
        elapsed = self.meter.window_elapsed_s()
        slowest = torch.tensor([self.meter.window_data_wait_s / elapsed, elapsed], dtype=torch.float64,
                               device=self.device)
        torch.distributed.all_reduce(slowest, op=torch.distributed.ReduceOp.MAX)
        wait, elapsed = slowest.tolist()
        metrics = self.meter.collect(step, window.item(), lr, grad_norm, self.device, elapsed=elapsed)
        metrics["data_wait_frac"] = wait
        metrics["world_size"] = torch.distributed.get_world_size()  # an elastic run's history shows its sizes
        metrics.update(self._resumed)
        self._resumed = {}
        return metrics
