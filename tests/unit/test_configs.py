"""Every shipped config in configs/: it says how to run it, resolves for its stated cluster shape
(a dry run: no Ray, no GPUs), keeps the batch identity, and fits its stated hardware by the plan."""

import dataclasses
import pathlib
import shlex

import pytest

from raytrain.config import load_config
from raytrain.hardware import Target
from raytrain.planning.resolve import resolve_run, shape_from_config
from raytrain.tools.plan import main as plan_main
from raytrain.tools.plan import parse_args as plan_parse_args

REPO = pathlib.Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))


def header(path: pathlib.Path) -> list[str]:
    """The comment block the file opens with."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line)
    return lines


def plan_args(path: pathlib.Path) -> list[str]:
    """The arguments of the file's `# Plan:` line (python -m raytrain.tools.plan ...)."""
    line = next(line for line in header(path) if line.startswith("# Plan:"))
    words = shlex.split(line.removeprefix("# Plan:"))
    assert words[:3] == ["python", "-m", "raytrain.tools.plan"], line
    return words[3:]


@pytest.fixture(autouse=True)
def in_repo_root(monkeypatch):
    # The commands in the headers run from the repository root (seed-8gpu.yaml names configs/seed-ds.json).
    monkeypatch.chdir(REPO)


def test_the_library_is_complete():
    names = {p.name for p in CONFIGS}
    assert {"default-cpu.yaml", "seed-8gpu.yaml", "llama-1b-1gpu.yaml", "llama-8b-8gpu.yaml",
            "llama-70b-ib.yaml", "llama-13b-1gpu.yaml"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_opens_with_its_command_and_hardware(path):
    text = "\n".join(header(path))
    assert "# Run:" in text and "python -m raytrain.main --config configs/" + path.name in text
    assert "# Hardware:" in text
    assert plan_args(path)[:2] == ["--config", f"configs/{path.name}"]


def stated_target(path: pathlib.Path) -> Target:
    """The hardware the file's `# Plan:` line states (what its "auto" settings are chosen for)."""
    args = plan_parse_args(plan_args(path))
    gib = 1024**3
    return Target(args.gpu_memory_gib and int(args.gpu_memory_gib * gib),
                  args.host_memory_gib and int(args.host_memory_gib * gib), args.gpus_per_node)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_resolves_for_its_cluster_shape_with_the_batch_identity(path):
    cfg = load_config(str(path))
    assert cfg.scaling.num_workers is not None and cfg.scaling.use_gpu is not None, \
        "a shipped config states its cluster shape (scaling.num_workers, scaling.use_gpu)"
    resolved = resolve_run(cfg, shape_from_config(cfg), target=stated_target(path))
    ds = resolved.ds_config
    world = resolved.cluster.num_workers
    assert world == cfg.scaling.num_workers
    assert ds["train_batch_size"] == ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * world
    assert "auto" not in repr(ds)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_option_carries_a_comment(path):
    """Each value says what it trades; the model's shape under model.config is described by its block."""
    shape_indent = None
    for number, line in enumerate(path.read_text().splitlines(), 1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        indent = len(line) - len(line.lstrip())
        if shape_indent is not None and indent > shape_indent:
            continue
        shape_indent = indent if stripped.startswith("config:") and not stripped.startswith("config: {") else None
        key, _, value = stripped.partition(":")
        if value.split("#")[0].strip() == "" and shape_indent is None:
            continue  # a section header
        assert "#" in value, f"{path.name}:{number}: {stripped!r} has no trade-off comment"


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_fits_its_stated_hardware(path, capsys):
    assert plan_main(plan_args(path)) == 0, capsys.readouterr()


def test_default_cpu_file_is_the_embedded_default():
    file_cfg = load_config("configs/default-cpu.yaml")
    default = load_config(None)
    a, b = resolve_run(file_cfg, shape_from_config(file_cfg)), resolve_run(default, shape_from_config(default))
    assert (a.cluster, a.model, a.deepspeed, a.data, a.ds_config) == (b.cluster, b.model, b.deepspeed, b.data, b.ds_config)
    # the file states the cluster shape (every shipped config does), the default leaves it to the cluster
    assert dataclasses.replace(a.config, scaling=b.config.scaling) == b.config


def test_seed_config_uses_the_seed_json_unchanged():
    import json

    cfg = load_config("configs/seed-8gpu.yaml")
    assert cfg.deepspeed == "configs/seed-ds.json"
    assert json.loads((REPO / "configs/seed-ds.json").read_text()) == {
        "train_batch_size": 512, "gradient_accumulation_steps": 4,
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                              "overlap_comm": True, "contiguous_gradients": True},
        "fp16": {"enabled": True}}
    ds = resolve_run(cfg, shape_from_config(cfg)).ds_config
    assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == (512, 16, 4)
