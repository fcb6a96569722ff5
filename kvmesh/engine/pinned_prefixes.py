"""PinnedPrefixes: prompts (a shared system prompt) whose blocks a node keeps whatever the traffic.

A pin names a prefix by the chain hashes of its full blocks; its id is the last hash (hex), so
the same tokens give the same id on every node of a model. Blocks of the prefix are pinned in
the pool as soon as they are cached: at once for those already there, later (``refresh``, after
every engine step) for those a request computes afterwards. A pinned block leaves the free
queue: it is never evicted and never counted as free, until ``unpin``.

    hashes      h0  h1  h2  h3  h4          (the prefix's full blocks)
    cached      b7  b2  b9  --  --          pinned now: b7 b2 b9; h3, h4 pinned when computed

Mechanism only: which prefixes to pin is the operator's (``kvmesh pin``, the router's admin API).
Call every method on the thread that owns the pool's engine (the pool's lock makes each call atomic).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvmesh.kv.block_hash import BlockHash
from kvmesh.kv.block_pool import BlockPool


@dataclass(slots=True)
class PinnedPrefix:
    prefix_id: str
    block_hashes: list[BlockHash]
    pinned_block_ids: list[int] = field(default_factory=list)  # the leading blocks pinned so far

    @property
    def complete(self) -> bool:
        return len(self.pinned_block_ids) == len(self.block_hashes)


def prefix_id(block_hashes: list[BlockHash]) -> str:
    """The id of the prefix whose full blocks have these chain hashes (ValueError when there are none)."""
    if not block_hashes:
        raise ValueError("a pinned prefix needs at least one full block of tokens")
    return block_hashes[-1].hex()


class PinnedPrefixes:
    def __init__(self, pool: BlockPool):
        self.pool = pool
        self._pins: dict[str, PinnedPrefix] = {}

    def __contains__(self, pin_id: str) -> bool:
        return pin_id in self._pins

    def pin(self, block_hashes: list[BlockHash]) -> PinnedPrefix:
        """Pin a prefix (idempotent: pinning it again changes nothing); its cached blocks at once."""
        pin_id = prefix_id(block_hashes)
        entry = self._pins.get(pin_id)
        if entry is None:
            entry = self._pins[pin_id] = PinnedPrefix(pin_id, list(block_hashes))
            self._extend(entry)
        return entry

    def unpin(self, pin_id: str) -> bool:
        """Release a pin's blocks to the free queue (they stay cached); False if no such pin."""
        entry = self._pins.pop(pin_id, None)
        if entry is None:
            return False
        self.pool.unpin(entry.pinned_block_ids)
        return True

    def refresh(self) -> None:
        """Pin the blocks of every incomplete pin that have been cached since (after each engine step)."""
        for entry in self._pins.values():
            if not entry.complete:
                self._extend(entry)

    def status(self) -> dict[str, tuple[int, int]]:
        """pin id -> (blocks pinned, blocks in the prefix)."""
        return {pin_id: (len(e.pinned_block_ids), len(e.block_hashes)) for pin_id, e in self._pins.items()}

    def _extend(self, entry: PinnedPrefix) -> None:
        # The blocks cached since past those pinned, pinned in the same atomic match
        entry.pinned_block_ids.extend(self.pool.match(entry.block_hashes, hold="pin",
                                                      skip=len(entry.pinned_block_ids)))

    def check_integrity(self) -> None:
        for entry in self._pins.values():
            for block, h in zip(entry.pinned_block_ids, entry.block_hashes):
                assert self.pool.block_state(block).block_hash == h, f"pinned block {block} of {entry.prefix_id} lost its hash"
