"""Eviction order: policy objects apart from the block pool's mechanism.

The pool keeps one LRU free queue: blocks enter at the tail when their last
reference is dropped and are reused from the head. A policy decides the order in
which one request's blocks enter the queue. Whatever the policy, the pool never
evicts a block whose cached child is still cached (that would orphan a tail no
lookup can reach); a policy only makes that check cheap or costly.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class EvictionPolicy(Protocol):
    name: str

    def order_for_free(self, block_ids: Sequence[int]) -> Sequence[int]:
        """The order in which a request's blocks (given in chain order) join the free queue."""


class TailFirstLRU:
    """Least recently used first; within a request, the chain's tail before its head.

    Freed in reverse chain order, a block always sits behind its descendants in
    the queue, so the head of the queue is always safe to evict: O(1) eviction.
    """

    name = "tail-first-lru"

    def order_for_free(self, block_ids: Sequence[int]) -> Sequence[int]:
        return block_ids[::-1]


class ChainOrderLRU:
    """Least recently used first, a request's blocks in chain order (head first).

    A baseline for comparisons: correct (the pool skips blocks with cached
    children), but eviction may scan past heads to find a tail.
    """

    name = "chain-order-lru"

    def order_for_free(self, block_ids: Sequence[int]) -> Sequence[int]:
        return block_ids


POLICIES = {p.name: p for p in (TailFirstLRU, ChainOrderLRU)}
