"""BlockPool, vLLM-style exact tests on small pools: ids, queue order, hits, eviction, pins."""
from __future__ import annotations

import pytest

from kvmesh.errors import OutOfBlocksError
from kvmesh.kv.block_hash import hash_blocks, root_hash
from kvmesh.kv.block_pool import NO_BLOCK, BlockPool
from kvmesh.kv.eviction import ChainOrderLRU

ROOT = root_hash(b"test")


@pytest.fixture(autouse=True, params=["native", "dict"])
def block_index(request, monkeypatch):
    """Every test runs on both block indexes (kvmesh.kv.block_index): the same pool behaviour."""
    monkeypatch.setenv("KVMESH_BLOCK_INDEX", request.param)
    return request.param


def free_queue(pool: BlockPool) -> list[int]:
    out, b = [], pool._next[pool.num_blocks]
    while b != pool.num_blocks:
        out.append(b)
        b = pool._next[b]
    return out


def cache_chain(pool: BlockPool, blocks: list[int], hashes: list[bytes]) -> None:
    parent = NO_BLOCK
    for b, h in zip(blocks, hashes):
        assert pool.cache([b], [h], parent) == [b]
        parent = b


def test_allocate_free_order_and_counts():
    pool = BlockPool(11)
    a = pool.allocate(4)
    assert a == [0, 1, 2, 3] and pool.num_free_blocks == 7
    b = pool.allocate(3)
    assert b == [4, 5, 6]
    pool.free(a)  # tail first: 3, 2, 1, 0 join the queue's tail
    assert free_queue(pool) == [7, 8, 9, 10, 3, 2, 1, 0]
    assert pool.usage() == (3, 0, 8, 0)
    with pytest.raises(OutOfBlocksError):
        pool.allocate(9)
    with pytest.raises(ValueError):
        pool.free([0])  # already free
    pool.check_integrity()


def test_freed_blocks_stay_matchable_until_reused():
    pool = BlockPool(11, track_changes=True)
    tokens = list(range(16 * 3))
    hashes = hash_blocks(ROOT, tokens, 16)
    blocks = pool.allocate(3)
    cache_chain(pool, blocks, hashes)
    pool.free(blocks)
    assert pool.usage() == (0, 3, 8, 0)
    assert pool.match(hashes) == [0, 1, 2]
    assert pool.match(hashes[:2] + [b"x" * 16]) == [0, 1]
    # A hit takes the blocks out of the queue.
    pool.touch(pool.match(hashes[:2]))
    assert pool.block_state(0).ref_count == 1 and 0 not in free_queue(pool) and 2 in free_queue(pool)
    pool.free([0, 1])
    # Allocating 8 takes the 8 never-used blocks; 9 takes the chain's tail (block 2) before its head.
    pool.allocate(8)
    assert pool.match(hashes) == [0, 1, 2]
    pool.allocate(1)
    assert pool.match(hashes) == [0, 1]
    assert pool.take_changes() == (hashes, [hashes[2]])
    assert pool.take_changes() == ([], [])
    pool.check_integrity()


def test_duplicate_hash_moves_the_reference_to_the_holder():
    pool = BlockPool(6)
    h = hash_blocks(ROOT, list(range(16)), 16)[0]
    x, y = pool.allocate(2)
    assert pool.cache([x], [h]) == [x]
    assert pool.cache([y], [h]) == [x]  # x holds the hash: the caller's reference moves to x, y is freed
    assert pool.block_state(y) == (0, 0, None, 1) and pool.block_state(x) == (2, 0, h, 1)
    assert y in free_queue(pool)
    pool.check_integrity()


@pytest.mark.parametrize("policy", [None, ChainOrderLRU()])
def test_chain_aware_eviction_never_orphans_tails(policy):
    """Even when a request's blocks enter the queue head first, heads outlive their tails."""
    pool = BlockPool(8, policy)
    hashes = hash_blocks(ROOT, list(range(16 * 4)), 16)
    blocks = pool.allocate(4)
    cache_chain(pool, blocks, hashes)
    pool.free(blocks)
    pool.allocate(4)  # the never-used blocks go first
    for expected_len in (3, 2, 1, 0):
        pool.allocate(1)
        assert len(pool.match(hashes)) == expected_len
        pool.check_integrity()


def test_evict_takes_leaves_lru_first():
    pool = BlockPool(11)
    a_hashes = hash_blocks(ROOT, list(range(48)), 16)
    b_hashes = hash_blocks(ROOT, list(range(100, 132)), 16)
    a = pool.allocate(3)
    cache_chain(pool, a, a_hashes)
    b = pool.allocate(2)
    cache_chain(pool, b, b_hashes)
    pool.free(a)
    pool.free(b)
    assert pool.evict(2) == [a[2], a[1]]
    assert len(pool.match(a_hashes)) == 1 and len(pool.match(b_hashes)) == 2
    assert len(pool.evict(10)) == 3
    assert pool.usage() == (0, 0, 11, 0)
    pool.check_integrity()


def test_pinned_prefix_survives_pressure():
    pool = BlockPool(6)
    hashes = hash_blocks(ROOT, list(range(32)), 16)
    sys_prompt = pool.allocate(2)
    cache_chain(pool, sys_prompt, hashes)
    assert pool.match(hashes, hold="pin") == sys_prompt
    pool.free(sys_prompt)
    assert pool.num_free_blocks == 4
    pool.allocate(4)
    with pytest.raises(OutOfBlocksError):
        pool.allocate(1)
    assert pool.match(hashes) == sys_prompt
    pool.unpin(sys_prompt)
    assert pool.num_free_blocks == 2
    with pytest.raises(ValueError):
        pool.unpin(sys_prompt)
    pool.check_integrity()


def test_concurrent_match_allocate_free_keep_integrity():
    """Engine admission, prefill pulls and holders share one pool from different threads.

    A matched block must still hold its hash while the matcher holds the reference
    (match + reference is one locked operation); integrity holds throughout.
    """
    import random
    import sys
    import threading

    pool = BlockPool(64)
    chains = [hash_blocks(root_hash(bytes([c])), list(range(8 * 16)), 16) for c in range(6)]
    errors: list[str] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        for i in range(1000):
            hashes = chains[rng.randrange(len(chains))]
            held = pool.match(hashes, hold="ref")
            for b, h in zip(held, hashes):
                if pool.block_state(b).block_hash != h:
                    errors.append(f"block {b} lost its hash while referenced")
            try:
                new = pool.allocate(rng.randrange(1, 6))
            except OutOfBlocksError:
                new = []
            if len(held) < len(hashes) and new:  # "computed" the next blocks of the chain
                n = min(len(new), len(hashes) - len(held))
                kept = pool.cache(new[:n], hashes[len(held):len(held) + n], held[-1] if held else NO_BLOCK)
                new = kept + new[n:]
            pins = pool.match(hashes, hold="pin")
            pool.unpin(pins)
            pool.free(held + new)
            if i % 10 == 0:  # while the other workers are mid-way
                pool.check_integrity()

    def guarded(seed: int) -> None:  # a failure in a thread is only a warning: collect it for the test
        try:
            worker(seed)
        except BaseException as e:
            errors.append(f"worker {seed}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=guarded, args=(s,)) for s in range(4)]
    switch_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # threads switch every few operations, not every 5 ms
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(switch_interval)
    pool.check_integrity()
    assert not errors, errors[:3]
    assert pool.usage().num_used == 0


def _naive_match(pool: BlockPool, hashes: list[bytes]) -> list[int]:
    out = []
    for h in hashes:
        b = pool.cached_block(h)
        if b is None:
            break
        out.append(b)
    return out


@pytest.mark.parametrize("seed", range(4))
def test_match_memo_and_run_inserts_agree_with_a_naive_match(seed):
    """Random inserts (whole chains, extensions, consecutive and scattered block ids, duplicates), frees,
    evictions and reallocations: match (memoised chains, fast run inserts) equals a block-by-block lookup."""
    import random

    rng = random.Random(seed)
    pool = BlockPool(96, max_memo_chains=8)
    chains = [hash_blocks(root_hash(bytes([c])), list(range(20 * 16)), 16) for c in range(5)]
    for _ in range(400):
        hashes = chains[rng.randrange(len(chains))][: rng.randrange(1, 21)]
        assert pool.match(hashes) == _naive_match(pool, hashes)
        held = pool.match(hashes, hold="ref")
        want = rng.randrange(0, len(hashes) - len(held) + 1)
        try:
            new = pool.allocate(want)
        except OutOfBlocksError:
            new = []
        if rng.random() < 0.5:
            rng.shuffle(new)  # scattered ids take the per-block path
        parent = held[-1] if held else NO_BLOCK
        if new and rng.random() < 0.3:  # one block at a time, as decode fills blocks
            for i, b in enumerate(new):
                parent = pool.cache([b], hashes[len(held) + i: len(held) + i + 1], parent)[0]
                new[i] = parent
        elif new:
            new = pool.cache(new, hashes[len(held): len(held) + len(new)], parent)
        assert pool.match(hashes) == _naive_match(pool, hashes)
        pool.free(held + new)
        if rng.random() < 0.2:
            pool.evict(rng.randrange(1, 10))
        pool.check_integrity()


def test_caching_the_same_blocks_again_returns_them():
    pool = BlockPool(8)
    hashes = hash_blocks(ROOT, list(range(64)), 16)
    blocks = pool.allocate(4)
    assert pool.cache(blocks, hashes) == blocks
    assert pool.cache(blocks, hashes) == blocks  # every block already holds its own hash
    assert pool.cache(blocks[2:], hashes[2:], blocks[1]) == blocks[2:]
    pool.free(blocks)
    pool.check_integrity()


def test_inserting_over_a_hashed_block_is_refused_on_both_paths():
    pool = BlockPool(8)
    hashes = hash_blocks(ROOT, list(range(64)), 16)
    blocks = pool.allocate(4)
    pool.cache(blocks[:2], hashes[:2])
    other = hash_blocks(root_hash(b"other"), list(range(64)), 16)
    with pytest.raises(ValueError, match="already holds a hash"):
        pool.cache(blocks[:2], other[:2])  # consecutive ids
    with pytest.raises(ValueError, match="already holds a hash"):
        pool.cache([blocks[1], blocks[0]], other[2:4])  # scattered ids
    pool.check_integrity()


def test_match_holds_what_it_matched_and_evict_names_its_victims():
    pool = BlockPool(8)
    hashes = hash_blocks(ROOT, list(range(80)), 16)  # 5 blocks
    blocks = pool.allocate(3)
    assert pool.cache(blocks, hashes[:3]) == blocks
    pool.free(blocks)
    assert pool.match(hashes) == blocks and pool.usage() == (0, 3, 5, 0)  # no hold: nothing taken
    assert pool.match(hash_blocks(root_hash(b"other"), list(range(16)), 16), hold="ref") == []
    pinned = pool.match(hashes, hold="pin", skip=1)
    assert pinned == blocks[1:] and pool.usage() == (2, 1, 5, 2)
    assert pool.evict(8) == []  # block 0 has a cached child; its children are pinned
    pool.unpin(pinned)
    assert pool.match(hashes, hold="ref") == blocks and pool.usage().num_used == 3
    pool.free(blocks)
    assert pool.evict(2) == [blocks[2], blocks[1]]  # leaves first: the chain's tail, then its parent
    assert pool.match(hashes) == blocks[:1]
    with pytest.raises(ValueError, match="hold must be"):
        pool.match(hashes, hold="touch")
    # Cached free blocks adopted count as supply: 8 free, block 0 among them, so 8 fresh after it do not fit.
    assert pool.allocate_after(blocks[:1], hashes[:1], 8) is None and pool.usage().num_used == 0
    adopted = pool.allocate_after(blocks[:1], hashes[:1], 7)
    assert adopted[0] == blocks[0] and len(adopted) == 8 and pool.num_free_blocks == 0
    pool.free(adopted)
    pool.check_integrity()


def test_allocation_is_sorted_so_a_request_freed_tail_first_comes_back_as_one_run():
    pool = BlockPool(16)
    first = pool.allocate(6)
    rest = pool.allocate(10)
    pool.free(first)  # the default policy queues a request's blocks tail first: 5, 4, ..., 0
    assert free_queue(pool) == first[::-1]
    again = pool.allocate(6)
    assert again == first == list(range(6))  # one run again: a single transfer descriptor, slice writes
    hashes = hash_blocks(ROOT, list(range(96)), 16)
    assert pool.cache(again, hashes) == again and pool.match(hashes) == again
    pool.free(again + rest)
    pool.check_integrity()


def test_evictions_are_counted_where_they_happen():
    """A cached block that loses its hash, to an allocation or to evict(), is one eviction in the engine's stats."""
    from kvmesh import LLM, SamplingParams

    llm = LLM("tiny-llama", num_kv_blocks=12, progress=False)
    greedy = SamplingParams(max_tokens=1, temperature=0.0)
    llm.generate([list(range(1, 65))], greedy, use_tqdm=False)  # 4 full blocks cached
    assert llm.engine.kv.stats_dict()["evictions"] == 0
    llm.generate([list(range(100, 276))], greedy, use_tqdm=False)  # 11 blocks of 12: the first prompt's must go
    evicted = llm.engine.kv.stats_dict()["evictions"]
    assert evicted > 0 and evicted == llm.engine.pool.num_evicted
    llm.engine.kv.reset_stats()
    assert llm.engine.kv.stats_dict()["evictions"] == 0
    llm.engine.pool.evict(llm.engine.pool.num_blocks)
    assert llm.engine.kv.stats_dict()["evictions"] > 0
    llm.engine.pool.check_integrity()


@pytest.mark.parametrize("seed,policy,num_blocks,num_chains", [(0, None, 40, 6), (1, None, 40, 6), (2, None, 40, 6),
                                                              (3, ChainOrderLRU, 400, 60)])
def test_allocation_under_pressure_is_the_same_on_both_indexes(seed, policy, num_blocks, num_chains, monkeypatch):
    """Allocation's walk of the free queue (in C for the native index: digests forgotten as blocks are taken,
    the walk starting over when a passed-over parent becomes a leaf) takes exactly the blocks the Python walk
    takes, in the same order, and reports the same evicted hashes: two pools driven alike stay alike. Freed head
    first (ChainOrderLRU), a big pool makes the walk pass over more parents than the C keeps on its stack."""
    import random

    rng = random.Random(seed)
    pools = []
    for kind in ("native", "dict"):
        monkeypatch.setenv("KVMESH_BLOCK_INDEX", kind)
        pools.append(BlockPool(num_blocks, policy=policy() if policy else None, track_changes=True,
                               max_memo_chains=4))
    chains = [hash_blocks(root_hash(bytes([c])), list(range(12 * 16)), 16) for c in range(num_chains)]
    held: list[list[int]] = []
    for _ in range(300):
        hashes = chains[rng.randrange(len(chains))][: rng.randrange(1, 13)]
        matched = [p.match(hashes, hold="ref") for p in pools]
        assert matched[0] == matched[1]
        want = min(len(hashes) - len(matched[0]), pools[0].num_free_blocks)
        new = [p.allocate(want) for p in pools]
        assert new[0] == new[1]
        parent = matched[0][-1] if matched[0] else NO_BLOCK
        cached = [p.cache(n, hashes[len(matched[0]): len(matched[0]) + want], parent) if n else [] for p, n in
                  zip(pools, new)]
        assert cached[0] == cached[1]
        held.append(matched[0] + cached[0])
        while held and (len(held) > 3 or rng.random() < 0.3):
            blocks = held.pop(rng.randrange(len(held)))
            if rng.random() < 0.5:
                blocks.reverse()
            for p in pools:
                p.free(blocks)
        assert free_queue(pools[0]) == free_queue(pools[1])
        changes = [p.take_changes() for p in pools]
        assert changes[0] == changes[1]
        for p in pools:
            p.check_integrity()


def test_a_long_chain_freed_head_first_is_evicted_tail_first_on_both_indexes(monkeypatch):
    """A 150-block chain freed head first (ChainOrderLRU) puts 149 parents ahead of its leaf in the free queue:
    allocation passes over all of them (more than the C walk keeps on its stack), takes the tail, and goes back
    for each parent that became a leaf, on both indexes alike."""
    hashes = hash_blocks(ROOT, list(range(150 * 16)), 16)
    taken = []
    for kind in ("native", "dict"):
        monkeypatch.setenv("KVMESH_BLOCK_INDEX", kind)
        pool = BlockPool(200, policy=ChainOrderLRU(), track_changes=True)
        blocks = pool.allocate(150)
        pool.cache(blocks, hashes)
        pool.free(blocks)
        pool.take_changes()
        got = pool.allocate(60)  # the 50 never-cached blocks, then the chain's last 10, tail first
        assert sorted(got) == sorted(list(range(150, 200)) + blocks[140:])
        assert pool.take_changes().evicted == hashes[140:][::-1]
        assert pool.match(hashes) == blocks[:140]
        pool.check_integrity()
        taken.append(got)
    assert taken[0] == taken[1]


def test_a_memo_from_before_its_block_was_allocated_again_never_extends_a_chain():
    """The chain memo keyed by block 1 outlives block 1's reallocation; block 1 then holds another chain's
    hash (under a parent whose memo is gone): growing that chain must walk the index, not the stale memo."""
    pool = BlockPool(4, max_memo_chains=2)
    a = hash_blocks(root_hash(b"a"), list(range(32)), 16)
    q = hash_blocks(root_hash(b"q"), list(range(48)), 16)
    c = hash_blocks(root_hash(b"c"), list(range(16)), 16)
    assert pool.allocate(4) == [0, 1, 2, 3]
    pool.cache([2], q[:1])
    pool.cache([0, 1], a)  # memo: block 1 -> [0, 1]
    pool.cache([3], c)  # the memo holds two: block 2's goes
    pool.free([0, 1])
    assert sorted(pool.allocate(2)) == [0, 1]  # a's hashes go, blocks 0 and 1 allocated again
    pool.cache([1], q[1:2], parent_block_id=2)
    pool.cache([0], q[2:3], parent_block_id=1)
    assert pool.match(q) == [2, 1, 0]
    assert pool.match(a) == []
    pool.check_integrity()


def test_stored_checksums_hold_until_a_block_is_allocated_again():
    from kvmesh.kv.block_checksums import BlockChecksums

    pool = BlockPool(4)
    contents = {b: 100 + b for b in range(4)}  # a block's "bytes"
    computed = []

    def crc(block_ids):
        computed.extend(block_ids)
        return [contents[b] for b in block_ids]

    checksums = BlockChecksums(pool, crc)
    ids = pool.allocate(2)
    pool.free(pool.cache(ids, hash_blocks(ROOT, list(range(32)), 16)))
    assert checksums.of_cached(ids) == [100 + b for b in ids] and computed == ids
    assert checksums.of_cached(ids) == [100 + b for b in ids] and computed == ids  # stored: none recomputed
    for b in ids:
        contents[b] += 1  # only a new owner rewrites a block
    again = pool.allocate(4)  # takes the cached blocks too: their epochs move on
    assert set(ids) <= set(again)
    assert checksums.of_cached(ids) == [101 + b for b in ids] and computed == ids + ids
    checksums.remember([again[0]], [7])
    assert checksums.of_cached([again[0]]) == [7]
    assert checksums.describe() == {"computed": 4, "reused": 3}
    pool.free(again)
    pool.check_integrity()


def test_uncache_reports_come_after_the_lock_is_released_in_order_and_allocate_after_is_atomic():
    """The tiers' hook hears of every hash that left the cache, in order, from the thread that evicted it, with
    the pool's lock free (another thread can use the pool meanwhile: no callback runs under the lock)."""
    import threading

    pool = BlockPool(4)
    hashes = hash_blocks(root_hash(b"r"), list(range(4 * 16)), 16)
    blocks = pool.allocate(4)
    cache_chain(pool, blocks, hashes)
    pool.free(blocks)
    heard, others_got_in = [], []

    def hook(h, parent):
        other = threading.Thread(target=lambda: others_got_in.append(pool.usage().num_cached))
        other.start()
        other.join(timeout=5)  # would time out with the lock held by this thread
        assert not other.is_alive()
        assert pool.cached_or_reported([h]) == (set(), {h})  # still being reported while the hook runs
        heard.append((h, parent))

    pool.on_uncache = hook
    assert pool.evict(2) == [blocks[3], blocks[2]]  # leaves first
    assert heard == [(hashes[3], hashes[2]), (hashes[2], hashes[1])] and len(others_got_in) == 2
    assert pool.cached_or_reported(hashes) == (set(hashes[:2]), set())  # every report returned
    # allocate_after: the cached blocks adopted only while they still hold their hashes, atomically with the rest
    got = pool.allocate_after([blocks[0], blocks[1]], hashes[:2], 1)
    assert got[:2] == [blocks[0], blocks[1]] and len(got) == 3
    assert pool.allocate_after([], [], 5) is None  # no room: nothing taken
    pool.free(got)
    stale = pool.allocate(4)  # every block reallocated: the hashes are gone
    assert pool.allocate_after([blocks[0]], hashes[:1], 0) is None
    pool.free(stale)
    pool.check_integrity()


def test_queue_moved_is_set_when_the_free_queue_moves_and_only_then():
    """A lower tier's demoter sleeps on ``queue_moved``: every way blocks join or leave the free queue sets it, a
    reference change that leaves the queue as it was does not."""
    pool = BlockPool(8)
    moved = pool.queue_moved

    def sets(action) -> bool:
        moved.clear()
        action()
        return moved.is_set()

    blocks = []
    assert sets(lambda: blocks.extend(pool.allocate(3)))  # the head taken
    assert not sets(lambda: pool.touch(blocks[:1]))  # ref 1 -> 2: still out of the queue
    assert not sets(lambda: pool.free(blocks[:1]))  # 2 -> 1
    assert sets(lambda: pool.free(blocks[:1]))  # 1 -> 0: joins the queue
    assert sets(lambda: pool.touch(blocks[:1]))  # leaves it again
    assert not sets(lambda: pool.match([], hold="pin"))
    cache_chain(pool, blocks, hash_blocks(ROOT, list(range(12)), 4))
    assert sets(lambda: pool.free(blocks))  # cached blocks become victims
    assert sets(lambda: pool.match(hash_blocks(ROOT, list(range(12)), 4), hold="pin"))
    assert not sets(lambda: pool.match(hash_blocks(ROOT, list(range(12)), 4), hold="pin"))  # pinned already
    assert not sets(lambda: pool.unpin(blocks))  # one pin of two left
    assert sets(lambda: pool.unpin(blocks))
    pool.check_integrity()
