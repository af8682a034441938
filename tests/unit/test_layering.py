"""The package's layering, as pyproject.toml's import-linter contracts state it: imports only go
downwards (tools > main > driver > worker, planning > checkpoint > data, network > base), worker
code never imports driver code, and no package's modules import each other in a cycle."""

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
