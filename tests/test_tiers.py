"""Lower KV tiers (host memory, local disk) under a real BlockPool: movement, chains, checksums, re-adoption."""
from __future__ import annotations

import random
import time
from dataclasses import replace

import pytest
import torch

from kvmesh.kv.block_hash import hash_blocks, root_hash
from kvmesh.kv.block_pool import NO_BLOCK, BlockPool
from kvmesh.kv.tiers.tiered_cache import DISK, HOST, TierConfig, TieredCache
from transfer.block_source import TieredSource

ROOT = root_hash(b"tiers-test")
BLOCK = 4  # tokens per block
SHAPE = (2, 2, BLOCK, 2, 8)  # layers, K/V, tokens, kv heads, head dim: 512 bytes per block in float32
BLOCK_BYTES = 2 * 2 * BLOCK * 2 * 8 * 4


def chain(seed: int, num_blocks: int) -> list[bytes]:
    rng = random.Random(seed)
    return hash_blocks(ROOT, [rng.randrange(1000) for _ in range(num_blocks * BLOCK)], BLOCK)


class Node:
    """A pool, its KV buffer, and the tiers below it; ``compute`` stands in for the engine."""

    def __init__(self, tmp_path, num_blocks=8, host_blocks=8, disk_blocks=16, disk_path=None, verify=True):
        self.pool = BlockPool(num_blocks, track_changes=True)
        self.kv = torch.zeros((num_blocks, *SHAPE))
        self.truth: dict[bytes, torch.Tensor] = {}  # what each block's KV must be, wherever it lives
        cfg = TierConfig(host_blocks * BLOCK_BYTES, disk_blocks * BLOCK_BYTES,
                         str(disk_path or tmp_path), verify, staging_blocks=4)
        self.tiers = TieredCache(self.pool, self.kv, cfg, ROOT, name="n0")

    def compute(self, hashes: list[bytes]) -> None:
        """Hold the cached prefix, 'compute' the rest (deterministic bytes per hash), cache, free."""
        held = self.pool.match(hashes, hold="ref")
        held += self.tiers.promote(hashes[len(held):], held[-1] if held else NO_BLOCK).block_ids
        start = len(held)
        new = self.pool.allocate(len(hashes) - start)
        for b, h in zip(new, hashes[start:]):
            self.kv[b] = self.expected(h)
        if new:
            held += self.pool.cache(new, hashes[start:], held[-1] if held else NO_BLOCK)
        for b, h in zip(held, hashes):
            assert torch.equal(self.kv[b], self.expected(h)), "a block's KV is not what was computed"
        self.pool.free(held)

    def push_down(self, hashes: list[bytes]) -> None:
        """Compute a chain, copy it below tier 0, and empty tier 0: the chain lives in the lower tiers only."""
        self.compute(hashes)
        self.tiers.demote_now()
        self.pool.evict(self.pool.num_blocks)

    def expected(self, h: bytes) -> torch.Tensor:
        if h not in self.truth:
            self.truth[h] = torch.randn(SHAPE, generator=torch.Generator().manual_seed(int.from_bytes(h[:4], "little")))
        return self.truth[h]

    def check(self) -> None:
        self.pool.check_integrity()
        self.tiers.check_integrity()

    def close(self) -> None:
        self.tiers.close()


@pytest.fixture
def node(tmp_path):
    n = Node(tmp_path)
    yield n
    n.close()


@pytest.fixture
def disk_node(tmp_path):
    """No host tier: tier 0 spills straight to disk."""
    n = Node(tmp_path, num_blocks=6, host_blocks=0, disk_blocks=16)
    yield n
    n.close()


def test_demote_then_promote_is_bitwise(node):
    hashes = chain(1, 6)
    node.compute(hashes)
    assert node.tiers.demote_now() == 6
    node.pool.evict(node.pool.num_blocks)  # tier 0 forgets everything (push_down, with the count checked)
    assert node.pool.match(hashes) == []
    assert node.tiers.lower_run(hashes) == [HOST] * 6
    node.check()
    blocks = node.tiers.promote(hashes).block_ids
    assert len(blocks) == 6 and node.pool.match(hashes) == blocks
    for b, h in zip(blocks, hashes):
        assert torch.equal(node.kv[b], node.expected(h))
    node.pool.free(blocks)
    assert node.tiers.counters["promoted_host"] == 6
    node.check()


def test_host_victims_move_to_disk_and_come_back_bitwise(node):
    chains = [chain(seed, 4) for seed in range(6)]  # 24 blocks: the host tier (8) and the disk (16) hold them all
    for hashes in chains:
        node.compute(hashes)
        node.tiers.demote_now()
        node.check()
    assert len(node.tiers.disk) > 0 and node.tiers.counters["demoted_disk"] > 0
    first = chains[0]
    assert node.tiers.tier_of(first[0]) == DISK
    blocks = node.tiers.promote(first).block_ids
    assert len(blocks) == 4
    for b, h in zip(blocks, first):
        assert torch.equal(node.kv[b], node.expected(h))
    node.pool.free(blocks)
    node.check()


def test_chains_stay_whole_across_tiers_under_a_random_workload(tmp_path):
    n = Node(tmp_path, num_blocks=10, host_blocks=6, disk_blocks=9)
    rng = random.Random(7)
    roots = [chain(seed, 6) for seed in range(6)]
    try:
        for step in range(300):
            base = rng.choice(roots)
            hashes = base[: rng.randint(1, 6)]
            if rng.random() < 0.3:  # a branch off a shared prefix
                tail = hash_blocks(hashes[-1], [rng.randrange(1000) for _ in range(BLOCK)], BLOCK)
                hashes = hashes + tail
            n.compute(hashes)
            if step % 3 == 0:
                n.tiers.demote_now()
            if rng.random() < 0.2:
                n.pool.evict(rng.randint(1, 4))
            n.check()
        assert n.tiers.counters["dropped"] > 0 and n.tiers.counters["promoted_disk"] > 0
    finally:
        n.close()


def test_a_corrupted_disk_block_is_detected_and_dropped_with_its_descendants(disk_node):
    n = disk_node
    hashes = chain(3, 5)
    n.push_down(hashes)
    assert n.tiers.lower_run(hashes) == [DISK] * 5
    n.tiers.disk.medium.corrupt(n.tiers.disk.get(hashes[2]).slot, offset=17)
    blocks = n.tiers.promote(hashes).block_ids
    assert len(blocks) == 2  # the two good blocks before it; the bad one is never served
    assert n.tiers.counters["corrupt"] == 1
    assert n.tiers.lower_run(hashes, 2) == []  # it and everything after it are gone
    n.pool.free(blocks)
    n.check()
    n.compute(hashes)  # recomputed: the bytes are right again
    n.check()


def test_a_torn_host_block_is_not_served_to_peers(node):
    hashes = chain(4, 3)
    node.push_down(hashes)
    node.tiers.host.medium.tensor[node.tiers.host.get(hashes[1]).slot, 5] ^= 1
    source = TieredSource(node.pool, node.kv.data_ptr(), BLOCK_BYTES, node.tiers)
    assert source.num_available(hashes) == 3
    got = source.acquire(hashes, 0, 3)
    assert len(got.src_addrs) == 1  # block 0 only: block 1 failed its checksum
    got.release()
    assert source.num_available(hashes) == 1
    node.check()


def test_disk_blocks_are_staged_for_pushes_and_released(disk_node):
    n = disk_node
    hashes = chain(5, 6)
    n.push_down(hashes)
    source = TieredSource(n.pool, n.kv.data_ptr(), BLOCK_BYTES, n.tiers)
    got = source.acquire(hashes, 0, 6)
    assert len(got.src_addrs) == 4  # the staging buffer holds 4 blocks
    staged = n.tiers.staging.tensor
    for i, addr in enumerate(got.src_addrs):
        slot = (addr - staged.data_ptr()) // BLOCK_BYTES
        assert torch.equal(staged[slot].view(torch.float32).view(SHAPE), n.expected(hashes[i]))
    got.release()
    assert sorted(n.tiers._free_staging) == [0, 1, 2, 3]
    n.check()


def test_a_restart_re_adopts_the_disk_tier(tmp_path):
    folder = tmp_path / "disk"
    first = Node(tmp_path, num_blocks=6, host_blocks=0, disk_blocks=16, disk_path=folder)
    hashes = chain(6, 5)
    other = chain(8, 3)
    for blocks in (hashes, other):
        first.compute(blocks)
        first.tiers.demote_now()
    before = sorted(first.tiers.disk.hashes())
    first.close()
    again = Node(tmp_path, num_blocks=6, host_blocks=0, disk_blocks=16, disk_path=folder)
    try:
        assert again.tiers.num_adopted == len(before) == 8
        assert sorted(again.tiers.disk.hashes()) == before
        changes = dict(again.tiers.take_index_changes([]))
        assert changes == {h: DISK for h in before}  # what the node publishes at start
        blocks = again.tiers.promote(hashes).block_ids
        again.truth = first.truth
        for b, h in zip(blocks, hashes):
            assert torch.equal(again.kv[b], again.expected(h))
        again.pool.free(blocks)
        again.check()
    finally:
        again.close()
    # Another layout (a different block size) never adopts the file.
    other_root = TieredCache(BlockPool(4), torch.zeros((4, *SHAPE)),
                             TierConfig(0, 16 * BLOCK_BYTES, str(folder)), root_hash(b"another model"), name="n0")
    assert other_root.num_adopted == 0
    other_root.close()


def test_stored_checksums_go_down_with_a_block_and_come_back_up(tmp_path):
    """Demotion takes a block's stored checksum (computing only those not stored, and keeping them); the tier's
    entry holds it and a push from the tier sends it; promotion leaves the checksum it checked with the block."""
    import zlib

    from kvmesh.kv.block_checksums import BlockChecksums

    n = Node(tmp_path)
    computed = []

    def crc(block_ids):
        computed.extend(block_ids)
        return [zlib.crc32(n.kv[b].numpy()) for b in block_ids]

    n.tiers.checksums = checksums = BlockChecksums(n.pool, crc)
    try:
        hashes = chain(6, 4)
        n.compute(hashes)
        blocks = n.pool.match(hashes)
        checksums.of_cached(blocks[:2])  # what a push of the first two would have left
        assert n.tiers.demote_now() == 4
        assert computed == blocks[:2] and checksums.describe() == {"computed": 2, "reused": 2}
        truth = [zlib.crc32(n.expected(h).numpy()) for h in hashes]
        assert [n.tiers.host.get(h).checksum for h in hashes] == truth
        assert checksums.of_cached(blocks) == truth and computed == blocks[:2]  # the demoter stored the other two
        n.pool.evict(n.pool.num_blocks)
        source = TieredSource(n.pool, n.kv.data_ptr(), BLOCK_BYTES, n.tiers)
        got = source.acquire(hashes, 0, 4)
        assert got.checksums == truth  # a push from the tier sends the tier's
        got.release()
        promoted = n.tiers.promote(hashes).block_ids
        assert checksums.of_cached(promoted) == truth and computed == blocks[:2]
        n.pool.free(promoted)
        n.check()
    finally:
        n.close()


def test_the_demoter_sleeps_until_the_free_queue_moves(tmp_path):
    """The demoter thread looks at the next victims when tier 0's free queue moves, not on a clock: with its
    idle re-look an hour away, freed blocks are still copied down at once, and while nothing moves it stays
    asleep (no look at all, where a poll would look every few milliseconds)."""
    n = Node(tmp_path)
    n.tiers.cfg = replace(n.tiers.cfg, idle_look_s=3600.0, look_gap_s=0.0)
    try:
        n.tiers.start()
        wait_until(lambda: n.tiers.num_looks >= 1, "the demoter's first look")
        hashes = chain(11, 4)
        n.compute(hashes)  # allocates, caches and frees: the queue moves
        wait_until(lambda: n.tiers.lower_run(hashes) == [HOST] * 4, "the freed chain copied to the host tier")
        wait_until(lambda: not n.pool.queue_moved.is_set(), "the demoter's look after the copy")
        looks = n.tiers.num_looks
        time.sleep(0.5)  # a negative check: time for a poll to look many times over
        assert n.tiers.num_looks - looks <= 1, "the demoter looked while the free queue did not move"
        n.check()
    finally:
        n.close()
    assert not n.tiers._thread.is_alive(), "close left the sleeping demoter running"


def wait_until(predicate, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)
