"""KeyMap: a compact hash map from 64-bit block keys to small integers, in one numpy array.

The global index's mirror holds one entry per (block, holder) and one per block: tens of millions in a
fleet. A Python dict spends ~100 B and four scattered memory reads (index, entry, key object, value
object) on each; here an entry is 16 bytes, key and value side by side in one slot, so a probe is one
read (one cache line, in huge pages where the kernel gives them)::

    slots[2 * i]      the key (EMPTY: never used, TOMB: deleted)
    slots[2 * i + 1]  its value

Open addressing with linear probing from a home slot that mixes the key with a per-map random odd
multiplier (the keys are hash prefixes, but whoever chooses prompts could aim many at one run of slots
if the home were the key's own low bits). Bulk operations (``transform``, and ``put_many``,
``delete_many``, ``get_many`` on it) are vectorised: every key probes at once, round after round, so a
record of 16k entries costs some numpy calls, not 16k Python steps. ``reader()`` gives the scalar probe
of a lookup.

Keys 0 and 1 are EMPTY and TOMB: a block key below 2 is stored as key + 2 (two of 2^64 keys share a
slot; the index is advisory, and its holders re-check). One writer at a time; readers on other
threads may see a moment-old state (a key not yet in, a value about to be corrected, a key moving
during a rebuild): the index is advisory.
"""
from __future__ import annotations

import random
from collections.abc import Callable

import numpy as np

EMPTY, TOMB = 0, 1
MISSING = -1
_MASK64 = (1 << 64) - 1
_MAX_LOAD = 0.7  # live + deleted slots over capacity before a rebuild
_MIN_SLOTS = 16
_SCALAR_TAIL = 24  # keys left probing when a bulk operation goes on one key at a time


def as_keys(keys) -> np.ndarray:
    """Block keys as a uint64 array with 0 and 1 moved out of the way of EMPTY and TOMB."""
    keys = np.asarray(keys, dtype=np.uint64)
    low = keys < 2
    if low.any():
        keys = np.where(low, keys + np.uint64(2), keys)
    return keys


class _Layout:
    """The array and how to find a key's home in it; swapped whole on a rebuild."""

    __slots__ = ("slots", "view", "mask", "shift", "multiplier", "reader")

    def __init__(self, num_slots: int, multiplier: int):
        self.slots = np.zeros(2 * num_slots, dtype=np.uint64)
        self.view = memoryview(self.slots).cast("B").cast("Q")  # scalar reads as Python ints
        self.mask = num_slots - 1
        self.shift = 64 - (num_slots.bit_length() - 1)
        self.multiplier = multiplier
        self.reader = None  # KeyMap.reader's function for this array, made on first use

    def homes(self, keys: np.ndarray) -> np.ndarray:
        with np.errstate(over="ignore"):
            return ((keys * np.uint64(self.multiplier)) >> np.uint64(self.shift)).astype(np.int64)


class KeyMap:
    """uint64 block key -> value (0 .. 2^63); see the module docstring."""

    def __init__(self, capacity: int = 0, seed: int | None = None):
        multiplier = random.Random(seed).getrandbits(64) | 1  # seed None: from the OS's randomness
        self._layout = _Layout(self._slots_for(capacity), multiplier)
        self._num_live = 0
        self._num_dead = 0

    @staticmethod
    def _slots_for(num_keys: int) -> int:
        return max(_MIN_SLOTS, 1 << int(np.ceil(np.log2(max(num_keys, 1) / 0.5))))

    def __len__(self) -> int:
        return self._num_live

    @property
    def nbytes(self) -> int:
        return self._layout.slots.nbytes

    def get(self, key: int, default: int = MISSING) -> int:
        """The value of one key (``default`` when absent)."""
        return self.reader()(key, default)

    def layout(self) -> tuple[np.ndarray, int, int, int]:
        """(slots, mask, shift, multiplier) of the array as it is now, for a native reader of the same layout
        (``metadata/chain_search.c``); stale after a rebuild, like ``reader``."""
        layout = self._layout
        return layout.slots, layout.mask, layout.shift, layout.multiplier

    def reader(self) -> Callable[[int, int], int]:
        """``get`` bound to the map's array as it is now (made once per array), for a loop of scalar reads (a
        lookup's probes): a few Python steps and mostly one memory read each. Stale after a rebuild (it keeps
        reading the old array)."""
        layout = self._layout
        if layout.reader is not None:
            return layout.reader
        view, mask, shift, multiplier = layout.view, layout.mask, layout.shift, layout.multiplier

        def get(key: int, default: int = MISSING) -> int:
            if key < 2:
                key += 2
            i = ((key * multiplier) & _MASK64) >> shift
            while True:
                found = view[2 * i]
                if found == key:
                    return view[2 * i + 1]
                if found == EMPTY:
                    return default
                i = (i + 1) & mask

        layout.reader = get
        return get

    def _find(self, keys: np.ndarray) -> np.ndarray:
        """Slot index of each key (``MISSING`` where absent): all keys probe at once, round after round, and the
        last few finish one by one (a round costs a dozen numpy calls whatever its size)."""
        layout = self._layout
        slots, mask = layout.slots, layout.mask
        where = np.full(len(keys), MISSING, dtype=np.int64)
        pending = np.arange(len(keys))
        pos = layout.homes(keys)
        while len(pending) > _SCALAR_TAIL:
            found = slots[2 * pos]
            hit = found == keys[pending]
            where[pending[hit]] = pos[hit]
            going_on = ~hit & (found != EMPTY)
            pending, pos = pending[going_on], (pos[going_on] + 1) & mask
        view = layout.view
        for i, at, key in zip(pending.tolist(), pos.tolist(), keys[pending].tolist()):
            while True:
                found = view[2 * at]
                if found == key:
                    where[i] = at
                    break
                if found == EMPTY:
                    break
                at = (at + 1) & mask
        return where

    def get_many(self, keys, default: int = MISSING) -> np.ndarray:
        """The values of ``keys`` (int64; ``default`` where absent)."""
        keys = as_keys(keys)
        where = self._find(keys)
        out = np.full(len(keys), default, dtype=np.int64)
        held = where >= 0
        out[held] = self._layout.slots[2 * where[held] + 1].astype(np.int64)
        return out

    def contains_many(self, keys) -> np.ndarray:
        return self._find(as_keys(keys)) >= 0

    def transform(self, keys, change: Callable[[np.ndarray], np.ndarray], absent: int = 0) -> np.ndarray:
        """Give each of ``keys`` (distinct) the value ``change(old values)[i]``, one probe per key: the old value
        of a key not held reads as ``absent``, and a new value of ``absent`` removes the key. Returns the mask
        of keys that were held."""
        keys = as_keys(keys)
        where = self._find(keys)
        held = where >= 0
        slots = self._layout.slots
        old = np.full(len(keys), absent, dtype=np.int64)
        old[held] = slots[2 * where[held] + 1].astype(np.int64)
        new = np.asarray(change(old), dtype=np.int64)
        stays = new != absent
        kept = held & stays
        slots[2 * where[kept] + 1] = new[kept].astype(np.uint64)
        gone = where[held & ~stays]
        if len(gone):
            slots[2 * gone] = TOMB
            self._num_live -= len(gone)
            self._num_dead += len(gone)
        added = ~held & stays
        num_added = int(added.sum())
        if num_added:
            if self._num_live + self._num_dead + num_added > _MAX_LOAD * (self._layout.mask + 1):
                self._rebuild(self._num_live + num_added)
            self._insert(keys[added], new[added].astype(np.uint64))
        elif self._num_dead > self._num_live and self._num_dead > _MIN_SLOTS:
            self._rebuild(self._num_live)
        return held

    def put_many(self, keys, values) -> np.ndarray:
        """Set ``keys[i]`` to ``values[i]`` (the keys distinct, the values >= 0); returns the mask of keys that
        were absent."""
        values = np.asarray(values, dtype=np.int64)
        return ~self.transform(keys, lambda old: np.broadcast_to(values, old.shape), absent=-1)

    def delete_many(self, keys) -> np.ndarray:
        """Remove ``keys`` (distinct); returns the mask of those that were present."""
        return self.transform(keys, lambda old: np.full(len(old), -1), absent=-1)

    def _insert(self, keys: np.ndarray, values: np.ndarray) -> None:
        """Absent, distinct keys into free slots (empty or deleted) along their probe paths; like ``_find``,
        in rounds, then one by one."""
        layout = self._layout
        slots, mask = layout.slots, layout.mask
        pending = np.arange(len(keys))
        pos = layout.homes(keys)
        while len(pending) > _SCALAR_TAIL:
            found = slots[2 * pos]
            free = np.flatnonzero(found <= TOMB)
            # several keys may reach the same free slot this round: each writes its key there, and the key
            # read back names the one that took it
            at = 2 * pos[free]
            slots[at + 1] = values[pending[free]]
            slots[at] = keys[pending[free]]
            took = slots[at] == keys[pending[free]]
            taking = free[took]
            slots[at[took] + 1] = values[pending[taking]]  # a loser's value may have landed after the taker's
            self._num_live += len(taking)
            self._num_dead -= int((found[taking] == TOMB).sum())
            left = np.ones(len(pending), dtype=bool)
            left[taking] = False
            pending, pos = pending[left], (pos[left] + 1) & mask
        view = layout.view
        for at, key, value in zip(pos.tolist(), keys[pending].tolist(), values[pending].tolist()):
            while view[2 * at] > TOMB:
                at = (at + 1) & mask
            self._num_dead -= view[2 * at] == TOMB
            view[2 * at + 1] = value
            view[2 * at] = key
            self._num_live += 1

    def keys(self) -> np.ndarray:
        """Every key held (the stored form: keys below 2 read as key + 2), in no order."""
        stored = self._layout.slots[0::2]
        return stored[stored > TOMB]

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        stored = self._layout.slots[0::2]
        live = stored > TOMB
        return stored[live], self._layout.slots[1::2][live]

    def as_dict(self) -> dict[int, int]:
        """Every key -> its value as a dict (stored keys: below 2 read as key + 2); for tests and tools."""
        keys, values = self.items()
        return dict(zip(keys.tolist(), values.tolist()))

    def _rebuild(self, num_keys: int) -> None:
        keys, values = self.items()
        old = self._layout
        self._layout = _Layout(self._slots_for(num_keys), old.multiplier)
        self._num_live = self._num_dead = 0
        self._insert(keys.copy(), values.copy())

    def check_integrity(self) -> None:
        """Raise AssertionError unless the counts match the slots and every key is found from its home."""
        stored = self._layout.slots[0::2]
        assert int((stored > TOMB).sum()) == self._num_live, "live count drifted"
        assert int((stored == TOMB).sum()) == self._num_dead, "deleted count drifted"
        keys, values = self.items()
        assert np.array_equal(self.get_many(keys), values.astype(np.int64)), "a key is not found from its home"
        assert len(np.unique(keys)) == len(keys), "a key is stored twice"
