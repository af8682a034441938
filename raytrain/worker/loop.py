"""The per-worker training loop (runs inside each Ray Train worker process).

Start at `train_loop_per_worker`, the function Ray Train runs on every worker: it rebuilds the
`RunSpec` the driver sent (never module globals), builds the components — the DeepSpeed engine
(raytrain.worker.engine), the data reader (raytrain.data.ingest), metrics, evaluation, checkpoints,
tracking — restores the latest checkpoint, and hands them to `Trainer.train`.

`Trainer.train` is the loop, in the shape of torchtitan's: each component decides for itself when
it is due (log, evaluate, save), so the loop only orders them. It takes `report`, the one call into
Ray Train, as an argument: tests run the loop without Ray.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
from collections.abc import Callable, Iterator
from typing import Any

import ray.train
import ray.train.torch
import torch

from raytrain import compat
from raytrain.checkpoint import reshard, scratch
from raytrain.checkpoint.layout import checkpoint_dir_name
from raytrain.checkpoint.shards import (Checkpointer, Rank, ResumePoint, check_restore_space, out_of_space, restore,
                                        resume_point)
from raytrain.console import emit, format_progress
from raytrain.data.bad_records import SetupMistake, stop_run
from raytrain.data.ingest import MicroBatches
from raytrain.data.progress import reached
from raytrain.model import flops_per_token, node_lacks
from raytrain.run_spec import RunSpec
from raytrain.worker.engine import after_checkpoint_load, build_engine, import_deepspeed, train_step
from raytrain.worker.evaluation import Evaluator, eval_batches
from raytrain.worker.metrics import StepMeter, TrainMetrics
from raytrain.worker.samples import SampleLog
from raytrain.worker.tracking import Tracker

Report = Callable[[dict[str, Any], "str | None", int], None]
"""report(metrics, local checkpoint directory or None, step): hand a window to Ray Train."""


class Trainer:
    """One worker's share of the run, from `start_step` to `max_steps`."""

    def __init__(self, *, engine, scheduler, batches: Iterator[dict[str, Any]], grad_accum: int, device,
                 metrics: TrainMetrics, checkpointer: Checkpointer, evaluator: Evaluator | None, tracker: Tracker,
                 report: Report, start_step: int, max_steps: int, history: list[dict[str, Any]], is_rank0: bool,
                 samples: SampleLog | None = None):
        self.engine, self.scheduler, self.batches, self.grad_accum, self.device = engine, scheduler, batches, grad_accum, device
        self.metrics, self.checkpointer, self.evaluator, self.tracker, self.report, self.samples = (
            metrics, checkpointer, evaluator, tracker, report, samples)
        self.start_step, self.max_steps, self.history, self.is_rank0 = start_step, max_steps, history, is_rank0

    step: int = 0
    """The step being trained (the last one reached, once the loop ends): what an out-of-memory line names."""

    def train(self) -> None:
        if self.evaluator is not None and self.start_step < self.max_steps:
            self.evaluator.check()
        for step in range(self.start_step + 1, self.max_steps + 1):
            self.step = step
            loss, data_wait = train_step(self.engine, self.batches, self.grad_accum, self.device)
            self.metrics.record(step, loss, data_wait)
            if self.samples is not None:
                self.samples.record(step, self.batches)
            last = step == self.max_steps
            save = self.checkpointer.due(step, last)
            evaluate = self.evaluator is not None and self.evaluator.due(step, last)
            if not (save or evaluate or self.metrics.due(step)):
                continue
            window = self.metrics.collect(step, self._lr(), self._grad_norm())
            if evaluate:  # every rank, same step, same batch count (see raytrain.worker.evaluation)
                window.update(self.evaluator.run())
            self.history.append(window)
            if self.is_rank0:
                emit(format_progress(window, self.max_steps))
            checkpoint = self.checkpointer.save(step, window, self.history, self.batches.position()) if save else None
            try:
                self.report(window, checkpoint, step)
            except OSError as e:  # Ray Train's upload into a full storage: one line, not a retried worker failure
                if checkpoint is None or not out_of_space(e):
                    raise
                self.checkpointer.storage_full(step, window)
                raise
            self.tracker.log(window, step)

    def _lr(self) -> float:
        return self.scheduler.get_last_lr()[0] if self.scheduler else self.engine.get_lr()[0]

    def _grad_norm(self) -> float | None:
        norm = self.engine.get_global_grad_norm()
        return None if norm is None else float(norm)


def train_loop_per_worker(spec_dict: dict[str, Any]) -> None:
    """Ray Train's entry point on every worker: `spec_dict` is the driver's `RunSpec.to_dict()`."""
    ctx = ray.train.get_context()
    rank = Rank(world=ctx.get_world_rank(), world_size=ctx.get_world_size(), local=ctx.get_local_rank(),
                node=ctx.get_node_rank(), local_size=ctx.get_local_world_size())
    # An elastic run's group runs the plan of its own size (the driver resolved and checked them all).
    spec = RunSpec.from_dict(spec_dict).at_world_size(rank.world_size)
    cfg = spec.config
    device = ray.train.torch.get_device()  # the device Ray assigned, not a guess from LOCAL_RANK
    if device.type == "cuda":
        torch.cuda.set_device(device)
    compat.quiet_ray_train_report_log()
    lacking = node_lacks(cfg.model)
    if lacking:  # the user's setup, the same at every restart: stop the run (one line, exit 2), not a retry
        stop_run(SetupMistake(f"node {socket.gethostname()}", *lacking), spec.counter)
    if rank.local == 0:  # before the space checks: what killed workers of this node left in TMPDIR
        for path in scratch.remove_dead():
            emit(f"raytrain: removed {path} on {socket.gethostname()}, a stopped worker's checkpoint scratch")
    resume = resume_point(spec, ray.train.get_checkpoint(), rank.world_size)
    check_restore_space(resume, rank, spec.counter)  # a disk too small for the download: one line, before the build
    ds_config = spec.ds_config
    if resume is not None and resume.universal:
        # written by another number of workers: DeepSpeed re-partitions its universal form (raytrain.checkpoint.reshard)
        ds_config = {**ds_config, "checkpoint": {**ds_config.get("checkpoint", {}), "load_universal": True}}
    with (universal_copy(resume, spec.run_uri, rank, device),  # rank 0 converts while every rank builds
          gpu_memory_stops_the_run(spec, device, lambda: "building the engine")):
        # restoring a checkpoint: its weights replace the model's, so model.pretrained's are not read
        engine, scheduler, _ = build_engine(spec, device, ds_config, from_checkpoint=resume is not None)
    start_step, history, data_state = restore(engine, resume, seed=cfg.training.seed, rank=rank.world,
                                              ranks_on_node=rank.local_size, counter=spec.counter)
    if resume is not None:
        after_checkpoint_load(engine)  # the LR workaround again: loading replaced the optimizer's param groups
    facts = spec.deepspeed
    if rank.world == 0:
        written = f" (a checkpoint written by {resume.written_by} workers)" if resume and resume.universal else ""
        m = spec.model
        active = f" ({m.active_parameters:,} run per token)" if m.active_parameters != m.num_parameters else ""
        emit(f"raytrain: {m.num_parameters:,} parameters{active}, world size {rank.world_size}, "
             f"batch {facts.train_batch_size} = {facts.micro_batch_per_gpu} x {facts.gradient_accumulation_steps} x "
             f"{rank.world_size}, seq_len {cfg.data.seq_len}, device {device.type}, starting at step {start_step}"
             f"{written}")
        emit("raytrain: DeepSpeed config (resolved; saved in every checkpoint's raytrain.json): "
             + json.dumps(ds_config, sort_keys=True))
    meter = StepMeter(
        max_steps=cfg.training.max_steps, tokens_per_step=spec.tokens_per_step,
        flops_per_token=flops_per_token(spec.model.active_parameters, spec.model.num_hidden_layers,
                                        spec.model.hidden_size, cfg.data.seq_len),
        peak_flops_total=cfg.training.peak_tflops_per_gpu * 1e12 * rank.world_size if device.type == "cuda" else None)
    # Rows each shard gives per optimizer step: the same at every world size (raytrain.data.ingest).
    num_shards = cfg.data.num_shards or rank.world_size
    batches = MicroBatches(ray.train.get_dataset_shard("train"), facts.micro_batch_per_gpu,
                           facts.train_batch_size // num_shards, device, seed=cfg.training.seed,
                           shuffle_buffer_size=cfg.data.shuffle_buffer_size,
                           position=(data_state["epoch"], data_state["rows"]) if start_step else (0, 0),
                           prefetch=cfg.data.prefetch_batches, digests=cfg.data.sample_log, counter=spec.counter)
    evaluator = None
    if spec.data.has_eval:  # Ray Train raises KeyError for a dataset it was not given
        shard = ray.train.get_dataset_shard("eval")
        evaluator = Evaluator(engine, lambda: eval_batches(shard, facts.micro_batch_per_gpu, device), device,
                              cfg.data.eval_every_n_steps, cfg.data.eval_max_batches, counter=spec.counter)
    tracker = Tracker(cfg.tracking, spec.storage_path, spec.run_name, spec_dict, active=rank.world == 0)
    samples = SampleLog(spec.run_uri, rank.world, rank.world_size) if cfg.data.sample_log else None
    checkpointer = Checkpointer(engine, spec, spec_dict, rank)
    trainer = Trainer(engine=engine, scheduler=scheduler, batches=batches,
                      grad_accum=facts.gradient_accumulation_steps, device=device,
                      metrics=TrainMetrics(meter, cfg.training.log_every_n_steps, device, start_step,
                                           announce=rank.world == 0),
                      checkpointer=checkpointer, evaluator=evaluator, tracker=tracker,
                      report=ray_report(cfg.checkpoint.upload_async, spec.counter if rank.world == 0 else None,
                                        checkpointer.storage_full),
                      start_step=start_step,
                      max_steps=cfg.training.max_steps, history=history, is_rank0=rank.world == 0, samples=samples)
    try:
        with gpu_memory_stops_the_run(spec, device, lambda: f"in step {trainer.step}"):
            trainer.train()
    finally:
        batches.close()
        tracker.close()
        if samples is not None:
            samples.close()


@contextlib.contextmanager
def gpu_memory_stops_the_run(spec: RunSpec, device, where: Callable[[], str]) -> Iterator[None]:
    """A CUDA out-of-memory error stops the run in one line (exit 2), as a full disk does: the same settings run out
    at the same place after every restart, so Ray Train's retries (checkpoint.max_failures, each a group restart
    from the latest checkpoint) would only spend time and the failures an elastic run keeps for lost nodes. Seen on
    an H100 (session 63): per-document positions under SDPA, planned to fit, retried until the call's limit."""
    try:
        yield
    except torch.OutOfMemoryError as e:
        if device.type != "cuda":
            raise
        stop_run(gpu_memory_mistake(spec, where(), torch.cuda.max_memory_allocated(device),
                                    torch.cuda.get_device_properties(device).total_memory, e), spec.counter)


def gpu_memory_mistake(spec: RunSpec, where: str, peak_bytes: int, total_bytes: int,
                       error: BaseException) -> SetupMistake:
    """The one line for a GPU that ran out of memory `where` ("in step 3", "building the engine"): the settings that
    set the memory and the fix. Every rank that runs out says one; the first to reach the run's counter is printed."""
    facts, model = spec.deepspeed, spec.config.model
    # torch's text: "CUDA out of memory. Tried to allocate 440.00 MiB. GPU 0 has a total capacity of ...": the request
    parts = str(error).split(". ")
    requested = parts[1][:1].lower() + parts[1][1:] if len(parts) > 2 else "out of memory"
    gib = 2**30
    resume = f"checkpoint.name={spec.run_name}" if spec.run_name else "the run's checkpoint.name"
    return SetupMistake(
        f"node {socket.gethostname()}",
        f"a GPU ran out of memory {where} ({requested}; {peak_bytes / gib:.1f} GiB allocated at the peak of "
        f"{total_bytes / gib:.1f} GiB) at micro-batch {facts.micro_batch_per_gpu}, model.gradient_checkpointing="
        f"{str(model.gradient_checkpointing).lower()}",
        f"lower training.micro_batch_size_per_gpu, or set model.gradient_checkpointing=true or an optimizer offload "
        f"(\"auto\" for each picks what fits: python -m raytrain.tools.plan shows every option); then the same "
        f"command with {resume} continues from the latest checkpoint")


@contextlib.contextmanager
def universal_copy(resume: ResumePoint | None, run_uri: str, rank: Rank, device) -> Iterator[None]:
    """Around the engine build of a group resuming a checkpoint written by another world size:
    rank 0 converts it into its universal copy in a child process (unless a complete copy exists),
    the other ranks wait for the copy's marker afterwards (raytrain.checkpoint.reshard)."""
    if resume is None or resume.universal is None:
        yield
        return
    if rank.world != 0:
        yield
        reshard.wait_until_complete(resume.universal)
        return
    said = f"raytrain: checkpoint step {resume.step} was written by {resume.written_by} workers, this group has {rank.world_size}"
    if reshard.is_complete(resume.universal):
        emit(f"{said}: loading its universal copy {resume.universal} (made by an earlier group)")
        yield
        return
    emit(f"{said}: converting it to DeepSpeed's universal checkpoint {resume.universal} (once per checkpoint)")
    import_deepspeed(device)  # DS_ACCELERATOR=cpu on CPU before the converter inherits the environment
    with reshard.Conversion(resume.checkpoint, resume.step, resume.universal) as conversion:
        conversion.start()
        yield
        gib, converting, total = conversion.finish()
    reshard.prune(run_uri, keep=resume.universal)
    emit(f"raytrain: universal checkpoint written: {gib:.3f} GiB, converted in {converting:.1f} s (beside the "
         f"engine build), stored {total:.1f} s after the start")


class ReportGate:
    """Which windows go to Ray Train: every one that carries a checkpoint, and a metrics-only one
    when the controller has taken the last report. Ray Train's controller takes one report per
    worker per poll (every 2 s) and ray.train.report blocks while the previous report still waits
    (raytrain.compat.ray_train_poll_interval_s): a window more often than that throttled training
    to one window per poll (benchmarks/report_gate.sh, the tiny model on 2 CPU workers logged every
    step: 2.0 s per step before, 0.66 s with the gate). A window left out of Ray is still in the
    console, raytrain.json's history and the tracker; the run's final metrics come with its last
    checkpoint. The decision rests on the window's wall time, the slowest rank's, so every rank makes
    it alike (each ray.train.report is a barrier across ranks)."""

    def __init__(self, poll_s: float):
        self.poll_s, self.since_s, self.step = poll_s, float("inf"), None

    def due(self, metrics: dict[str, Any], step: int, checkpoint: bool) -> bool:
        if self.step is not None:
            self.since_s += metrics["step_time_s"] * (step - self.step)
        self.step = step
        if checkpoint or self.since_s >= self.poll_s:
            self.since_s = 0.0
            return True
        return False


def ray_report(upload_async: bool, counter: str | None = None,
               storage_full: Callable[[int, dict[str, Any]], None] | None = None) -> Report:
    """The loop's `report`: ray.train.report, with this rank's checkpoint directory when one was saved.

    `counter` (rank 0): the run's counter actor, told the step first: Ray Train's controller takes
    one report per worker per poll (every 2 s), so it lags the workers, and Ctrl-C names the step
    the workers reached, not the one the controller last took. `storage_full` (Checkpointer.storage_full):
    what an asynchronous upload into a full storage calls; a synchronous one raises out of report, to the loop."""
    # ASYNC: Ray uploads in the background and deletes the directory afterwards, so training goes on
    # while the shards travel to storage; SYNC: report returns once they are there.
    mode = ray.train.CheckpointUploadMode.ASYNC if upload_async else ray.train.CheckpointUploadMode.SYNC
    gate = ReportGate(compat.ray_train_poll_interval_s())

    def report(metrics: dict[str, Any], checkpoint: str | None, step: int) -> None:
        if counter is not None:
            reached(counter, step)
        if not gate.due(metrics, step, checkpoint is not None):
            return
        if checkpoint is None:
            ray.train.report(metrics)
            return
        # An ASYNC upload fails in Ray's upload thread, as a worker failure: Ray Train retried the run, which
        # retrained to the same save and failed there again, checkpoint.max_failures times. Its own upload,
        # wrapped, stops the run in one line instead, as the loop does for a synchronous one. Only for ASYNC: with
        # an upload function Ray's slow-upload warning blames "your custom upload function", not the storage.
        upload = _stop_when_full(lambda: storage_full(step, metrics)) if upload_async and storage_full else None
        try:
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(checkpoint),
                             checkpoint_dir_name=checkpoint_dir_name(step), checkpoint_upload_mode=mode,
                             checkpoint_upload_fn=upload)
        except BaseException:
            shutil.rmtree(checkpoint, ignore_errors=True)
            raise
        if not upload_async:
            shutil.rmtree(checkpoint, ignore_errors=True)

    return report


def _stop_when_full(storage_full: Callable[[], None], persist=compat.persist_checkpoint):
    """A checkpoint_upload_fn: Ray Train's own upload (`persist`), which calls `storage_full` (it stops the run)
    where the storage has no space left."""

    def upload(checkpoint, name: str):
        try:
            return persist(checkpoint, name)
        except OSError as e:
            if out_of_space(e):
                storage_full()
            raise

    return upload
