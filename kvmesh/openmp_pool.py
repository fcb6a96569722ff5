"""The OpenMP worker pool of a thread that stops computing, released so the engine thread's team runs at full speed.

PyTorch's CPU kernels (and ours, ``kernels/cpu``) run their parallel loops on the calling thread's OpenMP team.
GNU OpenMP (the runtime PyTorch's CPU wheels ship) keeps a pool of worker threads per thread that ever ran a
parallel loop, for that thread's life, and once the process holds more such threads than it has cores it stops
letting idle workers spin between loops: each of the hundreds of parallel loops of a decode step then waits for
its workers to be woken. A node computes on two threads, one after the other: its start-up (weights, the
compute probe) on the thread that starts it, then every step on the engine thread, and the first one's pool
would outlive its work. ``release_this_threads_pool`` frees the calling thread's pool (OpenMP 5's
``omp_pause_resource_all``): a thread calls it once it has computed its last step, before another starts.
Side threads that copy KV with torch (a tier's demoter, restores into a lease) would make teams of their own:
they run their loops alone (``serial_this_thread``). Where the runtime is not GNU OpenMP (or there is none)
both do nothing.
"""
from __future__ import annotations

import ctypes
import logging
import sys

log = logging.getLogger(__name__)

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: threads released, the runtime's state kept


_loaded: list[ctypes.CDLL] = []  # the library once found (a search that found none is repeated: torch may load later)


def _libgomp() -> ctypes.CDLL | None:
    """The GNU OpenMP library this process has loaded (PyTorch's own copy where it ships one), else None."""
    if _loaded:
        return _loaded[0]
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libgomp" in line and line.rstrip().endswith(".so.1")}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)
            lib.omp_pause_resource_all.argtypes = [ctypes.c_int]
            lib.omp_pause_resource_all.restype = ctypes.c_int
            lib.omp_set_num_threads.argtypes = [ctypes.c_int]
        except (OSError, AttributeError):
            continue
        _loaded.append(lib)
        return lib
    return None


def release_this_threads_pool() -> bool:
    """Frees the OpenMP worker threads of the calling thread's team (its next parallel loop would start new ones);
    False where there is no GNU OpenMP runtime loaded or it refused (the call is then a no-op)."""
    lib = _libgomp()
    if lib is None:
        return False
    refused = lib.omp_pause_resource_all(OMP_PAUSE_SOFT)
    if refused:
        log.debug("omp_pause_resource_all refused (%d): the calling thread keeps its OpenMP pool", refused)
    return not refused


def serial_this_thread() -> bool:
    """The calling thread's parallel loops from now on run on it alone (its OpenMP thread count set to 1, its
    own and no one else's), so a side thread that copies KV (a tier's demotions, a restore into a lease) makes
    no team of its own beside the engine thread's. Called at the start of such threads (a pool's
    ``initializer``); False where torch or GNU OpenMP is not loaded (nothing to do)."""
    torch = sys.modules.get("torch")
    lib = _libgomp() if torch is not None else None
    if lib is None:
        return False
    torch.get_num_threads()  # torch sets a thread's OpenMP count at its first parallel loop: done now, not later
    lib.omp_set_num_threads(1)
    return True
