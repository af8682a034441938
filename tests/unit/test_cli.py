"""The command line as a user meets it: dry runs and one-line errors. `main(argv)` in-process, as
tests/unit/test_bad_input.py calls it (a process of its own per case cost ~6 s of imports each, 100 s
for this file); that file's `test_a_real_run_is_refused_by_the_process` holds the process level."""

import json
from types import SimpleNamespace

import pytest

from raytrain import hardware
from raytrain.main import main as train_main


pytestmark = pytest.mark.usefixtures("no_ray_driver")  # tests/conftest.py: main() must not find a driver


@pytest.fixture(autouse=True)
def no_ray_address(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # a dry run plans for the command line's cluster only


@pytest.fixture
def run_main(capsys):
    def run(*args):
        rc = train_main(list(args))
        out, err = capsys.readouterr()
        return SimpleNamespace(returncode=rc, stdout=out, stderr=err)
    return run


def test_dry_run_plans_a_gpu_cluster_without_gpus(tmp_path, run_main):
    ds = tmp_path / "seed.json"
    ds.write_text(json.dumps({"train_batch_size": 512, "gradient_accumulation_steps": 4,
                              "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                                    "overlap_comm": True, "contiguous_gradients": True},
                              "fp16": {"enabled": True}}))
    p = run_main("--dry-run", "scaling.use_gpu=true", "scaling.num_workers=8", f"deepspeed={ds}")
    assert p.returncode == 0, p.stderr
    plan = json.loads(p.stdout)
    assert plan["config"]["deepspeed"]["train_micro_batch_size_per_gpu"] == 16
    assert plan["cluster"] == {"num_workers": 8, "use_gpu": True, "gpus_per_node": None, "cpus_total": None,
                               "min_workers": None,  # no GPU here: the run goes to a cluster elsewhere
                               "driver_on_worker_node": bool(hardware.gpus(use_torch=False))}
    p64 = run_main("--dry-run", "scaling.use_gpu=true", "scaling.num_workers=64")
    assert p64.returncode == 0 and json.loads(p64.stdout)["config"]["deepspeed"]["bf16"]["enabled"] is True
    # the seed's offload with the default 1 CPU per worker runs, with a note naming the key to raise
    assert "raytrain: note: deepspeed.zero_optimization.offload_optimizer" in p.stderr
    assert "raise scaling.cpus_per_worker" in p.stderr and "cpus_per_worker" not in p64.stderr
    p8 = run_main("--dry-run", "scaling.use_gpu=true", "scaling.num_workers=8", "scaling.cpus_per_worker=8",
                  f"deepspeed={ds}")
    assert p8.returncode == 0 and "cpus_per_worker" not in p8.stderr, p8.stderr


@pytest.mark.parametrize("args, needle", [
    (["training.max_step=3"], "did you mean training.max_steps"),
    (["training.max_steps=abc"], "training.max_steps must be an integer >= 1"),
    (["--config", "/nonexistent/run.yaml"], "does not exist"),
    (["deepspeed=/nonexistent/ds.json"], "deepspeed: file /nonexistent/ds.json does not exist"),
    (["scaling.use_gpu=true", "scaling.num_workers=6",
      'deepspeed={"train_batch_size": 512, "gradient_accumulation_steps": 4, "zero_optimization": {"stage": 3}}'],
     "world size 6"),
    (['deepspeed={"fp16": {"enabled": true}, "zero_optimization": {"stage": 3}}', "scaling.use_gpu=false"],
     "needs GPUs"),
    (["data.seq_len=4096"], "max_position_embeddings=1024"),
    (["data.path=/nonexistent/corpus"], "data.path: /nonexistent/corpus does not exist"),
    (["scaling.num_workers=4", "data.num_shards=6"], "data.num_shards=6 is not divisible by the 4 workers"),
    (["scaling.num_workers=2", "data.num_shards=6", "training.micro_batch_size_per_gpu=4"],
     "deepspeed.train_batch_size is \"auto\", and raytrain derived 8 (micro-batch 4 x gradient accumulation 1 x 2 "
     "workers), which data.num_shards=6 does not divide"),
    (["data.num_shards=0"], "data.num_shards must be an integer >= 1"),
    (["model.compile=true", "model.liger_kernel=loss"], "model.compile=true does not work with model.liger_kernel=loss"),
    (["model.compile=true", "model.fused_layers=true"], "model.fused_layers=true with model.compile=true"),
    (['deepspeed={"zero_optimization": {"stage": 3}, "compile": {"deepcompile": true}}'],
     "deepcompile=true takes effect only when the model is compiled: set model.compile=true"),
])
def test_user_errors_are_one_line_without_traceback(args, needle, run_main):
    p = run_main("--dry-run", *args)
    assert p.returncode == 2
    assert needle in p.stderr
    assert "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_a_data_note_is_printed_only_when_every_check_passes(tmp_path, run_main):
    """A note on the data (a file left out) above a later error line was noise: the error is alone."""
    (tmp_path / "a.txt").write_text("some text")
    (tmp_path / "b.dat").write_text("left out")
    p = run_main("--dry-run", f"data.path={tmp_path}", "data.seq_len=4096")  # over the model's 1024 positions
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "max_position_embeddings=1024" in p.stderr
    p = run_main("--dry-run", f"data.path={tmp_path}")
    assert p.returncode == 0, p.stderr
    assert f"raytrain: note: data.path: reading 1 file of {tmp_path}; left out 1 with other extensions" in p.stderr


def test_malformed_yaml_is_reported_with_its_line(tmp_path, run_main):
    bad = tmp_path / "run.yaml"
    bad.write_text("training:\n  max_steps: 5\n  seed: [1\n")
    p = run_main("--dry-run", "--config", str(bad))
    assert p.returncode == 2 and "run.yaml is not valid YAML" in p.stderr and "line" in p.stderr


@pytest.mark.parametrize("tool", ["plan", "preflight", "export", "bench", "bench_data"])
def test_the_first_rounds_tool_names_run_the_tools(tool, monkeypatch, capsys):
    """`python -m raytrain.plan` and the other first-round names (issues 3, 5, 6, 8; issue 14's 13B target still
    says raytrain.plan) run the tools that moved to raytrain.tools, as `python -m` runs them (runpy, __main__)."""
    import runpy

    monkeypatch.setattr("sys.argv", [tool, "--help"])
    with pytest.raises(SystemExit) as e:
        runpy.run_module(f"raytrain.{tool}", run_name="__main__", alter_sys=True)
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: python -m raytrain.tools.{tool} ")


def test_the_old_plan_name_prints_the_13b_plan_as_the_tool_does(monkeypatch, capsys):
    """Issue 14's command, word for word: the 13B config fits one H200 (exit 0), the same lines as the tool's."""
    import pathlib
    import runpy

    from raytrain.tools.plan import main as plan_main

    monkeypatch.chdir(pathlib.Path(__file__).resolve().parents[2])
    args = ["--config", "configs/llama-13b-1gpu.yaml", "--gpu-memory-gib", "139", "--host-memory-gib", "125",
            "--gpus-per-node", "1"]
    assert plan_main(args) == 0
    direct = capsys.readouterr()
    monkeypatch.setattr("sys.argv", ["raytrain.plan", *args])
    with pytest.raises(SystemExit) as e:
        runpy.run_module("raytrain.plan", run_name="__main__", alter_sys=True)
    assert e.value.code == 0
    alias = capsys.readouterr()
    assert (alias.out, alias.err) == (direct.out, direct.err)
    assert "raytrain: plan: chose micro-batch" in direct.out + direct.err
