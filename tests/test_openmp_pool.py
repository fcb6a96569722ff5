"""One OpenMP team per node process: a thread's released pool is gone, side threads that copy KV make no team.

Each case runs in a fresh interpreter and counts the process's threads (``/proc/self/task``): GNU OpenMP starts a
worker thread for a thread's first parallel loop on two threads, and keeps it for that thread's life.
"""
from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads through /proc")

POOLS = """
import os, threading, torch
from kvmesh.openmp_pool import release_this_threads_pool, serial_this_thread
torch.set_num_threads(2)
def tasks(): return len(os.listdir('/proc/self/task'))
def work(): a = torch.randn(1 << 22); (a * 2).sum(); a.clone()
base = tasks(); work(); with_team = tasks()
released = release_this_threads_pool(); after_release = tasks()
seen = {}
def side(serial):
    if serial: seen['serial_ok'] = serial_this_thread()
    work(); seen[serial] = tasks() - after_release  # this thread, and its team's worker if it made one
for serial in (True, False):
    t = threading.Thread(target=side, args=(serial,)); t.start(); t.join()
print(base, with_team, released, after_release, seen['serial_ok'], seen[True], seen[False], torch.get_num_threads())
"""

DEMOTER = """
import os, time, torch
from kvmesh.kv.block_hash import hash_blocks, root_hash
from kvmesh.kv.block_pool import NO_BLOCK, BlockPool
from kvmesh.kv.tiers.tiered_cache import HOST, TierConfig, TieredCache
torch.set_num_threads(2)
def tasks(): return len(os.listdir('/proc/self/task'))
elements = 1 << 18  # a block of 1 MiB in float32: copying it is a parallel loop
root = root_hash(b'openmp')
pool = BlockPool(4, track_changes=True)
kv = torch.randn((4, elements))
tiers = TieredCache(pool, kv, TierConfig(4 * elements * 4, 0, {folder!r}, True, staging_blocks=1), root, name='t')
before = tasks()
tiers.start()
hashes = hash_blocks(root, list(range(8)), 2)
blocks = pool.allocate(4)
pool.free(pool.cache(blocks, hashes, NO_BLOCK))  # cached and freed: the demoter copies them down
deadline = time.monotonic() + 60
while tiers.lower_run(hashes) != [HOST] * 4:
    assert time.monotonic() < deadline, 'the demoter never copied the blocks'
    time.sleep(0.01)
print(tasks() - before)
tiers.close()
"""


def _run(code: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.split()


def test_a_released_pool_is_gone_and_a_serial_thread_makes_no_team():
    base, with_team, released, after_release, serial_ok, serial_side, plain_side, threads = _run(POOLS)
    assert int(with_team) == int(base) + 1  # the main thread's first parallel loop started a worker
    assert released == "True" and int(after_release) == int(base)  # ... which the release ended
    assert serial_ok == "True" and int(serial_side) == 1  # the side thread alone: no worker of its own
    assert int(plain_side) == 2  # (a side thread that is not serial makes one: what the count can see)
    assert int(threads) == 2  # the other threads' count is untouched


def test_the_tier_demoter_copies_blocks_without_a_team_of_its_own(tmp_path):
    (extra,) = _run(DEMOTER.format(folder=str(tmp_path)))
    assert int(extra) == 1  # the demoter thread itself, and no OpenMP worker for its copies
