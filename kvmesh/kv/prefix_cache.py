"""PrefixCache: the one contract of a prefix cache over chained block hashes (docs/design.md §4).

The engine's ``BlockPool`` implements it; anything that caches KV blocks by prefix (a tier of
the global pool, a test double) must too. Blocks are named by ids the cache hands out; a
prefix is the list of its full blocks' chain hashes, so matching never hashes tokens itself.

    match        the longest cached prefix: its block ids, and how many blocks remain to compute
                 (no reference is taken: callers that use the blocks take one atomically, e.g.
                 ``BlockPool.match_and_touch``)
    insert       make computed blocks matchable; returns the block holding each hash (an existing
                 holder wins, so each hash lives in one block); ``pin=True`` also pins them
    evict        drop up to n cached, unreferenced, unpinned blocks, leaves of chains first, LRU
                 first; returns their ids (they stay allocatable, no longer matchable)
    pin / unpin  keep blocks out of eviction (and out of the free count) until unpinned
    stats        lookups, hit rate, average match length (tokens) of the matches made
    capacity     the number of blocks; never more are cached
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol, runtime_checkable

from kvmesh.kv.block_hash import BlockHash


class PrefixMatch(NamedTuple):
    block_ids: list[int]  # the cached prefix, in chain order
    num_remaining_blocks: int  # blocks of the asked-for prefix that are not cached

    @property
    def num_matched_blocks(self) -> int:
        return len(self.block_ids)


class MatchStats(NamedTuple):
    num_lookups: int
    num_hits: int  # lookups that matched at least one block
    num_matched_blocks: int  # over every lookup
    block_size: int

    @property
    def hit_rate(self) -> float:
        return self.num_hits / self.num_lookups if self.num_lookups else 0.0

    @property
    def average_match_tokens(self) -> float:
        return self.num_matched_blocks * self.block_size / self.num_lookups if self.num_lookups else 0.0


@runtime_checkable
class PrefixCache(Protocol):
    @property
    def capacity(self) -> int: ...

    def match_prefix(self, block_hashes: Sequence[BlockHash]) -> PrefixMatch: ...

    def insert(self, block_ids: Sequence[int], block_hashes: Sequence[BlockHash], parent_block_id: int = -1,
               pin: bool = False) -> list[int]: ...

    def evict_blocks(self, num_blocks: int) -> list[int]: ...

    def pin(self, block_ids: Sequence[int]) -> None: ...

    def unpin(self, block_ids: Sequence[int]) -> None: ...

    def match_stats(self, block_size: int) -> MatchStats: ...

    def check_integrity(self) -> None: ...
