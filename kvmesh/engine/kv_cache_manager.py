"""KVCacheManager: a request's view of the block pool (prefix hits, slots, caching full blocks).

Ties a Sequence's tokens to its blocks:

    tokens   [0 ........................ num_computed ............ num_tokens)
    blocks   | cached (hashed, shared) | private, computed | to compute  |
             0 .......... num_cached_blocks

Hits are limited to ``(num_tokens - 1) // block_size`` blocks, so at least the last
token is always computed (its logits give the next token) and a shared block is
never written. Full blocks are registered in the pool once computed.
"""
from __future__ import annotations

from collections.abc import Sequence as Seq

from kvmesh.engine.sequence import Sequence
from kvmesh.kv.block_hash import BlockHash, hash_blocks, salted_root
from kvmesh.kv.block_pool import NO_BLOCK, BlockPool
from kvmesh.kv.cache_stats import PrefixCacheStats
from kvmesh.kv.prefix_hasher import PrefixHasher


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int, root_hash: BlockHash, enable_prefix_caching: bool = True):
        self.pool = pool
        self.block_size = block_size
        self.root_hash = root_hash
        self.enable_prefix_caching = enable_prefix_caching
        self.stats = PrefixCacheStats()
        self._evictions_base = pool.num_evicted
        self.hasher = PrefixHasher(block_size)  # prompts that repeat a recent prefix are compared, not rehashed

    def reset_stats(self) -> None:
        """Counters from zero (a node after its start-up probe)."""
        self.stats = PrefixCacheStats()
        self._evictions_base = self.pool.num_evicted

    def stats_dict(self) -> dict[str, float]:
        """The prefix-cache counters, evictions as the pool counted them since the last reset."""
        self.stats.evictions = self.pool.num_evicted - self._evictions_base
        return self.stats.as_dict()

    def hash_prompt(self, token_ids: list[int], cache_salt: str | None = None) -> list[BlockHash]:
        """The block hashes of every full block of a prompt (from the namespace root, salted by the request's
        ``cache_salt``)."""
        return self.hasher.hash(salted_root(self.root_hash, cache_salt), token_ids)

    def update_hashes(self, seq: Sequence) -> None:
        """Extend ``seq.block_hashes`` to every full block of its tokens (prompt and output)."""
        num_full = seq.num_tokens // self.block_size
        have = len(seq.block_hashes)
        if num_full <= have:
            return
        tokens = seq.token_ids(have * self.block_size, num_full * self.block_size)
        seq.block_hashes.extend(hash_blocks(seq.block_hashes[-1], tokens, self.block_size) if have
                                else self.hash_prompt(tokens, seq.params.cache_salt))

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids of the longest usable cached prefix (no reference taken); fills ``seq.block_hashes``."""
        self.update_hashes(seq)  # callers use the hashes even with matching off (transfers by hash)
        if not self.enable_prefix_caching:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        return self.pool.match(seq.block_hashes[:max_blocks])

    def allocate(self, seq: Sequence, num_tokens: int, cached_block_ids: Seq[int] = ()) -> bool:
        """Make ``seq``'s blocks cover ``num_tokens`` tokens, first adopting ``cached_block_ids``.

        Returns False, changing nothing, when the pool cannot supply the blocks.
        """
        if not cached_block_ids and -(-num_tokens // self.block_size) <= len(seq.block_ids):
            return True  # most decode steps: the new token fits the last block
        first = len(seq.block_ids)
        need = max(0, -(-num_tokens // self.block_size) - first - len(cached_block_ids))
        # One atomic pool call (other threads allocate too); None: no room, or a cached block was reallocated
        # since the match (retried next step).
        got = self.pool.allocate_after(cached_block_ids, seq.block_hashes[first:first + len(cached_block_ids)], need)
        if got is None:
            return False
        seq.block_ids.extend(got)
        if cached_block_ids:
            seq.num_cached_blocks = first + len(cached_block_ids)
        return True

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks ``seq`` has completely computed; switch to an existing copy if one exists.

        Done even with prefix caching off: hashes also name blocks for transfers between
        nodes. "Off" means no request is ever matched against them (``find_cached_prefix``).
        """
        num_full = seq.num_computed_tokens // self.block_size
        if num_full <= seq.num_cached_blocks:
            return
        self.update_hashes(seq)
        start = seq.num_cached_blocks
        own = seq.block_ids[start:num_full]
        holders = self.pool.cache(own, seq.block_hashes[start:num_full],
                                             seq.block_ids[start - 1] if start else NO_BLOCK)
        if holders != own:  # some tokens were computed twice: one copy of each block is kept
            seq.block_ids[start:num_full] = holders
        seq.num_cached_blocks = num_full

    def replace_blocks(self, seq: Sequence, block_ids: Seq[int]) -> None:
        """Swap these private, uncached blocks of ``seq`` for fresh ones (a stalled writer may still write them).

        ``seq``'s references on the old blocks are dropped; whoever fenced them keeps its own.
        Raises OutOfBlocksError, changing nothing, when the pool has no room.
        """
        old = [b for b in block_ids if b in seq.block_ids]
        fresh = self.pool.allocate(len(old))
        mapping = dict(zip(old, fresh))
        seq.block_ids = [mapping.get(b, b) for b in seq.block_ids]
        self.pool.free(old)

    def release_from(self, seq: Sequence, index: int) -> None:
        """Give back ``seq``'s blocks from ``index`` on (uncached, not yet computed); the scheduler allocates
        them again when it computes those tokens, waiting for room like any request the pool cannot hold yet."""
        if index < seq.num_cached_blocks:
            raise ValueError(f"block {index} of {seq.request_id} is cached: only uncomputed blocks can go back")
        self.pool.free(seq.block_ids[index:])
        del seq.block_ids[index:]

    def free(self, seq: Sequence) -> None:
        """Give back every block of ``seq``; cached ones stay matchable until reused."""
        self.pool.free(seq.block_ids)
        seq.block_ids = []
        seq.num_cached_blocks = 0
