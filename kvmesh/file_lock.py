"""One process at a time for work every process would otherwise repeat (a build, a conversion into the cache).

    with exclusive(path):        # blocks while another process holds ``path``'s lock
        if not done(): do()      # checked again inside: the holder before us may have done it

An advisory ``flock`` on ``path`` (created if missing), released when the block ends or the process dies, so a
killed builder never leaves the lock held. Where the file cannot be created (a read-only cache), the block runs
unlocked: the work is then repeated, never refused.
"""
from __future__ import annotations

import fcntl
import os
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def exclusive(path: Path):
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing drops the lock
