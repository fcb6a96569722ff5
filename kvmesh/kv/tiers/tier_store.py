"""TierStore: one lower KV tier's blocks (mechanism only).

It maps block hashes to the slots of its ``Medium``, keeps them in LRU order, keeps
each block's parent hash and checksum, and counts pins (a block being read for a
promotion or a push keeps its slot until unpinned, even if it is dropped meanwhile).
Which block to evict, where a victim goes and when are ``TieredCache``'s business.
Not thread-safe: ``TieredCache`` calls it under its own lock.

    slot states   free      in ``_free_slots``
                  reserved  being written, not findable yet (``reserve`` -> ``commit`` / ``release``)
                  held      an entry in ``_entries`` (the LRU order, least recent first)
                  doomed    dropped while pinned: no hash any more, freed at the last unpin
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvmesh.kv import fast_crc
from kvmesh.kv.tiers.media import Medium


def block_checksum(data: torch.Tensor) -> int:
    """crc32 of one block's bytes (a uint8 CPU tensor)."""
    return fast_crc.crc32_of(data.numpy())


@dataclass(slots=True)
class TierEntry:
    block_hash: bytes
    slot: int
    parent: bytes | None  # None: the first block of its chain
    checksum: int
    pins: int = 0
    doomed: bool = False  # dropped while pinned


class TierStore:
    def __init__(self, name: str, tier: int, medium: Medium):
        self.name, self.tier, self.medium = name, tier, medium
        self.num_slots = medium.num_slots
        self._entries: OrderedDict[bytes, TierEntry] = OrderedDict()
        self._free_slots = list(range(self.num_slots - 1, -1, -1))
        self._reserved: set[int] = set()
        self._num_doomed = 0

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, block_hash: bytes) -> TierEntry | None:
        return self._entries.get(block_hash)

    def hashes(self) -> list[bytes]:
        return list(self._entries)

    def touch(self, block_hash: bytes) -> None:
        """Most recently used now."""
        self._entries.move_to_end(block_hash)

    def reserve(self) -> int | None:
        """Take a free slot to write into (then ``commit`` or ``release`` it); None when none is free."""
        if not self._free_slots:
            return None
        slot = self._free_slots.pop()
        self._reserved.add(slot)
        return slot

    def adopt(self, slot: int) -> None:
        """Reserve this very slot (it already holds a block: a disk tier re-adopted after a restart)."""
        self._free_slots.remove(slot)
        self._reserved.add(slot)

    def release(self, slot: int) -> None:
        """Give back a reserved slot that was not committed."""
        self._reserved.remove(slot)
        self._free_slots.append(slot)

    def commit(self, slot: int, block_hash: bytes, parent: bytes | None, checksum: int) -> TierEntry:
        """A reserved slot now holds this block's bytes: make it findable (most recently used)."""
        if block_hash in self._entries:
            raise ValueError(f"{self.name}: block {block_hash.hex()} is already held")
        self._reserved.remove(slot)
        entry = self._entries[block_hash] = TierEntry(block_hash, slot, parent, checksum)
        return entry

    def victim(self, can_drop: Callable[[TierEntry], bool], scan: int = 64) -> TierEntry | None:
        """The least recently used unpinned entry for which ``can_drop`` holds (among the first ``scan``),
        else the least recently used unpinned one; None when every entry is pinned."""
        fallback = None
        for i, entry in enumerate(self._entries.values()):
            if entry.pins:
                continue
            if can_drop(entry):
                return entry
            if fallback is None:
                fallback = entry
            if i >= scan:
                break
        return fallback

    def remove(self, block_hash: bytes) -> TierEntry:
        """Forget a block; its slot is free at once, or at its last unpin."""
        entry = self._entries.pop(block_hash)
        if entry.pins:
            entry.doomed = True
            self._num_doomed += 1
        else:
            self._free_slots.append(entry.slot)
        return entry

    def pin(self, entry: TierEntry) -> None:
        entry.pins += 1

    def unpin(self, entry: TierEntry) -> None:
        if entry.pins <= 0:
            raise ValueError(f"{self.name}: slot {entry.slot} is not pinned")
        entry.pins -= 1
        if entry.pins == 0 and entry.doomed:
            self._num_doomed -= 1
            self._free_slots.append(entry.slot)

    def check_integrity(self) -> None:
        slots = [e.slot for e in self._entries.values()]
        assert len(set(slots)) == len(slots), f"{self.name}: two blocks share a slot"
        assert not set(slots) & set(self._free_slots), f"{self.name}: a held slot is also free"
        assert len(set(self._free_slots)) == len(self._free_slots), f"{self.name}: a slot is free twice"
        assert not self._reserved & (set(slots) | set(self._free_slots)), f"{self.name}: a reserved slot is in use"
        assert len(slots) + len(self._free_slots) + len(self._reserved) + self._num_doomed == self.num_slots, \
            f"{self.name}: held + free + reserved + doomed != slots"
        assert all(e.pins >= 0 and not e.doomed and k == e.block_hash for k, e in self._entries.items()), \
            f"{self.name}: an entry's record is inconsistent"
