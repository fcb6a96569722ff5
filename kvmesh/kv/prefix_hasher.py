"""PrefixHasher: ``hash_blocks`` that remembers recent chains, so a repeated prefix is compared, not rehashed.

A block's hash depends only on its parent and its tokens (docs/design.md §4), so when the
token bytes of a new prompt start with those of a chain hashed before (from the same parent),
that chain's hashes are the new prompt's, exactly: no collision risk, the bytes are compared.

    memo key   (parent hash, bytes of the first block)  ->  the latest chain that started so
    new prompt [ b0 | b1 | b2 | b3 | b4 ]
    memo chain [ b0 | b1 | b2 | x3 ]         common: 3 blocks (one memcmp, a binary search
                                             only when the prompts differ)
    hashes     memo[0:3] + hash_blocks(memo[2], b3 b4)

The latest chain under a key replaces the previous one (a shared system prompt stays
covered whatever follows it). Memory is bounded by ``max_bytes`` of remembered token
bytes, least recently used first. Thread-safe (routers hash on many threads).
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple

from kvmesh.kernels.extensions import loader as extensions
from kvmesh.kv.block_hash import BlockHash, hash_block_bytes, hash_tokens, tokens_to_bytes


class _Chain(NamedTuple):
    data: bytes  # the chain's token bytes (whole blocks)
    hashes: list[BlockHash]


class PrefixHasher:
    def __init__(self, block_size: int, max_bytes: int = 16 << 20):
        """Also builds (once per machine) or loads the native chain now, so a router's first prompt does not wait
        for a compiler (``kv/block_hash.py``)."""
        extensions.load("blake2b_chain")
        self.block_size = block_size
        self.max_bytes = max_bytes
        self._chains: OrderedDict[tuple[BlockHash, bytes], _Chain] = OrderedDict()
        self._num_bytes = 0
        self._lock = threading.Lock()
        self.num_blocks_reused = 0
        self.num_blocks_hashed = 0

    def hash(self, parent: BlockHash, token_ids: Sequence[int]) -> list[BlockHash]:
        """The hashes of every full block of ``token_ids`` chained from ``parent`` (= ``hash_blocks``)."""
        step = 4 * self.block_size
        num_full = len(token_ids) // self.block_size
        if num_full == 0:
            return []
        key = (parent, tokens_to_bytes(token_ids, 0, self.block_size))
        with self._lock:
            known = self._chains.get(key)
            if known is not None:
                self._chains.move_to_end(key)
        if known is None:  # first sight: the conversion and the chain in one pass
            data, hashes = hash_tokens(parent, token_ids, self.block_size)
            self._remember(key, _Chain(data, list(hashes)))  # the caller owns the list it gets
            self.num_blocks_hashed += num_full
            return hashes
        data = tokens_to_bytes(token_ids, 0, num_full * self.block_size)
        num_common = _common_blocks(known.data, data, step)
        hashes = known.hashes[:num_common]
        if num_common < num_full:
            hashes += hash_block_bytes(hashes[-1], data, step, num_common)
            self._remember(key, _Chain(data, list(hashes)))
        self.num_blocks_reused += num_common
        self.num_blocks_hashed += num_full - num_common
        return hashes

    def _remember(self, key: tuple[BlockHash, bytes], chain: _Chain) -> None:
        size = len(chain.data)
        if size > self.max_bytes:
            return
        with self._lock:
            old = self._chains.pop(key, None)
            if old is not None:
                self._num_bytes -= len(old.data)
            self._chains[key] = chain
            self._num_bytes += size
            while self._num_bytes > self.max_bytes:
                _, dropped = self._chains.popitem(last=False)
                self._num_bytes -= len(dropped.data)

    @property
    def num_bytes(self) -> int:
        """Token bytes remembered now (the memo's bound is on these)."""
        return self._num_bytes


def _common_blocks(known: bytes, data: bytes, step: int) -> int:
    """How many whole leading blocks the two byte strings share (memcmp on views, no copies)."""
    limit = min(len(known), len(data)) // step
    view = memoryview(known)
    if data.startswith(view[: limit * step]):
        return limit
    lo, hi = 1, limit  # the first block matched through the key; block ``hi`` - 1 differs somewhere
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if data.startswith(view[: mid * step]):
            lo = mid
        else:
            hi = mid
    return lo
