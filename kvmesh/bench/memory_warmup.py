"""Memory touched once before a benchmark starts its servers, so that none starts on memory never touched before.

On this project's machines (a sandboxed VM) servers started one after another in one benchmark do not compute
equally fast: with two identical ``kvmesh serve`` targets in one ``kvmesh bench serve`` run, the one started
first decoded about a fifth slower, and once a process had touched and freed several GiB first the two were
within a few percent. Over more runs the warm-up made the gap smaller, not always gone
(``docs/benchmarks.md``, session 41), so a benchmark that starts servers one after another touches that much
memory page by page and frees it before it starts any of them (``touch_and_free``), and says so in its JSON.
"""
from __future__ import annotations

import mmap
import sys
import time

PAGE = 4096
AUTO_SHARE = 0.6  # of the memory available now: every server of a run fits in what was touched


def available_gib() -> float:
    """MemAvailable from ``/proc/meminfo`` in GiB (0 where there is no such file)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return 0.0


def resolve_gib(gib: float) -> float:
    """``--touch-memory-gib``'s value: negative means auto (``AUTO_SHARE`` of the memory available now)."""
    return AUTO_SHARE * available_gib() if gib < 0 else gib


def touch_and_free(gib: float) -> float:
    """Map ``gib`` GiB of anonymous memory, write one byte in every page, unmap it; returns the seconds taken
    (0 for nothing to touch). Nothing stays allocated after it returns."""
    num_bytes = int(gib * 2**30) // PAGE * PAGE
    if num_bytes <= 0:
        return 0.0
    import numpy as np

    start = time.perf_counter()
    region = mmap.mmap(-1, num_bytes)
    try:
        pages = np.frombuffer(region, dtype=np.uint8)
        pages[::PAGE] = 1  # one write per page: each page faulted in
        del pages  # the buffer's export, before the map can close
    finally:
        region.close()
    return time.perf_counter() - start


def add_argument(p, before: str) -> None:
    """``--touch-memory-gib`` on a benchmark's parser (or group); ``before``: what the touch comes before."""
    p.add_argument("--touch-memory-gib", type=float, default=-1.0,
                   help=f"GiB of memory touched page by page and freed before {before} (kvmesh/bench/memory_warmup.py; "
                        "-1: 60%% of the memory available; 0: none)")


def warm_up(gib: float, res: dict) -> None:
    """``--touch-memory-gib``'s value resolved, touched and freed (said on stderr), and recorded in the benchmark's
    JSON ``res`` as ``memory_touched_gib``."""
    touched = res["memory_touched_gib"] = round(resolve_gib(gib), 1)
    if touched > 0:
        print(f"touching {touched:.1f} GiB of memory before anything starts ...", file=sys.stderr)
        touch_and_free(touched)
