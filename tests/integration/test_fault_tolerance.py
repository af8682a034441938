"""Fault tolerance for real: worker processes SIGKILLed from outside, twice in one run (once in the
middle of a checkpoint save), on the shared `ray start` cluster, its data shuffled and read ahead.
The run must finish with per-step losses equal to an uninterrupted run's, bit for bit (CPU, fp32): every
restart read on exactly where its checkpoint stood (mid-epoch, and across the epoch's end at step 9).
A save that was interrupted is never the one a restart resumes from. Then what a user does next with a run's checkpoints: resume from
a chosen one on another number of workers (DeepSpeed universal conversion, data shards reassigned: each
step's rows, from the data audit, equal the 2-worker run's, across the epoch's end),
run the same command again (a finished run: nothing to train), start over with --fresh, and a run
past max_failures.

Facts are read from files (raytrain.json's history, Ray Train's checkpoint bookkeeping), never from
worker log lines, which Ray's log forwarding may drop for workers killed soon after they start."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from raytrain.checkpoint import layout
from raytrain.console import parse_progress
from tests import helpers
from tests.helpers import wait_until

pytestmark = pytest.mark.integration

# 12 steps, a checkpoint every 3, 6 data shards (3 per worker; 2 per worker on 3 workers), micro-batch
# 6: the same global batch of 36 sequences on 2 workers (GA 3) and 3 workers (GA 2). The built-in
# Llama with 2 layers instead of 4: what is compared is the same either way, and each step is cheaper.
# Shuffled in windows of at least 16 rows (default off; a shard holds 54-59 rows an epoch) and read ahead
# (data.prefetch_batches, default 4): the restarts' data position is exact with both. Every rank writes
# the rows of each step (data.sample_log): a row skipped or read twice is named by its step, not only
# seen as a loss that differs.
ARGS = ["training.max_steps=12", "training.log_every_n_steps=1", "checkpoint.every_n_steps=3",
        "checkpoint.num_to_keep=3", "checkpoint.max_failures=6", "data.num_builtin_documents=120",
        "training.warmup_steps=3", "training.seed=7", "data.num_shards=6", "training.micro_batch_size_per_gpu=6",
        "data.shuffle_buffer_size=16", 'model.config={"num_hidden_layers": 2}', "data.sample_log=true"]
TWO = ["training.gradient_accumulation_steps=3"]
THREE = ["scaling.num_workers=3", "training.gradient_accumulation_steps=2"]


def start(env, storage, name, *extra):
    # A test's own value of a key replaces ARGS' (raytrain.main refuses a key given twice).
    given = {item.split("=", 1)[0] for item in extra if "=" in item and not item.startswith("-")}
    args = [item for item in ARGS if item.split("=", 1)[0] not in given]
    return subprocess.Popen([sys.executable, "-m", "raytrain.main", *args, f"checkpoint.storage_path={storage}",
                             f"checkpoint.name={name}", *extra], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def finish(proc, timeout=900):
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-4000:]
    return out


def history(storage, name, step=12):
    meta = json.loads((Path(storage) / name / f"checkpoint_step_{step:08d}" / "raytrain.json").read_text())
    return meta["history"]


def losses(storage, name, step=12):
    return [(m["step"], m["loss"]) for m in history(storage, name, step)]


def rows(storage, name):
    """Per step, the rows it trained on (data.sample_log), as the last worker group that ran it read them."""
    return {step: record["rows"] for step, record in
            helpers.sample_lineage(helpers.sample_groups(Path(storage) / name)).items()}


def registered_step(storage, name):
    """The step of the run's latest checkpoint that Ray Train registered (what a restart resumes from)."""
    return helpers.registered_step(f"{storage}/{name}")


def worker_pids(address):
    from ray.util.state import list_actors

    # address: never "the latest local cluster", which may be another one on this machine
    return {a.pid for a in list_actors(address=address, filters=[("class_name", "=", "RayTrainWorker"),
                                                                 ("state", "=", "ALIVE")])}


def saving(tmpdir, step):
    """True while some rank writes step `step`: its local directory (raytrain.checkpoint.shards, under
    the test cluster's own TMPDIR) holds DeepSpeed's tag for it."""
    return any((d / layout.tag_for(step)).exists() for d in Path(tmpdir).glob("raytrain-ckpt-*"))


@pytest.fixture(scope="module")
def runs(ray_cluster, tmp_path_factory):
    storage = str(tmp_path_factory.mktemp("ft"))
    env = {**os.environ, "RAY_ADDRESS": ray_cluster["address"], "RAY_AUTH_MODE": "token", "PYTHONUNBUFFERED": "1"}
    address = ray_cluster["address"]
    baseline_out = finish(start(env, storage, "baseline", *TWO))

    # Ray Train's controller takes a worker's report (and registers its checkpoint) once per poll, every
    # RAY_TRAIN_HEALTH_CHECK_INTERVAL_S (2 s by default): on a fast machine 3 steps took ~1 s, so the
    # save of step N began before step N-3 was registered, and a kill then tested nothing (seen:
    # nothing registered at the first freeze). Polled every 0.5 s here, and a save is only killed
    # once N-3 is registered (below). The driver's value reaches the controller and the workers.
    proc = start({**env, "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5"}, storage, "faulty", *TWO)
    alive = lambda: proc.poll() is None  # noqa: E731
    kills, seen = [], set()

    def new_group():
        """Both workers of a group none of whose processes was seen before: the first group, or the
        one Ray Train started after the last kill (not the old group's survivor, still shutting down)."""
        live = worker_pids(address)
        return live if len(live) == 2 and not live & seen else None

    # A save caught in the act (every worker frozen with SIGSTOP the moment a rank starts writing the
    # checkpoint of step N, so none can report it), then a plain kill as soon as the restarted group
    # has registered a checkpoint of its own. (A third kill, the next save caught again in the restarted
    # group, was cut in session 68: ~30 s of this file's time for a second case of the first kill's kind.)
    plan = [("save", 6), ("plain", None)]
    for kind, step in plan:
        group = wait_until(new_group, 600, "a new worker group", alive, every_s=0.5)  # state API: not every 0.2 s
        seen |= group
        if kind == "save":
            while True:
                wait_until(lambda: saving(ray_cluster["tmpdir"], step), 600, f"the save of step {step}", alive,
                           every_s=0.02)
                for pid in group:
                    os.kill(pid, signal.SIGSTOP)
                registered = registered_step(storage, "faulty")  # stays put while the workers are frozen
                if registered == step - 3:
                    break
                # Ray Train had not yet taken step N-3's report when step N's save began: a kill now
                # would lose both, and show nothing about the save. Thawed, this save goes on; the next
                # is caught instead.
                for pid in group:
                    os.kill(pid, signal.SIGCONT)
                step += 3
                if step > 12:
                    pytest.fail(f"no save caught with the checkpoint before it registered: {kills}")
        else:
            before = kills[-1]["registered"] or 0
            registered = wait_until(lambda: (registered_step(storage, "faulty") or 0) > before and
                                    registered_step(storage, "faulty"), 600, "a checkpoint after the restart", alive)
        victim = min(group)
        os.kill(victim, signal.SIGKILL)  # as a real fault would: no cleanup, no exception
        for pid in group - {victim}:
            os.kill(pid, signal.SIGCONT)  # the controller ends the old group's survivors itself
        kills.append({"pid": victim, "kind": kind, "step": step, "registered": registered})
    faulty_out = finish(proc)
    return {"env": env, "storage": storage, "baseline_out": baseline_out, "faulty_out": faulty_out, "kills": kills,
            "address": address}


def test_run_survives_two_kills_with_identical_losses(runs):
    # each fault in one raytrain line from the controller (not killed itself: every line arrives)
    failures = re.findall(r"raytrain: worker failure (\d) \(checkpoint.max_failures=6\) on rank \d: .*; "
                          r"Ray Train restarts the workers from the latest checkpoint$", runs["faulty_out"], re.M)
    assert failures == ["1", "2"], runs["faulty_out"][-4000:]
    base, faulty = losses(runs["storage"], "baseline"), losses(runs["storage"], "faulty")
    assert [s for s, _ in base] == list(range(1, 13))
    # each restart read on where its checkpoint stood: every step trained on the baseline's rows, in its order
    base_rows, faulty_rows = rows(runs["storage"], "baseline"), rows(runs["storage"], "faulty")
    assert sorted(base_rows) == list(range(1, 13)) and {len(r) for r in base_rows.values()} == {36}, base_rows
    for step, trained in base_rows.items():
        assert faulty_rows.get(step) == trained, f"step {step}: rows differ after a restart"
    assert faulty == base  # bit-exact: same floats at every step
    # The restarts are in the run's own history (raytrain.worker.metrics): each restart's first window
    # says where it resumed from; a restart whose windows never reached a later checkpoint is lost with
    # them.
    resumed = [m["resumed_from_step"] for m in history(runs["storage"], "faulty") if "resumed_from_step" in m]
    assert len(resumed) == 2 and resumed == sorted(resumed) and set(resumed) <= {k["registered"] for k in runs["kills"]}
    assert "resumed_from_step" not in str(history(runs["storage"], "baseline"))


def test_an_interrupted_save_is_never_resumed_from(runs):
    during = [k for k in runs["kills"] if k["kind"] == "save"]
    assert len(during) == 1 and during[0]["step"] >= 6, runs["kills"]
    # frozen while writing step N with N-3 registered (the fixture kills only then): the group after
    # the first such kill resumed from N-3, not from the interrupted N (its first window says so in
    # the run's history; that group went on to register a checkpoint of its own before the next kill)
    first = during[0]
    resumed = [m["resumed_from_step"] for m in history(runs["storage"], "faulty") if "resumed_from_step" in m]
    assert resumed and resumed[0] == first["step"] - 3, (resumed, runs["kills"])
    # and the run then saved that step again, whole, and went on to the end
    step = during[-1]["step"]
    meta = json.loads((Path(runs["storage"]) / "faulty" / f"checkpoint_step_{step:08d}" / "raytrain.json").read_text())
    assert meta["step"] == step and [m["step"] for m in meta["history"]] == list(range(1, step + 1))


def test_only_the_latest_num_to_keep_checkpoints_stay(runs):
    kept = sorted(p.name for p in (Path(runs["storage"]) / "baseline").glob("checkpoint_step_*"))
    assert kept == ["checkpoint_step_00000006", "checkpoint_step_00000009", "checkpoint_step_00000012"]


def test_resume_on_another_number_of_workers(runs):
    env, storage = runs["env"], runs["storage"]
    chosen = os.path.join(storage, "faulty", "checkpoint_step_00000006")
    # --resume-from a chosen (not the latest) checkpoint, with the upload to storage in the background
    # (Ray's ASYNC mode, checkpoint.upload_async)
    out = finish(start(env, storage, "three", *THREE, "--resume-from", chosen, "checkpoint.upload_async=true"))
    assert "resuming step 6 on 3 workers (written by 2)" in out, out[-4000:]
    assert registered_step(storage, "three") == 12  # every async upload registered, the last one too
    # named after the checkpoint and a digest of its path and raytrain.json (raytrain.checkpoint.reshard)
    [copy] = (Path(storage) / "three" / "universal").glob("checkpoint_step_00000006-*")
    assert (copy / "raytrain.json").is_file()
    two, three = dict(losses(storage, "baseline")), dict(losses(storage, "three"))
    assert sorted(three) == list(range(1, 13))  # history restored, then steps 7..12 on 3 workers
    assert [three[s] for s in range(1, 7)] == [two[s] for s in range(1, 7)]
    # Steps 7..12 run on the same global batch of the same rows, summed in another order across 3
    # ranks: equal within fp32 reduction-order noise (measured ~1e-7 relative), across the epoch's
    # end too (step 9 here): MicroBatches ends an epoch per optimizer step, whatever the world size.
    for step in range(7, 13):
        assert three[step] == pytest.approx(two[step], rel=1e-5), (step, two[step], three[step])
    # 3 workers read on where the 2 stood (read ahead, shuffled, the shards reassigned): each step the
    # same rows, none skipped or read twice, and the epoch ends where it does on 2 (step 9: the tails
    # a shard leaves out do not depend on the world size). Their order within a step is the ranks'.
    base_rows, three_rows = rows(storage, "baseline"), rows(storage, "three")
    assert sorted(three_rows) == list(range(7, 13)), sorted(three_rows)
    for step in range(7, 13):
        assert sorted(three_rows[step]) == sorted(base_rows[step]), f"step {step}: rows differ on 3 workers"
    lrs = {m["step"]: m["lr"] for m in history(storage, "three")}
    assert lrs == {m["step"]: m["lr"] for m in history(storage, "baseline")}  # the schedule continued
    shards = os.listdir(Path(storage) / "three" / "checkpoint_step_00000012" / "step_00000012")
    assert sum(f.endswith("optim_states.pt") for f in shards) == 3  # re-partitioned for 3 ranks


def test_another_number_of_workers_without_shards_for_it_is_refused(runs):
    # resuming the 6-shard run with one shard per worker (data.num_shards=null) on 3 workers: the data
    # position has no 3-shard form; refused on the driver before any worker starts (max_steps past the
    # checkpoint's 12: a resume with nothing left to train is refused first)
    proc = start(runs["env"], runs["storage"], "four", *THREE, "data.num_shards=null", "training.max_steps=24",
                 "--resume-from",
                 os.path.join(runs["storage"], "faulty", "checkpoint_step_00000012"))
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 2, out[-3000:]
    assert "data.num_shards" in out and "written by 2 workers" in out, out[-3000:]
    assert not (Path(runs["storage"]) / "four").exists()


def test_same_command_on_a_finished_run_trains_nothing(runs, tmp_path):
    exported = tmp_path / "hf"  # the command's checkpoint.export_dir, which its first run filled
    exported.mkdir()
    (exported / "config.json").write_text("{}")
    out = finish(start(runs["env"], runs["storage"], "baseline", *TWO, f"checkpoint.export_dir={exported}"))
    # a finished run: said so, and no worker started (no progress line), the summary of its end
    assert f"raytrain: run 'baseline' in {runs['storage']} is already done at step 12" in out, out[-3000:]
    assert "raytrain: done at step 12" in out and not any(map(parse_progress, out.splitlines())), out[-3000:]
    assert losses(runs["storage"], "baseline") == losses(runs["storage"], "faulty")  # nothing retrained
    # its export_dir left as it is, with a note (was: exit 2, "exists and is not empty"), and no Ray Train
    # INFO "A run snapshot was found" (3 lines each time the driver read the run's record)
    assert f"raytrain: note: checkpoint.export_dir {exported} exists and is not empty" in out, out[-3000:]
    assert os.listdir(exported) == ["config.json"] and "snapshot was found" not in out, out[-3000:]


def test_worker_output_is_printed_again_once_a_stopped_run_has_ended(ray_cluster, capsys):
    """A bad record stops a run, and the driver stops printing what its dying workers and tasks print
    (raytrain.driver.watch); once the run has ended it prints them again: a notebook's next fit() printed
    no worker line at all. Ray's own printer on this process's connection, taken off and put back."""
    import ray
    from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

    from raytrain import compat

    @ray.remote(num_cpus=0)
    def say(word):
        print(word)

    received, printed = [], []
    dispatcher.add_handler("test-received", lambda data: received.extend(data["lines"]))
    printing_back = compat.stop_printing_worker_logs()
    try:
        ray.get(say.remote("said-while-stopped"))
        wait_until(lambda: "said-while-stopped" in received, 60, "the first line to reach this driver")
        printing_back()
        printing_back()  # once: a second call adds no second printer
        assert [name for name, _ in dispatcher.handlers].count(compat.PRINT_HANDLER) == 1
        ray.get(say.remote("said-after"))
        wait_until(lambda: printed.append(capsys.readouterr().out) or "said-after" in "".join(printed), 60,
                   "the second line on this driver's stdout")
    finally:
        printing_back()  # the session's other tests print their workers' lines, whatever happened here
        dispatcher.remove_handler("test-received")
    assert "said-while-stopped" not in "".join(printed)


def test_fresh_starts_over_keeping_the_old_run_and_a_run_past_max_failures_fails_with_its_error(runs):
    # One run for two features (a run of raytrain.main costs this suite ~70 CPU-seconds): --fresh over
    # a finished run (a copy of the baseline, so that no other test's files move), with max_failures=0
    # and a worker killed after the new run's first checkpoint.
    storage = Path(runs["storage"])
    shutil.copytree(storage / "baseline", storage / "again", symlinks=True)
    proc = start(runs["env"], runs["storage"], "again", *TWO, "--fresh", "checkpoint.max_failures=0")
    group = wait_until(lambda: worker_pids(runs["address"]), 600, "the run's workers", lambda: proc.poll() is None)
    wait_until(lambda: registered_step(runs["storage"], "again") == 3, 600, "its first checkpoint",
               lambda: proc.poll() is None)
    os.kill(min(group), signal.SIGKILL)
    out, _ = proc.communicate(timeout=600)
    assert "--fresh: moved the existing run 'again' to " in out, out[-3000:]
    aside = [p for p in storage.iterdir() if p.name.startswith("again.replaced-")]
    assert len(aside) == 1 and (aside[0] / "checkpoint_step_00000012" / "raytrain.json").exists()  # kept, whole
    assert [m["step"] for m in history(runs["storage"], "again", 3)] == [1, 2, 3]  # started over
    # past max_failures: the run fails (exit 1) with the worker's error, its checkpoint kept
    assert proc.returncode == 1, out[-3000:]
    assert "raytrain: done" not in out
    # one line with the checkpoint kept and the command that continues (was: Ray's WorkerGroupError traceback)
    assert re.search(r"^raytrain: the run failed at step \d+ of 12 \(worker failure past checkpoint.max_failures=0 "
                     r".*; latest checkpoint .*/again/checkpoint_step_00000003; to continue from it: python -m "
                     r"raytrain.main .*checkpoint.name=again$", out, re.M), out[-3000:]
    assert registered_step(runs["storage"], "again") == 3  # what a rerun would continue from
