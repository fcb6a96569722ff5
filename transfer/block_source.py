"""Where a holder's pushes read blocks from: its compute buffer, then its lower KV tiers.

    PoolSource     tier 0 only: the cached prefix, pinned in the BlockPool while it is written
    TieredSource   tier 0 first; past its cached prefix, blocks held in host memory (sent in
                   place) or on disk (read into a registered staging buffer first)

``acquire`` returns ``SendBlocks``: the source addresses of the next blocks of a chain
(one kind of memory per call) and a ``release`` the holder calls once the write ended.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from kvmesh.kv.block_hash import BlockHash
from kvmesh.kv.block_pool import BlockPool
from kvmesh.kv.tiers.tiered_cache import SendBlocks


class BlockSource(Protocol):
    def num_available(self, block_hashes: Sequence[BlockHash]) -> int:
        """How many leading blocks of the chain this node can send now (no side effects)."""

    def acquire(self, block_hashes: Sequence[BlockHash], skip: int, max_blocks: int) -> SendBlocks:
        """Hold up to ``max_blocks`` blocks from index ``skip`` for reading ([] when none is here)."""


class PoolSource:
    def __init__(self, pool: BlockPool, base_addr: int, block_bytes: int,
                 stage_out: Callable[[list[int]], None] | None = None):
        """``stage_out``: copies pinned blocks into the registered memory first (a device buffer's host mirror)."""
        self.pool, self.base_addr, self.block_bytes = pool, base_addr, block_bytes
        self.stage_out = stage_out

    def num_available(self, block_hashes: Sequence[BlockHash]) -> int:
        return len(self.pool.match(block_hashes))

    def acquire(self, block_hashes: Sequence[BlockHash], skip: int, max_blocks: int) -> SendBlocks:
        pinned = self.pool.match(block_hashes[:skip + max_blocks], hold="pin", skip=skip)
        if pinned and self.stage_out is not None:
            try:
                self.stage_out(pinned)
            except BaseException:
                self.pool.unpin(pinned)
                raise
        return SendBlocks([self.base_addr + b * self.block_bytes for b in pinned],
                          lambda: self.pool.unpin(pinned) if pinned else None)


class TieredSource(PoolSource):
    def __init__(self, pool: BlockPool, base_addr: int, block_bytes: int, tiers,
                 stage_out: Callable[[list[int]], None] | None = None):
        """``tiers``: the node's ``kvmesh.kv.tiers.tiered_cache.TieredCache``."""
        super().__init__(pool, base_addr, block_bytes, stage_out)
        self.tiers = tiers

    def num_available(self, block_hashes: Sequence[BlockHash]) -> int:
        in_pool = len(self.pool.match(block_hashes))
        return in_pool + len(self.tiers.lower_run(block_hashes, in_pool))

    def acquire(self, block_hashes: Sequence[BlockHash], skip: int, max_blocks: int) -> SendBlocks:
        acquired = super().acquire(block_hashes, skip, max_blocks)
        if acquired.src_addrs:
            return acquired
        return self.tiers.send_blocks(block_hashes[skip:], max_blocks)
