"""The package's layering, as pyproject.toml's import-linter contracts state it: imports only go
downwards (tools > main > driver > worker, planning > checkpoint > data, network > base), worker
code never imports driver code, and no package's modules import each other in a cycle."""

import json
import os
import subprocess
import sys
from pathlib import Path


def test_import_linter_contracts_are_kept():
    lint = Path(sys.executable).with_name("lint-imports")
    p = subprocess.run([str(lint), "--no-cache"], capture_output=True, text=True, timeout=300,
                       cwd=Path(__file__).resolve().parents[2], env={**os.environ, "PYTHONPATH": "."})
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
    assert "0 broken" in p.stdout


def test_only_the_tools_first_round_names_import_the_tools():
    """pyproject.toml's contract keeps every layer from importing the tools; the five first-round names
    (python -m raytrain.plan, ...) sit outside its layers, so this pins that they are the only importers.
    (Listing them in the contract would change pyproject.toml, which gives CI a new virtualenv whose
    DeepSpeed ops rebuild: ~6 minutes of the suite.)"""
    # The walk runs in an interpreter of its own: CPython 3.11 keeps ast.parse's recursion count per
    # interpreter, not per thread, and its traceback module ast-parses source lines, so any thread of this
    # xdist worker that formats a traceback meanwhile (Ray's threads log with them; the one seen, Ray Data's
    # usage poller, is off since tests/conftest.py) fails this walk with "SystemError: AST constructor
    # recursion depth mismatch" (python/cpython#106905's family). A fresh interpreter costs ~0.1 s.
    walk = """if True:
        import ast, json, pathlib, sys
        package = pathlib.Path(sys.argv[1])
        importers = []
        for path in package.rglob("*.py"):
            if path.parent.name == "tools":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                names = ([node.module or ""] if isinstance(node, ast.ImportFrom) else
                         [a.name for a in node.names] if isinstance(node, ast.Import) else [])
                if any(n == "raytrain.tools" or n.startswith("raytrain.tools.") for n in names):
                    importers.append(path.relative_to(package).as_posix())
        print(json.dumps(importers))"""
    package = Path(__file__).resolve().parents[2] / "raytrain"
    p = subprocess.run([sys.executable, "-I", "-c", walk, str(package)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    importers = set(json.loads(p.stdout))
    assert importers == {"plan.py", "preflight.py", "export.py", "bench.py", "bench_data.py"}


def heavy_imports_after(code: str, heavy=("ray", "torch", "transformers", "deepspeed")):
    """Run `code` in a fresh interpreter; return (its stdout, its stderr, the `heavy` modules it imported)."""
    probe = f"{code}\nimport sys; print(sorted(m for m in {heavy!r} if m in sys.modules))"
    p = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                       env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert p.returncode == 0, p.stderr[-2000:]
    *out, imported = p.stdout.strip().splitlines()
    return "\n".join(out), p.stderr, imported


def test_the_modules_ray_starts_actors_from_import_no_torch():
    """Ray Train's dataset manager unpickles raytrain.data.ingest.ShardedIngest, and raytrain's data
    counter is raytrain.data.progress.Counter: each an actor process of its own, started with every
    run (the dataset manager with every worker group), which uses none of torch, transformers or
    DeepSpeed. Importing torch there would cost each start ~1.6 CPU-seconds (docs/status.md #16)."""
    _, _, imported = heavy_imports_after("import raytrain.data.ingest, raytrain.data.progress",
                                         heavy=("torch", "transformers", "deepspeed"))
    assert imported == "[]"


def test_a_mistyped_key_is_refused_before_the_driver_imports_ray_or_torch():
    """raytrain.main loads the config before it imports the driver: a typo's one line comes in ~0.4 s,
    not after the ~6.5 CPU-seconds of Ray's, torch's and transformers' imports (raytrain/main.py)."""
    out, err, imported = heavy_imports_after("from raytrain.main import main; print(main(['training.max_step=1']))")
    assert (out, imported) == ("2", "[]")
    assert err.strip().startswith("raytrain: error: unknown key training.max_step; did you mean training.max_steps?")
