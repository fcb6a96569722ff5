"""BlockPool: the mechanism of a node's KV blocks.

It allocates, counts references, keeps the LRU free queue and the hash records
(the local prefix cache: a ``BlockIndex`` holds which hash each block has, the
chain links and hash -> block, natively where it can), and nothing else:
eviction order is an EvictionPolicy, admission and scheduling live in the engine.

Every block is in exactly one of three states::

    used    ref_count > 0 or pinned        not in the free queue
    cached  free, holds a block hash       in the free queue, matchable
    free    free, no hash                  in the free queue

A freed block keeps its hash and stays matchable until allocation takes it
from the head of the free queue. Per-block records are parallel lists and the
index's int32 arrays (not objects) to keep memory per block small. All public
methods take a lock, so the transfer layer may pin from its own thread.

Matching is a binary search over the chain (cached blocks of a chain always form
a prefix of it), then the block ids: a chain's blocks are exactly its last
block's ancestors. They come from a bounded memo of whole chains, keyed by their
last block (filled by inserts that extend a known chain and by matches; a
block's memo entry dies with its hash), else from the index's walk up the
parent links: matching a long prompt costs a few lookups and one list copy.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import NamedTuple

from kvmesh.errors import OutOfBlocksError
from kvmesh.kv.block_hash import BlockHash
from kvmesh.kv.block_index import ADDED, NO_BLOCK, make_block_index
from kvmesh.kv.eviction import EvictionPolicy, TailFirstLRU
from kvmesh.kv.prefix_cache import MatchStats, PrefixMatch

__all__ = ["NO_BLOCK", "BlockPool", "PoolUsage"]


class PoolUsage(NamedTuple):
    num_used: int
    num_cached: int
    num_free: int  # free and holding no hash


class BlockPool:
    def __init__(self, num_blocks: int, policy: EvictionPolicy | None = None, track_changes: bool = False,
                 max_memo_chains: int = 1024):
        """``track_changes``: log cached / evicted hashes for ``take_cached`` / ``take_evicted``
        (nodes that publish to the global index drain them; a lone engine leaves it off)."""
        if num_blocks < 1:
            raise ValueError("a block pool needs at least one block")
        self.num_blocks = num_blocks
        self.policy = policy or TailFirstLRU()
        self._lock = threading.RLock()
        self._cached_cond = threading.Condition(self._lock)  # notified when blocks become matchable
        self._generation = 0  # bumped with every notification, so a waiter never misses one
        self._ref = [0] * num_blocks
        self._pins = [0] * num_blocks
        # Which hash each block holds, the chains and hash -> block: the index's (kvmesh.kv.block_index),
        # with its per-block int32 arrays read here directly.
        self._index = make_block_index(num_blocks)
        self._slot = self._index.slot_of_block  # >= 0 while the block holds a hash
        self._parent = self._index.parents  # cached block holding the previous hash of the chain
        self._num_children = self._index.num_children  # cached blocks whose parent this is
        # last block of a chain -> the chain's block ids from its root block (see the module docstring)
        self._chains: OrderedDict[int, list[int]] = OrderedDict()
        self._max_memo_chains = max_memo_chains
        self._num_lookups = self._num_hits = self._num_matched_blocks = 0  # match_prefix's counters
        self.num_evicted = 0  # cached blocks that lost their hash (allocation or evict), ever
        self._last_evicted_ids: list[int] | None = None  # collects evict()'s victims for evict_blocks
        self.track_changes = track_changes
        self._evicted: list[BlockHash] = []
        self._newly_cached: list[BlockHash] = []
        self._epoch = [0] * num_blocks  # bumped each time a block is allocated (its bytes may change after)
        # Every block id the pool hands out is one of these int objects (the queue links are built from
        # them), so the equality test that spots a run of consecutive ids is an identity check per id.
        self._ids = self._index.block_ids  # list(range(num_blocks)), shared with the index's chain slices
        # Free queue: a doubly linked list through _prev/_next, sentinel at index num_blocks.
        sentinel = num_blocks
        self._next = self._ids[1:] + [sentinel, 0]
        self._prev = [sentinel] + self._ids
        self._num_queued = num_blocks
        # Called under the lock with (hash, parent hash or None) whenever a block loses its hash: the
        # lower KV tiers (kvmesh.kv.tiers) keep their chains whole with it. Must not call back into the pool.
        self.on_uncache: Callable[[BlockHash, BlockHash | None], None] | None = None

    @property
    def lock(self) -> threading.RLock:
        """The pool's re-entrant lock: hold it to make several calls one atomic operation."""
        return self._lock

    # ---- queries (no side effects) ----------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks allocation may take: free plus cached."""
        return self._num_queued

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self._num_queued

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    def block_hash(self, block_id: int) -> BlockHash | None:
        with self._lock:
            return self._index.hash_of(block_id)

    def cached_block(self, block_hash: BlockHash) -> int | None:
        with self._lock:
            return self._index.get(block_hash)

    def block_epoch(self, block_id: int) -> int:
        """How many times ``block_id`` was allocated: a cached block's bytes are immutable while this holds."""
        return self._epoch[block_id]

    def cached_free_blocks(self, max_blocks: int) -> list[tuple[int, BlockHash, BlockHash | None, int]]:
        """Cached blocks among the next ``max_blocks`` of the free queue (the next victims, soonest first), as
        (block id, hash, parent hash or None, epoch); for copying them out before they are evicted."""
        with self._lock:
            out, sentinel, scanned = [], self.num_blocks, 0
            block = self._next[sentinel]
            while block != sentinel and scanned < max_blocks:
                scanned += 1
                if self._slot[block] >= 0:
                    parent, hash_of = self._parent[block], self._index.hash_of
                    out.append((block, hash_of(block), hash_of(parent) if parent != NO_BLOCK else None,
                                self._epoch[block]))
                block = self._next[block]
            return out

    def match(self, block_hashes: Sequence[BlockHash]) -> list[int]:
        """Block ids of the longest cached prefix of ``block_hashes`` (takes no reference; updates the memo).

        No cached block is ever an orphaned tail, so the cached blocks of a chain
        form a prefix of it and the match length is a binary search.
        """
        with self._lock:
            return self._match(block_hashes)

    def _match(self, block_hashes: Sequence[BlockHash]) -> list[int]:
        get = self._index.get
        n = len(block_hashes)
        if n == 0 or get(block_hashes[0]) is None:
            return []
        if get(block_hashes[-1]) is not None:
            length = n
        else:
            lo, hi = 0, n - 1  # block_hashes[lo] cached, block_hashes[hi] not
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if get(block_hashes[mid]) is not None:
                    lo = mid
                else:
                    hi = mid
            length = lo + 1
        last = get(block_hashes[length - 1])
        chain = self._chains.get(last)
        if chain is not None and len(chain) >= length:
            self._chains.move_to_end(last)
            return chain[len(chain) - length:]  # a chain's blocks are exactly its last block's ancestors
        found = self._index.chain(last, length)
        if self._parent[found[0]] == NO_BLOCK:  # a whole chain: remember it
            self._remember_chain(found.copy())
        return found

    # ---- the PrefixCache contract (kvmesh.kv.prefix_cache) ------------------------------------
    @property
    def capacity(self) -> int:
        return self.num_blocks

    def match_prefix(self, block_hashes: Sequence[BlockHash]) -> PrefixMatch:
        """``match``, counted in ``match_stats``, with the number of blocks left to compute."""
        found = self.match(block_hashes)
        with self._lock:
            self._num_lookups += 1
            self._num_hits += bool(found)
            self._num_matched_blocks += len(found)
        return PrefixMatch(found, len(block_hashes) - len(found))

    def insert(self, block_ids: Sequence[int], block_hashes: Sequence[BlockHash], parent_block_id: int = NO_BLOCK,
               pin: bool = False) -> list[int]:
        """``cache_blocks`` (existing holders win), then pin the holders when asked."""
        with self._lock:
            holders = self.cache_blocks(block_ids, block_hashes, parent_block_id)
            if pin:
                self.pin(holders)
            return holders

    def evict_blocks(self, num_blocks: int) -> list[int]:
        """``evict``, returning the ids of the blocks that lost their hashes."""
        with self._lock:
            self._last_evicted_ids = []
            self.evict(num_blocks)
            out, self._last_evicted_ids = self._last_evicted_ids, None
            return out

    def match_stats(self, block_size: int) -> MatchStats:
        return MatchStats(self._num_lookups, self._num_hits, self._num_matched_blocks, block_size)

    def num_pinned(self) -> int:
        """Blocks pinned right now (a holder mid-push, a pinned system prompt)."""
        return sum(1 for p in self._pins if p)

    def num_free_among(self, block_ids: Sequence[int]) -> int:
        """How many of ``block_ids`` sit in the free queue (touching them would take them out)."""
        ref, pins = self._ref, self._pins
        return sum(1 for b in block_ids if ref[b] == 0 and pins[b] == 0)

    def usage(self) -> PoolUsage:
        slots = self._slot
        num_cached = sum(1 for b in range(self.num_blocks) if slots[b] >= 0 and self._is_queued(b))
        return PoolUsage(self.num_blocks - self._num_queued, num_cached, self._num_queued - num_cached)

    # ---- references ------------------------------------------------------------------------
    def allocate(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` blocks (ref count 1) from the head of the free queue, in ascending id order.

        A cached block taken loses its hash (its digest goes to ``take_evicted``).
        The caller owns the references and gives them back with ``free``. Sorted, the blocks of a
        request freed tail first come back as one run of consecutive ids: one transfer descriptor
        (block-major buffer) and one slice write when they are cached.
        """
        with self._lock:
            if num_blocks > self._num_queued:
                raise OutOfBlocksError(f"asked for {num_blocks} blocks, {self._num_queued} free of {self.num_blocks}")
            out = []
            for _ in range(num_blocks):
                block = self._pop_evictable()
                self._uncache(block)
                self._ref[block] = 1
                self._epoch[block] += 1
                out.append(block)
            out.sort()
            return out

    def touch(self, block_ids: Sequence[int]) -> None:
        """Take one more reference on each block (prefix hits); free ones leave the queue."""
        with self._lock:
            ref, pins = self._ref, self._pins
            for b in block_ids:
                if ref[b] == 0 and pins[b] == 0:
                    self._unlink(b)
                ref[b] += 1

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference on each block; blocks reaching zero join the free queue in policy order."""
        with self._lock:
            ref, pins = self._ref, self._pins
            for b in self.policy.order_for_free(block_ids):
                if ref[b] <= 0:
                    raise ValueError(f"block {b} freed with ref count {ref[b]}")
                ref[b] -= 1
                if ref[b] == 0 and pins[b] == 0:
                    self._append(b)

    def pin(self, block_ids: Sequence[int]) -> None:
        """Keep blocks (a system prompt) out of eviction until ``unpin``."""
        with self._lock:
            for b in block_ids:
                if self._ref[b] == 0 and self._pins[b] == 0:
                    self._unlink(b)
                self._pins[b] += 1

    def unpin(self, block_ids: Sequence[int]) -> None:
        with self._lock:
            for b in reversed(block_ids):
                if self._pins[b] <= 0:
                    raise ValueError(f"block {b} is not pinned")
                self._pins[b] -= 1
                if self._ref[b] == 0 and self._pins[b] == 0:
                    self._append(b)

    # ---- the prefix cache --------------------------------------------------------------------
    def cache_block(self, block_id: int, block_hash: BlockHash, parent_block_id: int = NO_BLOCK) -> int:
        """Make a full, computed block matchable under ``block_hash``; returns the block holding it.

        If another block already holds the hash, nothing changes and that block's id
        is returned: the caller should switch to it (same KV) and free its own copy,
        so every hash lives in one block and chains stay single.
        """
        with self._lock:
            holder = self._cache_one(block_id, block_hash, parent_block_id)
            self._notify()
            return holder

    def cache_blocks(self, block_ids: Sequence[int], block_hashes: Sequence[BlockHash],
                     parent_block_id: int = NO_BLOCK) -> list[int]:
        """``cache_block`` for a run of consecutive chain blocks under one lock; returns the holders.

        Each block's parent is the holder of the previous hash (``parent_block_id`` for the first).
        """
        with self._lock:
            holders = None
            if block_ids and len(block_ids) == len(block_hashes):
                holders = self._cache_new_run(block_ids, block_hashes, parent_block_id)
            if holders is None:
                holders = []
                parent, cache_one = parent_block_id, self._cache_one
                for block, h in zip(block_ids, block_hashes):
                    parent = cache_one(block, h, parent)
                    holders.append(parent)
            if holders:
                if parent_block_id == NO_BLOCK:
                    self._remember_chain(list(holders))
                elif parent_block_id in self._chains:  # the chain grows: its memo moves to the new last block
                    chain = self._chains.pop(parent_block_id)
                    chain.extend(holders)
                    self._remember_chain(chain)
            self._notify()
            return holders

    def cache_and_dedupe(self, block_ids: Sequence[int], block_hashes: Sequence[BlockHash],
                         parent_block_id: int = NO_BLOCK) -> list[int]:
        """``cache_blocks``, then adopt existing copies: returns the block ids the caller now references.

        Where another block already held a hash, the caller's reference moves to that block
        and its own copy is freed, so every hash lives in one block.
        """
        with self._lock:
            holders = self.cache_blocks(block_ids, block_hashes, parent_block_id)
            duplicates = [(own, h) for own, h in zip(block_ids, holders) if own != h]
            if duplicates:
                self.touch([h for _, h in duplicates])
                self.free([own for own, _ in duplicates])
            return holders

    def match_and_pin(self, block_hashes: Sequence[BlockHash], skip: int = 0) -> list[int]:
        """Atomically match the cached prefix of ``block_hashes`` and pin its blocks from index ``skip`` on.

        Returns the pinned block ids (``unpin`` them when done). Used by a holder that
        pushes blocks: pinned blocks cannot be evicted while their bytes are in flight.
        """
        with self._lock:
            found = self.match(block_hashes)[skip:]
            self.pin(found)
            return found

    def match_and_touch(self, block_hashes: Sequence[BlockHash]) -> list[int]:
        """Atomically match the cached prefix of ``block_hashes`` and take a reference on each block.

        The caller owns the references (``free`` them). Without the lock between match and
        touch, another thread's ``allocate`` could take a matched block and reuse it.
        """
        with self._lock:
            found = self.match(block_hashes)
            self.touch(found)
            return found

    def hold_if_cached(self, block_ids: Sequence[int], block_hashes: Sequence[BlockHash]) -> int:
        """Touch the leading ``block_ids`` that still hold ``block_hashes``, atomically; returns how many.

        For callers that matched earlier without a reference (the engine's admission):
        whatever was reallocated in between is not adopted.
        """
        with self._lock:
            num = self._index.count_held(block_ids, block_hashes)
            self.touch(block_ids[:num])
            return num

    def notify_change(self) -> None:
        """Wake ``wait_for_change`` callers (holders waiting for new work use the same wait)."""
        with self._lock:
            self._notify()

    def wait_for_change(self, seen_generation: int, timeout_s: float) -> int:
        """Block until the change counter (bumped when blocks become matchable or on ``notify_change``)
        differs from ``seen_generation``, or ``timeout_s`` passes; returns the counter."""
        with self._cached_cond:
            self._cached_cond.wait_for(lambda: self._generation != seen_generation, timeout_s)
            return self._generation

    def _notify(self) -> None:
        self._generation += 1
        self._cached_cond.notify_all()

    def evict(self, num_blocks: int) -> int:
        """Drop the hashes of up to ``num_blocks`` cached free blocks, LRU first; returns how many.

        Only leaves of the cached chains go (a parent once its children are gone);
        the blocks stay free for allocation.
        """
        with self._lock:
            sentinel, evicted, progress = self.num_blocks, 0, True
            while evicted < num_blocks and progress:  # another pass only if a parent became a leaf
                progress = False
                block = self._next[sentinel]
                while evicted < num_blocks and block != sentinel:
                    if self._slot[block] >= 0 and self._num_children[block] == 0:
                        self._uncache(block)
                        evicted += 1
                        if self._last_evicted_ids is not None:
                            self._last_evicted_ids.append(block)
                        progress = True
                    block = self._next[block]
            return evicted

    def take_evicted(self) -> list[BlockHash]:
        """Hashes evicted since the last call (for unpublishing from the global index)."""
        with self._lock:
            out, self._evicted = self._evicted, []
            return out

    def take_cached(self) -> list[BlockHash]:
        """Hashes made matchable since the last call (for publishing to the global index)."""
        with self._lock:
            out, self._newly_cached = self._newly_cached, []
            return out

    # ---- internals -----------------------------------------------------------------------------
    def _cache_new_run(self, block_ids: Sequence[int], block_hashes: Sequence[BlockHash], parent_block_id: int
                       ) -> list[int] | None:
        """``cache_blocks`` where no hash is cached yet and no block holds one: the index records the run
        in one call. None (nothing done) otherwise."""
        block_ids = list(block_ids)
        first, n = block_ids[0], len(block_ids)
        # a run (sorted fresh allocations): no id array to build; the span test first, gaps fail it at once
        consecutive = block_ids[-1] - first == n - 1 and block_ids == self._ids[first : first + n]
        if self._index.add_run(block_hashes, block_ids, consecutive, parent_block_id) != ADDED:
            return None  # a hash is cached, or a block holds one: block by block decides (holder or error)
        if self.track_changes:
            self._newly_cached.extend(block_hashes)
        return block_ids

    def _remember_chain(self, chain: list[int]) -> None:
        """Memoise ``chain`` (a list nobody else holds: it may be extended in place later)."""
        chains = self._chains
        chains[chain[-1]] = chain
        chains.move_to_end(chain[-1])
        if len(chains) > self._max_memo_chains:
            chains.popitem(last=False)

    def _cache_one(self, block_id: int, block_hash: BlockHash, parent_block_id: int) -> int:
        holder = self._index.get(block_hash)
        if holder is not None:
            return holder
        if self._index.add_run((block_hash,), (block_id,), True, parent_block_id) != ADDED:
            raise ValueError(f"block {block_id} already holds a hash")
        if self.track_changes:
            self._newly_cached.append(block_hash)
        return block_id

    def _is_queued(self, block: int) -> bool:
        return self._ref[block] == 0 and self._pins[block] == 0

    def _unlink(self, block: int) -> None:
        prev, nxt = self._prev[block], self._next[block]
        self._next[prev] = nxt
        self._prev[nxt] = prev
        self._num_queued -= 1

    def _append(self, block: int) -> None:
        sentinel = self.num_blocks
        tail = self._prev[sentinel]
        self._next[tail] = block
        self._prev[block] = tail
        self._next[block] = sentinel
        self._prev[sentinel] = block
        self._num_queued += 1

    def _pop_evictable(self) -> int:
        """The least recently used free block that is no cached block's parent."""
        block = self._next[self.num_blocks]
        while self._num_children[block] > 0:
            block = self._next[block]
        self._unlink(block)
        return block

    def _uncache(self, block: int) -> None:
        if self._slot[block] < 0:
            return
        self.num_evicted += 1
        h, parent = self._index.remove_block(block)
        self._chains.pop(block, None)
        if self.on_uncache is not None:
            self.on_uncache(h, self._index.hash_of(parent) if parent != NO_BLOCK else None)
        if self.track_changes:
            self._evicted.append(h)

    def check_integrity(self) -> None:
        """Raise AssertionError unless every invariant holds."""
        with self._lock:
            n = self.num_blocks
            queued, block, steps = set(), self._next[n], 0
            while block != n:
                assert block not in queued, f"block {block} twice in the free queue"
                assert self._next[self._prev[block]] == block, "broken free-queue links"
                queued.add(block)
                block, steps = self._next[block], steps + 1
                assert steps <= n, "free queue has a cycle"
            assert len(queued) == self._num_queued, "queue length != counter"
            for b in range(n):
                assert self._ref[b] >= 0 and self._pins[b] >= 0, f"block {b}: negative count"
                assert (b in queued) == self._is_queued(b), f"block {b}: queue membership != ref/pin state"
            used, cached, free = self.usage()
            assert used + cached + free == n, "used + cached + free != total"
            self._index.check_integrity()
            hash_of = self._index.hash_of
            children = [0] * n
            for h, b in self._index.items():
                assert hash_of(b) == h, f"hash map points at block {b} which holds another hash"
                parent = self._parent[b]
                if parent != NO_BLOCK:
                    assert self._slot[parent] >= 0, f"block {b} is an orphaned tail (parent {parent} evicted)"
                    children[parent] += 1
            assert sum(s >= 0 for s in self._slot) == len(self._index), "stray block hash"
            assert children == self._num_children.tolist(), "child counts drifted"
            for last, chain in self._chains.items():
                assert chain[-1] == last and self._slot[last] >= 0, f"memo of chain ending at {last} is stale"
                assert self._parent[chain[0]] == NO_BLOCK, "a memo chain does not start at a root block"
                assert all(self._parent[b] == a for a, b in zip(chain, chain[1:])), "a memo chain is not a chain"
