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
last block and its epoch then (filled by inserts that extend a known chain and
by matches; an entry is stale once its block is allocated again, and `evict`
trims the chains whose last block it takes), else from the index's walk up the
parent links: matching a long prompt costs a few lookups and one list copy.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Literal, NamedTuple

from kvmesh.errors import OutOfBlocksError
from kvmesh.kv.block_hash import BlockHash
from kvmesh.kv.block_index import ADDED, NO_BLOCK, NOT_HELD, RemovedBlocks, make_block_index
from kvmesh.kv.eviction import EvictionPolicy, TailFirstLRU

__all__ = ["NO_BLOCK", "BlockPool", "BlockState", "PoolChanges", "PoolUsage", "Victim"]

Hold = Literal["ref", "pin"] | None


class PoolUsage(NamedTuple):
    num_used: int
    num_cached: int
    num_free: int  # free and holding no hash
    num_pinned: int  # among the used: pinned right now (a holder mid-push, a pinned system prompt)


class BlockState(NamedTuple):
    ref_count: int
    num_pins: int
    block_hash: BlockHash | None  # None while the block holds no hash
    epoch: int  # times the block was allocated: a cached block's bytes are immutable while this holds


class Victim(NamedTuple):
    """A cached free block allocation will take soon (``next_victims``)."""
    block_id: int
    block_hash: BlockHash
    parent_hash: BlockHash | None
    epoch: int


class PoolChanges(NamedTuple):
    """Hashes that became matchable and hashes that were dropped since the last ``take_changes``."""
    cached: list[BlockHash]
    evicted: list[BlockHash]


class BlockPool:
    """Public verbs: queries ``match`` (which may also reference or pin what it finds), ``cached_block``,
    ``cached_or_reported``, ``block_state``, ``epochs``, ``next_victims``, ``usage``; references ``allocate``/
    ``free``, ``allocate_after``, ``touch``, ``unpin``; the prefix cache ``cache``, ``evict``, ``take_changes``;
    and ``check_integrity``. Each is atomic under the pool's own lock, which no caller sees."""

    def __init__(self, num_blocks: int, policy: EvictionPolicy | None = None, track_changes: bool = False,
                 max_memo_chains: int = 1024):
        """``track_changes``: log cached / evicted hashes for ``take_changes`` (nodes that publish to the
        global index drain them; a lone engine leaves it off)."""
        if num_blocks < 1:
            raise ValueError("a block pool needs at least one block")
        self.num_blocks = num_blocks
        self.policy = policy or TailFirstLRU()
        self._lock = threading.RLock()
        self._ref = [0] * num_blocks
        self._pins = [0] * num_blocks
        # Which hash each block holds, the chains and hash -> block: the index's (kvmesh.kv.block_index),
        # with its per-block int32 arrays read here directly.
        self._index = make_block_index(num_blocks)
        self._slot = self._index.slot_of_block  # >= 0 while the block holds a hash
        self._parent = self._index.parents  # cached block holding the previous hash of the chain
        self._num_children = self._index.num_children  # cached blocks whose parent this is
        # last block of a chain -> (its epoch then, the chain's block ids from its root block): see the module
        # docstring. Allocation bumps the epoch, so it drops no memo; explicit evictions trim theirs.
        self._chains: OrderedDict[int, tuple[int, list[int]]] = OrderedDict()
        self._max_memo_chains = max_memo_chains
        self.num_evicted = 0  # cached blocks that lost their hash (allocation or evict), ever
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
        self._num_cached_queued = 0  # of the queued blocks, those holding a hash (``usage`` in O(1))
        self._num_pinned = 0  # blocks with a pin
        # Set whenever the free queue moves (blocks join it, leave it, allocation takes its head): what a lower
        # tier's demoter waits on between looks at ``next_victims``, instead of polling. An event set under the
        # lock (no code of another object runs); its waiter clears it before it looks.
        self.queue_moved = threading.Event()
        # Told (hash, parent hash or None) whenever a block lost its hash: the lower KV tiers (kvmesh.kv.tiers)
        # keep their chains whole with it. Called after the pool's lock is released, by the thread whose call
        # uncached the blocks (it may call the pool), in the order the blocks were uncached.
        self.on_uncache: Callable[[BlockHash, BlockHash | None], None] | None = None
        self._uncached: list[tuple[BlockHash, BlockHash | None]] = []  # for on_uncache, once the lock is let go
        self._delivering: list[list[tuple[BlockHash, BlockHash | None]]] = []  # taken, on_uncache not done yet

    @property
    def num_free_blocks(self) -> int:
        """Blocks allocation may take: free plus cached."""
        return self._num_queued

    # ---- queries (no side effects but the match memo) ------------------------------------------
    def match(self, block_hashes: Sequence[BlockHash], hold: Hold = None, skip: int = 0) -> list[int]:
        """Block ids of the longest cached prefix of ``block_hashes``, from block ``skip`` on.

        ``hold=None`` takes nothing: the ids may be reallocated once the caller lets go of the
        lock. ``hold="ref"`` takes a reference on each (the caller ``free``s them), ``hold="pin"``
        pins them (the caller ``unpin``s them: a holder whose bytes are in flight); both atomically
        with the match, so no concurrent allocation can take a matched block. No cached block is
        ever an orphaned tail, so a chain's cached blocks form a prefix and the length is a binary search.
        """
        with self._lock:
            found = self._match(block_hashes)
            if skip:
                found = found[skip:]
            if hold == "ref":
                self.touch(found)
            elif hold == "pin":
                self._pin(found)
            elif hold is not None:
                raise ValueError(f"hold must be None, 'ref' or 'pin', not {hold!r}")
            return found

    def cached_block(self, block_hash: BlockHash) -> int | None:
        """The block holding ``block_hash``, or None."""
        with self._lock:
            return self._index.get(block_hash)

    def block_state(self, block_id: int) -> BlockState:
        with self._lock:
            return BlockState(self._ref[block_id], self._pins[block_id], self._index.hash_of(block_id),
                              self._epoch[block_id])

    def epochs(self, block_ids: Sequence[int]) -> list[int]:
        """Each block's epoch (``BlockState.epoch``), in one hold of the lock."""
        with self._lock:
            epoch = self._epoch
            return [epoch[b] for b in block_ids]

    def next_victims(self, max_blocks: int) -> list[Victim]:
        """Cached blocks among the next ``max_blocks`` of the free queue, soonest first: for copying them
        out (to a lower tier) before allocation takes them."""
        with self._lock:
            out, sentinel, scanned = [], self.num_blocks, 0
            block = self._next[sentinel]
            while block != sentinel and scanned < max_blocks:
                scanned += 1
                if self._slot[block] >= 0:
                    parent, hash_of = self._parent[block], self._index.hash_of
                    out.append(Victim(block, hash_of(block), hash_of(parent) if parent != NO_BLOCK else None,
                                      self._epoch[block]))
                block = self._next[block]
            return out

    def usage(self) -> PoolUsage:
        """Used, cached (free and matchable), free and pinned blocks, from counters kept as blocks move: O(1) under
        the lock (the stats thread calls it; a scan of every block held the lock for the whole pool)."""
        with self._lock:
            num_cached = self._num_cached_queued
            return PoolUsage(self.num_blocks - self._num_queued, num_cached, self._num_queued - num_cached,
                             self._num_pinned)

    def _can_allocate(self, num_blocks: int, reusing: Sequence[int] = ()) -> bool:
        """Whether ``num_blocks`` fresh blocks can be allocated after ``touch(reusing)`` (cached blocks a
        request adopts leave the free queue if they sit in it)."""
        ref, pins = self._ref, self._pins
        return num_blocks <= self._num_queued - sum(1 for b in reusing if ref[b] == 0 and pins[b] == 0)

    # ---- references ------------------------------------------------------------------------
    def allocate(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` blocks (ref count 1) from the head of the free queue, in ascending id order.

        A cached block taken loses its hash (its digest goes to ``take_changes``).
        The caller owns the references and gives them back with ``free``. Sorted, the blocks of a
        request freed tail first come back as one run of consecutive ids: one transfer descriptor
        (block-major buffer) and one slice write when they are cached.
        """
        with self._lock:
            out = self._allocate(num_blocks)
        self._deliver_uncached()
        return out

    def allocate_after(self, cached_block_ids: Sequence[int], cached_hashes: Sequence[BlockHash],
                       num_blocks: int) -> list[int] | None:
        """Atomically: a reference on each of ``cached_block_ids`` (matched earlier without one) if each still
        holds its hash of ``cached_hashes``, then ``num_blocks`` fresh blocks; returns the cached ids followed by
        the fresh ones. None, changing nothing, when a cached block was reallocated meanwhile or the pool cannot
        supply the fresh ones (the cached ones count as supply while free). The caller ``free``s them all."""
        with self._lock:
            if not self._can_allocate(num_blocks, reusing=cached_block_ids):
                return None
            held = self._hold_if_cached(cached_block_ids, cached_hashes)
            if held < len(cached_block_ids):
                self.free(cached_block_ids[:held])
                return None
            out = [*cached_block_ids, *(self._allocate(num_blocks) if num_blocks > 0 else [])]
        self._deliver_uncached()
        return out

    def _allocate(self, num_blocks: int) -> list[int]:
        """``allocate`` under the lock (its uncached hashes wait for ``_deliver_uncached``)."""
        if num_blocks > self._num_queued:
            raise OutOfBlocksError(f"asked for {num_blocks} blocks, {self._num_queued} free of {self.num_blocks}")
        reports = self.on_uncache is not None or self.track_changes
        out, removed = self._index.take_free(self._next, self._prev, num_blocks, self._ref, self._epoch, reports)
        self._num_queued -= num_blocks
        self._num_cached_queued -= removed.num_removed  # every block taken was queued
        self.num_evicted += removed.num_removed  # their epochs moved on: memoised chains ending there are stale
        self._mark_queue_moved()
        if reports and removed.num_removed:
            self._report_uncached(removed)
        return out

    def _deliver_uncached(self) -> None:
        """Hand the hashes uncached so far to ``on_uncache``, outside the lock (callers of allocate and evict)."""
        if self.on_uncache is None or not self._uncached:
            return
        with self._lock:
            uncached, self._uncached = self._uncached, []
            self._delivering.append(uncached)
        try:
            for h, parent in uncached:
                self.on_uncache(h, parent)
        finally:
            with self._lock:
                self._delivering = [batch for batch in self._delivering if batch is not uncached]

    def cached_or_reported(self, block_hashes: Sequence[BlockHash]) -> tuple[set[BlockHash], set[BlockHash]]:
        """At one instant: which of ``block_hashes`` are cached, and which left the cache with their ``on_uncache``
        report not yet returned (the hook's view still has them: a consistent picture for its own checks)."""
        with self._lock:
            cached = {h for h in block_hashes if self._index.get(h) is not None}
            pending = {h for batch in (self._uncached, *self._delivering) for h, _ in batch}
            return cached, pending & set(block_hashes)

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference on each block; blocks reaching zero join the free queue in policy order."""
        with self._lock:
            ref, pins, queued = self._ref, self._pins, self._num_queued
            for b in self.policy.order_for_free(block_ids):
                if ref[b] <= 0:
                    raise ValueError(f"block {b} freed with ref count {ref[b]}")
                ref[b] -= 1
                if ref[b] == 0 and pins[b] == 0:
                    self._append(b)
            if self._num_queued != queued:
                self._mark_queue_moved()

    def touch(self, block_ids: Sequence[int]) -> None:
        """Take one more reference on each block (prefix hits); free ones leave the queue. ``free`` them."""
        with self._lock:
            ref, pins, queued = self._ref, self._pins, self._num_queued
            for b in block_ids:
                if ref[b] == 0 and pins[b] == 0:
                    self._unlink(b)
                ref[b] += 1
            if self._num_queued != queued:
                self._mark_queue_moved()

    def _pin(self, block_ids: Sequence[int]) -> None:
        """Keep blocks (a system prompt, a push's source) out of eviction until ``unpin``."""
        with self._lock:
            queued = self._num_queued
            for b in block_ids:
                if self._ref[b] == 0 and self._pins[b] == 0:
                    self._unlink(b)
                self._num_pinned += self._pins[b] == 0
                self._pins[b] += 1
            if self._num_queued != queued:
                self._mark_queue_moved()

    def unpin(self, block_ids: Sequence[int]) -> None:
        with self._lock:
            queued = self._num_queued
            for b in reversed(block_ids):
                if self._pins[b] <= 0:
                    raise ValueError(f"block {b} is not pinned")
                self._pins[b] -= 1
                self._num_pinned -= self._pins[b] == 0
                if self._ref[b] == 0 and self._pins[b] == 0:
                    self._append(b)
            if self._num_queued != queued:
                self._mark_queue_moved()

    # ---- the prefix cache --------------------------------------------------------------------
    def cache(self, block_ids: Sequence[int], block_hashes: Sequence[BlockHash],
              parent_block_id: int = NO_BLOCK) -> list[int]:
        """Make full, computed blocks matchable: ``block_hashes[i]`` in ``block_ids[i]``, a run of one chain
        whose first block's parent is ``parent_block_id``. Returns the block ids the caller now references
        (``block_ids`` itself, a list, when every block took its own hash).

        Where another block already holds a hash, that block wins (every hash lives in one block and
        chains stay single): the caller's reference moves to it and its own copy is freed. The caller
        holds a reference on each of ``block_ids`` (or a pin, for a block already holding its own hash).
        """
        with self._lock:
            holders = None
            if block_ids and len(block_ids) == len(block_hashes):
                holders = self._cache_new_run(block_ids, block_hashes, parent_block_id)
            all_new = holders is not None  # every block holds its own new hash: no holder to move to
            if holders is None:
                holders = []
                parent, cache_one = parent_block_id, self._cache_one
                for block, h in zip(block_ids, block_hashes):
                    parent = cache_one(block, h, parent)
                    holders.append(parent)
            if holders:
                if parent_block_id == NO_BLOCK:
                    self._remember_chain(list(holders))
                elif (chain := self._memo_chain(parent_block_id)) is not None:  # its memo moves to the new end
                    del self._chains[parent_block_id]
                    chain.extend(holders)
                    self._remember_chain(chain)
                duplicates = [] if all_new else [(own, h) for own, h in zip(block_ids, holders) if own != h]
                if duplicates:
                    self.touch([h for _, h in duplicates])
                    self.free([own for own, _ in duplicates])
            return holders

    def _hold_if_cached(self, block_ids: Sequence[int], block_hashes: Sequence[BlockHash]) -> int:
        """Touch the leading ``block_ids`` that still hold ``block_hashes``, atomically; returns how many.

        For callers that matched earlier without a reference (the engine's admission):
        whatever was reallocated in between is not adopted.
        """
        with self._lock:
            num = self._index.count_held(block_ids, block_hashes)
            self.touch(block_ids[:num])
            return num

    def evict(self, num_blocks: int) -> list[int]:
        """Drop the hashes of up to ``num_blocks`` cached free blocks, LRU first; returns their ids.

        Only leaves of the cached chains go (a parent once its children are gone);
        the blocks stay free for allocation.
        """
        with self._lock:
            sentinel, evicted, progress = self.num_blocks, [], True
            slot, num_children, parent_of = self._slot, self._num_children, self._parent
            chosen: set[int] = set()
            orphaned: dict[int, int] = {}  # children among the chosen, per block (removed at the end, in one call)
            while len(evicted) < num_blocks and progress:  # another pass only if a parent became a leaf
                progress = False
                block = self._next[sentinel]
                while len(evicted) < num_blocks and block != sentinel:
                    if slot[block] >= 0 and block not in chosen and num_children[block] == orphaned.get(block, 0):
                        chosen.add(block)
                        evicted.append(block)
                        parent = parent_of[block]
                        if parent != NO_BLOCK:
                            orphaned[parent] = orphaned.get(parent, 0) + 1
                        progress = True
                    block = self._next[block]
            self._num_cached_queued -= self._uncache(evicted)  # every victim was queued
        self._deliver_uncached()
        return evicted

    def take_changes(self) -> PoolChanges:
        """Hashes made matchable and hashes dropped since the last call (for the global index)."""
        with self._lock:
            out = PoolChanges(self._newly_cached, self._evicted)
            self._newly_cached, self._evicted = [], []
            return out

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
        chain = self._memo_chain(last)
        if chain is not None and len(chain) >= length:
            self._chains.move_to_end(last)
            return chain[len(chain) - length:]  # a chain's blocks are exactly its last block's ancestors
        found = self._index.chain(last, length)
        if self._parent[found[0]] == NO_BLOCK:  # a whole chain: remember it
            self._remember_chain(found.copy())
        return found

    # ---- internals -----------------------------------------------------------------------------
    def _cache_new_run(self, block_ids: Sequence[int], block_hashes: Sequence[BlockHash], parent_block_id: int
                       ) -> list[int] | None:
        """``cache`` where no hash is cached yet and no block holds one: the index records the run
        in one call. None (nothing done) otherwise."""
        if not isinstance(block_ids, list):
            block_ids = list(block_ids)
        first, n = block_ids[0], len(block_ids)
        # a run (sorted fresh allocations): no id array to build; the span test first, gaps fail it at once
        consecutive = block_ids[-1] - first == n - 1 and block_ids == self._ids[first : first + n]
        if self._index.add_run(block_hashes, block_ids, consecutive, parent_block_id) != ADDED:
            return None  # a hash is cached, or a block holds one: block by block decides (holder or error)
        if self.track_changes:
            self._newly_cached.extend(block_hashes)
        return block_ids

    def _trim_chains(self, block_ids: list[int]) -> None:
        """Memoised chains whose last block lost its hash end at their last block still cached now (only
        leaves lose hashes, so the blocks above it all hold theirs): trimmed in place, not dropped, so a
        partly evicted prompt still matches through the memo and no long list is freed under the lock."""
        chains, slot, epoch = self._chains, self._slot, self._epoch
        for block in block_ids:
            memo = chains.pop(block, None)
            if memo is None or memo[0] != epoch[block]:
                continue
            chain = memo[1]
            while chain and slot[chain[-1]] < 0:
                chain.pop()
            if chain and chain[-1] not in chains:
                chains[chain[-1]] = (epoch[chain[-1]], chain)

    def _memo_chain(self, last: int) -> list[int] | None:
        """The memoised chain ending at block ``last``, or None; a memo from before ``last`` was last
        allocated is stale (the block may hold another hash now) and goes."""
        memo = self._chains.get(last)
        if memo is None:
            return None
        if memo[0] != self._epoch[last]:
            del self._chains[last]
            return None
        return memo[1]

    def _remember_chain(self, chain: list[int]) -> None:
        """Memoise ``chain`` (a list nobody else holds: it may be extended in place later)."""
        chains, last = self._chains, chain[-1]
        chains[last] = (self._epoch[last], chain)
        chains.move_to_end(last)
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

    def _mark_queue_moved(self) -> None:
        if not self.queue_moved.is_set():
            self.queue_moved.set()

    def _unlink(self, block: int) -> None:
        prev, nxt = self._prev[block], self._next[block]
        self._next[prev] = nxt
        self._prev[nxt] = prev
        self._num_queued -= 1
        self._num_cached_queued -= self._slot[block] >= 0

    def _append(self, block: int) -> None:
        sentinel = self.num_blocks
        tail = self._prev[sentinel]
        self._next[tail] = block
        self._prev[block] = tail
        self._next[block] = sentinel
        self._prev[sentinel] = block
        self._num_queued += 1
        self._num_cached_queued += self._slot[block] >= 0

    def _uncache(self, block_ids: list[int]) -> int:
        """Drop the hashes of those of ``block_ids`` that hold one (in order: a parent after its children);
        returns how many held one."""
        reports = self.on_uncache is not None or self.track_changes
        removed = self._index.remove_blocks(block_ids, with_hashes=reports)
        if not removed.num_removed:
            return 0
        self.num_evicted += removed.num_removed
        if not self._chains.keys().isdisjoint(block_ids):
            self._trim_chains(block_ids)
        if reports:
            self._report_uncached(removed)
        return removed.num_removed

    def _report_uncached(self, removed: RemovedBlocks) -> None:
        """Queue the hashes that left the index for ``on_uncache`` (``_deliver_uncached``) and the change log."""
        parents, hashes, parent_hashes = removed.parents, removed.hashes, removed.parent_hashes
        for i, parent in enumerate(parents):
            if parent == NOT_HELD:
                continue
            h = hashes[16 * i : 16 * i + 16]
            if self.on_uncache is not None:
                self._uncached.append((h, parent_hashes[16 * i : 16 * i + 16] if parent != NO_BLOCK else None))
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
            used, cached, free, pinned = self.usage()
            assert used + cached + free == n, "used + cached + free != total"
            assert cached == sum(1 for b in queued if self._slot[b] >= 0), "cached counter drifted"
            assert pinned == sum(1 for p in self._pins if p), "pinned counter drifted"
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
            for last, (epoch, chain) in self._chains.items():
                if epoch != self._epoch[last]:
                    continue  # stale since its last block was allocated: never read, dropped when met
                assert chain[-1] == last and self._slot[last] >= 0, f"memo of chain ending at {last} is stale"
                assert self._parent[chain[0]] == NO_BLOCK, "a memo chain does not start at a root block"
                assert all(self._parent[b] == a for a, b in zip(chain, chain[1:])), "a memo chain is not a chain"
