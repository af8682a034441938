"""raytrain.checkpoint.scratch: a worker starting on a node removes the checkpoint scratch that killed workers of that
node left in TMPDIR (a save's shard, a restore's download, a conversion), and nothing else."""

import os
import socket
import subprocess
import sys

from raytrain.checkpoint import scratch


def test_a_starting_worker_removes_the_scratch_of_this_hosts_stopped_processes_only(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    ours = [scratch.make(kind) for kind in ("ckpt", "restore", "universal")]  # a running process: this one
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    dead_pid, host = int(gone.stdout), socket.gethostname()
    dead = [tmp_path / f"raytrain-{kind}-{host}-{dead_pid}-x1_y2z3" for kind in ("ckpt", "restore", "universal")]
    elsewhere = tmp_path / f"raytrain-ckpt-another-host-{dead_pid}-abcd1234"  # a TMPDIR shared with another host
    unrelated = tmp_path / f"raytrain-export-{host}-{dead_pid}-abcd1234"  # not a worker's checkpoint scratch
    for path in (*dead, elsewhere, unrelated):
        (path / "step_00000010").mkdir(parents=True)
        (path / "step_00000010" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"GBs, in a real run")
    assert sorted(scratch.remove_dead()) == sorted(map(str, dead))
    assert not any(p.exists() for p in dead)
    assert all(os.path.isdir(p) for p in (*ours, elsewhere, unrelated))
    assert all(os.path.basename(p).startswith(f"raytrain-{k}-{host}-{os.getpid()}-")
               for p, k in zip(ours, ("ckpt", "restore", "universal")))
    assert scratch.remove_dead() == []  # and a second worker of the node finds nothing more
