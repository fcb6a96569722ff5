"""BlockChecksums: the crc32 of each cached block, computed once and kept beside it.

A block's bytes do not change while it holds a hash and its epoch holds (``BlockPool``: allocation bumps the
epoch, and only a block being filled is written). So the checksum a push sends with a cached block is computed
the first time the block is sent, or taken from the check that accepted it when it arrived, and reused by
every later push of that block until the block is allocated again. A stored value that is wrong (a block
rewritten while cached: a bug) is still caught where it matters: the receiver checks the bytes it got against
it.

Two parallel lists of the pool's size (the epoch each value was computed at, -1: none; the value): no growth,
no eviction of its own. Thread-safe.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from kvmesh.kv.block_pool import BlockPool


class BlockChecksums:
    def __init__(self, pool: BlockPool, compute: Callable[[list[int]], list[int]]):
        """``compute(block_ids)``: crc32 of each block's bytes as they are now (the caller's memory)."""
        self.pool = pool
        self._compute = compute
        self._epoch = [-1] * pool.num_blocks
        self._value = [0] * pool.num_blocks
        self._lock = threading.Lock()
        self.num_computed = 0
        self.num_reused = 0

    def of_cached(self, block_ids: Sequence[int]) -> list[int]:
        """The checksums of cached blocks the caller holds (pinned or referenced, so none is allocated meanwhile):
        stored ones where their epoch still holds, the rest computed now and stored."""
        epochs = self.pool.epochs(block_ids)
        with self._lock:
            out = [self._value[b] if self._epoch[b] == e else None for b, e in zip(block_ids, epochs)]
        missing = [i for i, v in enumerate(out) if v is None]
        if missing:
            computed = self._compute([block_ids[i] for i in missing])
            for i, value in zip(missing, computed):
                out[i] = value
            self.remember([block_ids[i] for i in missing], computed, [epochs[i] for i in missing])
        with self._lock:
            self.num_computed += len(missing)
            self.num_reused += len(block_ids) - len(missing)
        return out

    def of_epoch(self, block_id: int, epoch: int) -> int | None:
        """The stored checksum of ``block_id`` if it was taken at ``epoch``, else None (nothing computed)."""
        with self._lock:
            if self._epoch[block_id] != epoch:
                return None
            self.num_reused += 1
            return self._value[block_id]

    def remember(self, block_ids: Sequence[int], values: Sequence[int], epochs: Sequence[int] | None = None) -> None:
        """Keep ``values`` as the checksums of blocks whose bytes are final (checked on arrival, about to be cached)
        at ``epochs`` (default: their epochs now)."""
        epochs = self.pool.epochs(block_ids) if epochs is None else epochs
        with self._lock:
            for b, value, e in zip(block_ids, values, epochs):
                self._epoch[b], self._value[b] = e, value

    def describe(self) -> dict:
        with self._lock:
            return {"computed": self.num_computed, "reused": self.num_reused}
