"""A worker's scratch directories for checkpoints (worker side): a save's local shard before Ray Train uploads it,
a restore's download, a universal conversion's output. Each is removed when its work ends, but a worker that Ray
kills (a group stopped for a resize after its 5 s patience, a failure elsewhere, a lost node's restart) leaves its
own, and a checkpoint's shard is GBs: repeated resizes filled TMPDIR until a save or restore stopped the run for want
of space. So each name carries its host and process, and a worker starting on a node removes those of processes of
that host that are gone (`remove_dead`)."""

from __future__ import annotations

import os
import re
import shutil
import socket
import tempfile

_NAME = re.compile(r"raytrain-(?:ckpt|restore|universal)-(?P<host>.+)-(?P<pid>\d+)-[^-]+$")


def prefix(kind: str) -> str:
    """The name prefix of a scratch directory of `kind` (ckpt, restore, universal) for this process."""
    return f"raytrain-{kind}-{socket.gethostname()}-{os.getpid()}-"


def make(kind: str) -> str:
    """A new scratch directory of `kind` in TMPDIR, named for this host and process."""
    return tempfile.mkdtemp(prefix=prefix(kind))


def remove_dead(tmp: str | None = None) -> list[str]:
    """Remove the scratch directories in `tmp` (TMPDIR) of this host's processes that no longer run; their paths.
    Another host's (a TMPDIR shared between containers) and a running process's are left alone."""
    tmp = tmp or tempfile.gettempdir()
    host, removed = socket.gethostname(), []
    try:
        names = os.listdir(tmp)
    except OSError:
        return removed
    for name in names:
        match = _NAME.match(name)
        if match is None or match["host"] != host or _running(int(match["pid"])):
            continue
        path = os.path.join(tmp, name)
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: running
        pass
    return True
