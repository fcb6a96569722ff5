"""RadixPrefixIndex: matching, splitting, locking, LRU eviction, pins, stats, concurrency."""
from __future__ import annotations

import random
import threading

import pytest

from kvmesh.kv.radix_index import RadixPrefixIndex


def test_stats_reproduce_hand_computed_figures():
    idx = RadixPrefixIndex(block_size=2)
    a = list(range(8))
    b = a + [50, 51, 52, 53, 54, 55]
    for prompt in (a, b, b):
        idx.match_prefix(prompt)
        idx.insert_prefix(prompt)
    s = idx.stats
    assert (s.requests, s.hits, s.misses) == (3, 2, 1)
    assert (s.tokens_processed, s.tokens_reused, s.tokens_computed) == (36, 22, 14)
    assert idx.get_hit_rate() == pytest.approx(2 / 3)
    assert s.reuse_rate == pytest.approx(22 / 36)
    idx.check_integrity()


def test_min_prefix_length_decides_what_counts_as_a_hit():
    idx = RadixPrefixIndex(block_size=4, min_prefix_length=8)
    idx.insert_prefix(list(range(16)))
    idx.match_prefix(list(range(4)) + [99] * 12)  # 4 tokens reused: below the threshold
    idx.match_prefix(list(range(12)) + [99] * 4)
    assert (idx.stats.hits, idx.stats.misses, idx.stats.tokens_reused) == (1, 1, 16)


def test_split_and_values():
    idx = RadixPrefixIndex(block_size=4)
    x = list(range(24))  # 6 blocks
    y = list(range(16)) + [90] * 8  # shares 4 blocks
    assert idx.insert_prefix(x, values=[10, 11, 12, 13, 14, 15]) == 6
    assert idx.insert_prefix(y, values=[10, 11, 12, 13, 20, 21]) == 2
    assert idx.num_blocks == 8
    assert idx.match_prefix(y, record=False).values == [10, 11, 12, 13, 20, 21]
    assert idx.match_prefix(x[:14], record=False).num_blocks == 3
    assert idx.match_prefix([7] * 20, record=False).num_blocks == 0
    assert "4 blocks" in idx.dump() and "2 blocks" in idx.dump()
    idx.check_integrity()


def test_lru_eviction_trims_leaves_and_respects_locks():
    idx = RadixPrefixIndex(block_size=4)
    shared = list(range(8))
    old, new = shared + [1] * 8, shared + [2] * 8
    idx.insert_prefix(old)
    idx.insert_prefix(new)
    idx.match_prefix(new, record=False)  # old is now least recently used
    assert idx.evict_lru(1) == idx.hashes_of(old)[3:4]
    assert idx.match_prefix(old, record=False).num_blocks == 3
    locked = idx.match_prefix(new, lock=True, record=False)
    evicted = idx.evict_lru(100)  # old's leaf goes; new and the shared path are locked
    assert set(evicted) == set(idx.hashes_of(old)[2:3])
    assert idx.match_prefix(new, record=False).num_blocks == 4
    idx.unlock(locked.node)
    assert len(idx.evict_lru(100)) == 4  # new's 2, then the shared parent's 2 once it is a leaf
    assert idx.num_blocks == 0
    with pytest.raises(ValueError):
        idx.unlock(locked.node)
    idx.check_integrity()


def test_partial_lock_splits_so_the_unmatched_tail_stays_evictable():
    idx = RadixPrefixIndex(block_size=4)
    idx.insert_prefix(list(range(32)))
    res = idx.match_prefix(list(range(12)), lock=True, record=False)
    assert res.num_blocks == 3
    assert len(idx.evict_lru(100)) == 5
    assert idx.match_prefix(list(range(32)), record=False).num_blocks == 3
    idx.unlock(res.node)
    idx.check_integrity()


def test_pinned_prefix_is_never_evicted():
    idx = RadixPrefixIndex(block_size=4)
    system = list(range(16))
    idx.insert_prefix(system + [5] * 8)
    node = idx.pin_prefix(system)
    assert len(idx.evict_lru(100)) == 2
    assert idx.match_prefix(system, record=False).num_blocks == 4
    idx.unpin(node)
    assert len(idx.evict_lru(100)) == 4
    with pytest.raises(KeyError):
        idx.pin_prefix(system)


def test_concurrent_insert_match_release_evict_keeps_invariants():
    idx = RadixPrefixIndex(block_size=4)
    prefixes = [[g] * 16 + list(range(100 * i, 100 * i + 4 * random.Random(i).randint(1, 6)))
                for g in range(4) for i in range(8)]
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(400):
                p = rng.choice(prefixes)
                op = rng.random()
                if op < 0.4:
                    idx.insert_prefix(p)
                elif op < 0.8:
                    res = idx.match_prefix(p, lock=True)
                    # A locked path must survive any eviction until it is released.
                    assert idx.match_prefix(p[: res.num_blocks * 4], record=False).num_blocks == res.num_blocks
                    idx.unlock(res.node)
                else:
                    idx.evict_lru(rng.randint(1, 10))
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    idx.check_integrity()
    assert all(n.lock_ref == 0 for n in idx._nodes())
