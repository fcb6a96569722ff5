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
