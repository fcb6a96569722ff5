"""RadixPrefixIndex: an SGLang-style radix tree over chained block hashes.

Each edge holds a run of block hashes (and, for the engine, the block ids that
hold them). Because hashes are chained, two prompts share an edge position only
if they share the whole prefix up to it, and a mismatch inside an edge means
every later position mismatches too, so the match point is a binary search:

    root --[h0 h1 h2 h3]--> A --[h4 h5]--> B        prompt X: h0..h5
                             \\-[g4 g5 g6]--> C      prompt Y: h0..h3 g4..g6

``match_prefix`` matches and (optionally) locks the matched path in one atomic
step; a locked or pinned node is never evicted; ``evict_lru`` trims the least
recently used unlocked leaves from their tails, and a parent whose last child
goes becomes a leaf in turn. It can run with or without block ids; serving does
not use it today (the engine's BlockPool is the prefix cache, the router reads the
global index), `kvmesh bench prefix-cache` compares the two. Thread-safe.
"""
from __future__ import annotations

import heapq
import itertools
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from kvmesh.kv.block_hash import BlockHash, hash_blocks
from kvmesh.kv.cache_stats import PrefixCacheStats


@dataclass(slots=True, eq=False)
class RadixNode:
    key: list[BlockHash]
    values: list[int] | None
    parent: RadixNode | None
    children: dict[BlockHash, RadixNode] = field(default_factory=dict)
    lock_ref: int = 0
    pins: int = 0
    last_access: int = 0

    def is_evictable_leaf(self) -> bool:
        return not self.children and self.lock_ref == 0 and self.pins == 0 and self.parent is not None


class MatchResult(NamedTuple):
    num_blocks: int
    values: list[int]  # block ids of the matched blocks (empty when the index holds none)
    node: RadixNode  # deepest matched node: pass to ``unlock`` if the match was locked


class RadixPrefixIndex:
    def __init__(self, block_size: int, root_hash: BlockHash = b"\0" * 16, min_prefix_length: int = 1):
        self.block_size = block_size
        self.root_hash = root_hash
        self.min_prefix_length = min_prefix_length
        self.stats = PrefixCacheStats()
        self._root = RadixNode([], None, None)
        self._lock = threading.Lock()
        self._clock = itertools.count(1)
        self._heap: list[tuple[int, int, RadixNode]] = []
        self._tie = itertools.count()
        self._num_blocks = 0

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    def hashes_of(self, token_ids: Sequence[int]) -> list[BlockHash]:
        return hash_blocks(self.root_hash, token_ids, self.block_size)

    # ---- lookups --------------------------------------------------------------------------------
    def match_prefix(self, token_ids: Sequence[int], lock: bool = False, record: bool = True) -> MatchResult:
        """Longest cached prefix of a prompt, in whole blocks; counts it in the stats."""
        return self.match_hashes(self.hashes_of(token_ids), lock=lock,
                                 num_tokens=len(token_ids) if record else None)

    def match_hashes(self, hashes: Sequence[BlockHash], lock: bool = False,
                     num_tokens: int | None = None) -> MatchResult:
        """Match and, with ``lock``, take a reference on the matched path atomically.

        ``num_tokens`` (the prompt's length) records the lookup in the stats.
        """
        with self._lock:
            node, matched, values = self._walk(hashes, split=lock)
            now = next(self._clock)
            n = node
            while n is not None:
                n.last_access = now
                if lock:
                    n.lock_ref += 1
                n = n.parent
            if not lock and node.is_evictable_leaf():
                self._push(node)
            if num_tokens is not None:
                self.stats.record_lookup(num_tokens, matched * self.block_size, self.min_prefix_length)
            return MatchResult(matched, values, node)

    def _walk(self, hashes: Sequence[BlockHash], split: bool) -> tuple[RadixNode, int, list[int]]:
        node, pos, values = self._root, 0, []
        while pos < len(hashes):
            child = node.children.get(hashes[pos])
            if child is None:
                break
            common = _common_prefix(child.key, hashes, pos)
            if child.values is not None:
                values += child.values if common == len(child.values) else child.values[:common]
            pos += common
            if common < len(child.key):
                if split:
                    child = self._split(child, common)
                else:
                    return node if common == 0 else child, pos, values
                node = child
                break
            node = child
        return node, pos, values

    def unlock(self, node: RadixNode) -> None:
        """Give back the reference a locked match took (once per locked match)."""
        with self._lock:
            n = node
            while n is not None:
                if n.lock_ref <= 0:
                    raise ValueError("unlock without a matching locked match")
                n.lock_ref -= 1
                n = n.parent
            if node.is_evictable_leaf():
                self._push(node)

    # ---- updates ----------------------------------------------------------------------------------
    def insert_prefix(self, token_ids: Sequence[int], values: Sequence[int] | None = None) -> int:
        return self.insert_hashes(self.hashes_of(token_ids), values)

    def insert_hashes(self, hashes: Sequence[BlockHash], values: Sequence[int] | None = None) -> int:
        """Add a prefix (and its block ids); returns how many blocks were new."""
        if values is not None and len(values) != len(hashes):
            raise ValueError("one value per block hash")
        with self._lock:
            node, pos, _ = self._walk(hashes, split=True)
            now = next(self._clock)
            if pos < len(hashes):
                leaf = RadixNode(list(hashes[pos:]), None if values is None else list(values[pos:]), node,
                                 last_access=now)
                node.children[hashes[pos]] = leaf
                self._num_blocks += len(leaf.key)
                self._push(leaf)
                node = leaf
            n = node
            while n is not None:
                n.last_access = now
                n = n.parent
            return len(hashes) - pos

    def pin_prefix(self, token_ids: Sequence[int]) -> RadixNode:
        """Keep a cached prefix (a system prompt) from eviction; returns the handle for ``unpin``."""
        hashes = self.hashes_of(token_ids)
        with self._lock:
            node, matched, _ = self._walk(hashes, split=True)
            if matched < len(hashes):
                raise KeyError(f"only {matched} of {len(hashes)} blocks of the prefix are cached")
            node.pins += 1
            return node

    def unpin(self, node: RadixNode) -> None:
        with self._lock:
            if node.pins <= 0:
                raise ValueError("node is not pinned")
            node.pins -= 1
            # Pinning protects the whole path: ancestors are never leaves while this node lives.
            if node.is_evictable_leaf():
                self._push(node)

    def evict_lru(self, num_blocks: int) -> list[BlockHash]:
        """Evict up to ``num_blocks`` blocks from the least recently used unlocked leaves."""
        evicted: list[BlockHash] = []
        with self._lock:
            while len(evicted) < num_blocks and self._heap:
                stamp, _, node = heapq.heappop(self._heap)
                if stamp != node.last_access or not node.is_evictable_leaf() or not node.key:
                    continue  # stale entry
                take = min(num_blocks - len(evicted), len(node.key))
                evicted.extend(reversed(node.key[len(node.key) - take :]))
                del node.key[len(node.key) - take :]
                if node.values is not None:
                    del node.values[len(node.values) - take :]
                self._num_blocks -= take
                if node.key:
                    self._push(node)
                    continue
                parent = node.parent
                for k, child in parent.children.items():
                    if child is node:
                        del parent.children[k]
                        break
                node.parent = None
                if parent.is_evictable_leaf():
                    self._push(parent)
            self.stats.record_eviction(len(evicted), self.block_size)
            if len(self._heap) > 4 * self._num_blocks + 64:
                self._rebuild_heap()
        return evicted

    def get_hit_rate(self) -> float:
        return self.stats.hit_rate

    # ---- internals -----------------------------------------------------------------------------------
    def _split(self, child: RadixNode, at: int) -> RadixNode:
        """Cut ``child``'s edge after ``at`` hashes; returns the new upper node."""
        upper = RadixNode(child.key[:at], None if child.values is None else child.values[:at], child.parent,
                          lock_ref=child.lock_ref, last_access=child.last_access)
        upper.children[child.key[at]] = child
        child.parent.children[child.key[0]] = upper
        child.key = child.key[at:]
        if child.values is not None:
            child.values = child.values[at:]
        child.parent = upper
        return upper

    def _push(self, node: RadixNode) -> None:
        heapq.heappush(self._heap, (node.last_access, next(self._tie), node))

    def _rebuild_heap(self) -> None:
        self._heap = [(n.last_access, next(self._tie), n) for n in self._nodes() if n.is_evictable_leaf()]
        heapq.heapify(self._heap)

    def _nodes(self):
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def dump(self) -> str:
        """The tree, one node per line: depth, blocks, locks, pins, first hash."""
        lines = [f"root ({self._num_blocks} blocks)"]

        def visit(node: RadixNode, depth: int) -> None:
            for child in node.children.values():
                lines.append(f"{'  ' * depth}- {len(child.key)} blocks [{child.key[0].hex()[:8]}..] "
                             f"lock={child.lock_ref} pins={child.pins} t={child.last_access}")
                visit(child, depth + 1)

        with self._lock:
            visit(self._root, 1)
        return "\n".join(lines)

    def check_integrity(self) -> None:
        with self._lock:
            total = 0
            for node in self._nodes():
                assert node.key, "empty edge left in the tree"
                assert node.parent is not None and node.parent.children.get(node.key[0]) is node, "broken parent link"
                assert node.lock_ref >= 0 and node.pins >= 0, "negative reference count"
                assert node.values is None or len(node.values) == len(node.key), "values out of step with keys"
                for child in node.children.values():
                    assert child.lock_ref <= node.lock_ref, "a child holds more locks than its parent"
                total += len(node.key)
            assert total == self._num_blocks, "block count drifted"
            self.stats.check_integrity()


def _common_prefix(key: list[BlockHash], hashes: Sequence[BlockHash], start: int) -> int:
    """Length of the common prefix of ``key`` and ``hashes[start:]`` by binary search (chained hashes)."""
    limit = min(len(key), len(hashes) - start)
    if key[limit - 1] == hashes[start + limit - 1]:
        return limit
    lo, hi = 0, limit - 1  # key[lo-1] matched (or lo == 0); key[hi] does not
    while lo < hi:
        mid = (lo + hi) // 2
        if key[mid] == hashes[start + mid]:
            lo = mid + 1
        else:
            hi = mid
    return lo
