"""Holdings records: how a node tells the cluster which KV blocks it holds, in few etcd keys.

A node's holdings are a stream of records on its lease (docs/design.md §5)::

    /kvmesh/<c>/holdings/<ns>/<node>/l/<seq>                       a log record: blocks added (with their
                                                                   tier) or gone since the record before
    /kvmesh/<c>/holdings/<ns>/<node>/s/<seq>/<part>-<num_parts>    a snapshot: everything the node holds, as
                                                                   of ``seq``, cut into parts

``seq`` grows with every record a node writes (it starts from the wall clock in nanoseconds, so a restarted
node continues above its previous life), so a reader's state of a node is the newest complete snapshot plus
the log records after it, applied in order. A block is named by the first 8 bytes of its chained hash
(``block_key``): 9 bytes per block in a record (key and tier), where a key per block cost etcd ~1 KB. Two
blocks sharing 8 bytes of hash make a lookup promise a block its holder lacks: the index is advisory (a
holder re-checks its own pool before it pushes), and with 2^64 keys that is not expected in a fleet's life.

This module is the format and the reader's state; ``metadata/block_index.py`` writes and mirrors it.
"""
from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvmesh.metadata import native_search
from kvmesh.metadata.key_map import KeyMap, as_keys
from kvmesh.metadata.keys import HoldingsKey
from kvmesh.metadata.records import RecordError

GONE = 255  # a log entry's code for "no longer held"; 0, 1, 2 are tiers (compute buffer, host memory, disk)
LOG, SNAPSHOT = "l", "s"
MAX_HINTS = 1 << 16  # remembered lookup lengths (cleared when full)
_MIN_MAX_SETS = 4096  # holder sets interned before the unused ones are dropped
MAX_RECORD_ENTRIES = 16_384  # 9 bytes each: ~144 KiB per record, well inside etcd's request and a listing page's limits
_HEADER = struct.Struct("<4sI")
_MAGIC = b"KVH1"


_KEY = struct.Struct("<Q")


def block_key(block_hash: bytes) -> int:
    """The index's name for a block: the first 8 bytes of its chained hash, as an unsigned integer."""
    return _KEY.unpack_from(block_hash)[0]


def encode_record(entries: Sequence[tuple[int, int]]) -> bytes:
    """(block key, code) pairs -> the record's bytes: header, the keys (uint64), the codes (uint8)."""
    keys = array("Q", [k for k, _ in entries])
    if sys.byteorder != "little":  # pragma: no cover
        keys.byteswap()
    return _HEADER.pack(_MAGIC, len(entries)) + keys.tobytes() + bytes(c for _, c in entries)


def decode_record(data: bytes) -> tuple[np.ndarray, np.ndarray]:
    """The record's keys (uint64) and codes (uint8), views of ``data``; RecordError when it is not one."""
    if len(data) < _HEADER.size:
        raise RecordError("holdings record: too short")
    magic, count = _HEADER.unpack_from(data)
    if magic != _MAGIC or len(data) != _HEADER.size + 9 * count:
        raise RecordError("holdings record: bad magic or length")
    keys = np.frombuffer(data, dtype="<u8", count=count, offset=_HEADER.size).astype(np.uint64, copy=False)
    codes = np.frombuffer(data, dtype=np.uint8, offset=_HEADER.size + 8 * count)
    if ((codes > 2) & (codes != GONE)).any():
        raise RecordError("holdings record: unknown entry code")
    return keys, codes


Diff = tuple[np.ndarray, np.ndarray]  # (block keys newly held, block keys no longer held), KeyMap's stored form
_NONE = np.zeros(0, dtype=np.uint64)


def _last_wins(keys, codes) -> tuple[np.ndarray, np.ndarray]:
    """Entries with each key once (its last code): a record from a correct publisher has no repeats, and a
    KeyMap takes distinct keys."""
    keys = as_keys(keys)
    codes = np.frombuffer(codes, dtype=np.uint8) if isinstance(codes, (bytes, bytearray)) else np.asarray(codes)
    if len(keys) < 2:
        return keys, codes
    unique, last = np.unique(keys[::-1], return_index=True)
    if len(unique) == len(keys):
        return keys, codes
    return unique, codes[::-1][last]


@dataclass(slots=True)
class NodeHoldings:
    """One node's holdings as a reader knows them: block key -> fastest tier, as of record ``seq``."""

    blocks: KeyMap = field(default_factory=KeyMap)
    seq: int = -1
    keys: set[str] = field(default_factory=set)  # the node's record keys in etcd now (none left: it is gone)
    # snapshot seq -> part -> (keys, codes): parts seen of snapshots not yet whole
    partial: dict[int, dict[int, tuple[np.ndarray, np.ndarray]]] = field(default_factory=dict)
    logs: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)  # while a listing is replayed

    def apply_log(self, seq: int, keys, codes) -> Diff:
        """A log record (keys, codes as bytes or arrays); one at or below ``seq`` is already folded in and is
        skipped."""
        if seq <= self.seq:
            return _NONE, _NONE
        keys, codes = _last_wins(keys, codes)
        gone = codes == GONE
        held = self.blocks.transform(keys, lambda _: codes, absent=GONE)
        self.seq = seq
        return keys[~held & ~gone], keys[held & gone]

    def add_snapshot_part(self, key: HoldingsKey, keys, codes) -> Diff | None:
        """One part of snapshot ``key.seq``; once every part is in and it is newer than ``seq``, it replaces
        the blocks (returns what changed), else None."""
        if key.seq <= self.seq:
            return None
        parts = self.partial.setdefault(key.seq, {})
        parts[key.part] = (keys, codes)
        if len(parts) < key.num_parts:
            return None
        new_keys, new_codes = _last_wins(np.concatenate([as_keys(k) for k, _ in parts.values()]),
                                         np.concatenate([np.frombuffer(c, np.uint8) if isinstance(c, bytes)
                                                         else c for _, c in parts.values()]))
        new_keys, new_codes = new_keys[new_codes != GONE], new_codes[new_codes != GONE]
        blocks = KeyMap(len(new_keys))
        blocks.put_many(new_keys, new_codes)
        old, old_keys = self.blocks, self.blocks.keys()
        self.blocks, self.seq = blocks, key.seq
        self.partial = {s: p for s, p in self.partial.items() if s > key.seq}
        return new_keys[~old.contains_many(new_keys)], old_keys[~blocks.contains_many(old_keys)]

    def finish_replay(self) -> Diff:
        """After a listing: the logs it held past the newest whole snapshot, in order."""
        logs, self.logs = self.logs, {}
        if not logs:
            return _NONE, _NONE
        before = self.blocks.keys().copy()
        for seq in sorted(logs):
            self.apply_log(seq, *logs[seq])
        after = self.blocks.keys()
        return np.setdiff1d(after, before, assume_unique=True), np.setdiff1d(before, after, assume_unique=True)


def _slots_of(bits: int) -> tuple[int, ...]:
    """The node slots of a holder-set bitmask, ascending."""
    slots = []
    while bits:
        bit = bits & -bits
        bits ^= bit
        slots.append(bit.bit_length() - 1)
    return tuple(slots)


class HoldingsTable:
    """Every node's holdings and, per block key, the set of nodes holding it (a bitmask of node slots, interned:
    the block's entry holds the set's number), so a lookup probes one map per step of its binary search whatever
    the number of nodes. Written by one thread (the mirror's); lookups from others read it without a lock (an
    answer may be a moment stale, which the index tolerates)."""

    def __init__(self):
        self.nodes: dict[str, NodeHoldings] = {}
        self._slot_of: dict[str, int] = {}
        self._node_at: list[str | None] = []
        self._holders = KeyMap()  # block key -> number of its holder set
        self._sets: list[int] = [0]  # holder set number -> bitmask of node slots; 0 is the empty set
        self._set_slots: list[tuple[int, ...]] = [()]  # the same sets as ascending slot numbers (the C search's)
        self._set_number: dict[int, int] = {0: 0}
        self._max_sets = _MIN_MAX_SETS
        # (first block key, node bit) -> the length a lookup found last: tried first, with two probes
        self._hints: dict[tuple[int, int], int] = {}
        self._native = native_search.load()  # the search in C where it builds (same answers)
        self._guesses: dict[bytes, tuple[int, ...]] = {}  # first block hash -> where its holder set changed last

    def __len__(self) -> int:
        """(block, holder) pairs listed."""
        return sum(len(s.blocks) for s in list(self.nodes.values()))

    @property
    def nbytes(self) -> int:
        """Bytes held in the block maps (the Python objects around them excluded)."""
        return self._holders.nbytes + sum(s.blocks.nbytes for s in list(self.nodes.values()))

    def state(self, node_id: str) -> NodeHoldings:
        state = self.nodes.get(node_id)
        if state is None:
            state = self.nodes[node_id] = NodeHoldings()
            free = next((i for i, n in enumerate(self._node_at) if n is None), len(self._node_at))
            if free == len(self._node_at):
                self._node_at.append(None)
            self._node_at[free], self._slot_of[node_id] = node_id, free
        return state

    def _numbers(self, old_numbers: np.ndarray, change) -> np.ndarray:
        """The holder-set numbers of ``change(old set)`` for each old number (sets interned on first sight)."""
        unique, inverse = np.unique(old_numbers, return_inverse=True)
        sets, number_of = self._sets, self._set_number
        new = np.empty(len(unique), dtype=np.int64)
        for i, old in enumerate(unique.tolist()):
            bits = change(sets[old])
            number = number_of.get(bits)
            if number is None:
                number = number_of[bits] = len(sets)
                self._set_slots.append(_slots_of(bits))
                sets.append(bits)
            new[i] = number
        return new[inverse]

    def change(self, node_id: str, diff: Diff | None) -> None:
        """Reflect what ``node_id`` newly holds and no longer holds in the blocks' holder sets."""
        if not diff:
            return
        bit, holders = 1 << self._slot_of[node_id], self._holders
        added, removed = diff
        if len(added):
            holders.transform(added, lambda numbers: self._numbers(numbers, lambda bits: bits | bit))
        if len(removed):
            holders.transform(removed, lambda numbers: self._numbers(numbers, lambda bits: bits & ~bit))
        if len(self._sets) > self._max_sets:
            self._renumber_sets()

    def _renumber_sets(self) -> None:
        """Forget holder sets no block has any more (nodes come and go; each change interns new sets)."""
        keys, numbers = self._holders.items()
        live, inverse = np.unique(numbers, return_inverse=True)
        sets = [0] + [self._sets[n] for n in live.tolist() if n]
        renumbered = np.arange(len(live), dtype=np.uint64) + (0 if live[:1].tolist() == [0] else 1)
        self._holders.put_many(keys, renumbered[inverse])
        self._set_slots = [_slots_of(bits) for bits in sets]
        self._sets, self._set_number = sets, {bits: n for n, bits in enumerate(sets)}
        self._max_sets = max(_MIN_MAX_SETS, 4 * len(sets))

    def check_integrity(self) -> None:
        """Raise AssertionError unless every block's holder set names exactly the nodes listing it (slow: tests)."""
        self._holders.check_integrity()
        expected: dict[int, int] = {}
        for node_id, state in self.nodes.items():
            state.blocks.check_integrity()
            bit = 1 << self._slot_of[node_id]
            for k in state.blocks.keys().tolist():
                expected[k] = expected.get(k, 0) | bit
        keys, numbers = self._holders.items()
        assert {k: self._sets[n] for k, n in zip(keys.tolist(), numbers.tolist())} == expected, "holder sets drifted"
        assert all(self._set_number[bits] == n for n, bits in enumerate(self._sets)), "set numbers drifted"
        assert self._set_slots == [_slots_of(bits) for bits in self._sets], "set slots drifted"

    def finish_replay(self) -> None:
        """After a listing was replayed: each node's logs past its newest whole snapshot, into the holder sets."""
        for node_id, state in list(self.nodes.items()):
            self.change(node_id, state.finish_replay())

    def remove(self, node_id: str) -> None:
        """``node_id`` is gone (its lease ended): forget everything it held."""
        state = self.nodes.get(node_id)
        if state is None:
            return
        self.change(node_id, (_NONE, state.blocks.keys().copy()))
        del self.nodes[node_id]
        self._node_at[self._slot_of.pop(node_id)] = None

    def lookup(self, block_hashes: Sequence[bytes], exclude: str = "") -> dict[str, int]:
        """node_id -> number of leading blocks of the chain it holds (nodes holding none omitted).

        What a node holds of a chain is a prefix (nodes publish whole chains and evict tails first; where the
        index is stale the answer is advisory anyway), so the holders of the first block are found by binary
        search, as groups: a group is the nodes still known to hold block ``lo`` and not block ``hi``, and each
        probe (one map read: the block's holder set) splits a group into those holding the middle block and
        those not, so nodes holding the same length share every probe. A node first tries the length found
        last time for the same first block (a shared system prompt's, mostly): two probes confirm it, or
        narrow its search. Where the C search builds (``chain_search.c``) one call finds the positions where
        the chain's holder set changes instead (sets only shrink along a chain) and names each node's length,
        with the same answers.
        """
        if not block_hashes:
            return {}
        native = self._native
        if native is not None and type(block_hashes) is list:  # one C call: the search, then each node's length
            first, guesses = block_hashes[0], self._guesses
            try:
                named, changes = native.holders(block_hashes, *self._holders.layout(), guesses.get(first, ()),
                                                self._set_slots, self._node_at, exclude)
            except OverflowError:  # more holder-set changes along the chain than the C search keeps
                pass
            else:
                if changes:
                    if len(guesses) >= MAX_HINTS:
                        guesses.clear()
                    guesses[first] = changes
                return named
        named, node_at = {}, self._node_at
        for bits, length in self._lengths_python(block_hashes).items():
            for slot in _slots_of(bits):
                node_id = node_at[slot] if slot < len(node_at) else None
                if node_id is not None and node_id != exclude:
                    named[node_id] = length
        return named

    def _lengths_python(self, block_hashes: Sequence[bytes]) -> dict[int, int]:
        """The same answer, probe by probe in Python (where the C search cannot be built)."""
        n = len(block_hashes)
        get, sets, unpack, hints = self._holders.reader(), self._sets, _KEY.unpack_from, self._hints
        first_key = unpack(block_hashes[0])[0]
        first = sets[get(first_key, 0)]
        if not first:
            return {}
        probed = {0: first}

        def nodes_at(i: int) -> int:
            v = probed.get(i)
            if v is None:
                v = probed[i] = sets[get(unpack(block_hashes[i])[0], 0)]
            return v

        lengths: dict[int, int] = {}  # bitmask of nodes -> the number of blocks each of them holds
        full = first & nodes_at(n - 1)
        if full:
            lengths[full] = n
        groups: dict[tuple[int, int], int] = {}  # (lo: held, hi: not held) -> bitmask of nodes
        rest = first & ~full
        while rest:
            bit = rest & -rest
            rest ^= bit
            lo, hi = 0, n - 1
            hint = hints.get((first_key, bit), 0)
            if 0 < hint < n - 1:
                if nodes_at(hint - 1) & bit:
                    lo = hint - 1
                    if not nodes_at(hint) & bit:
                        hi = hint
                else:
                    hi = hint - 1
            groups[lo, hi] = groups.get((lo, hi), 0) | bit
        stack = [(lo, hi, bits) for (lo, hi), bits in groups.items()]
        while stack:
            lo, hi, bits = stack.pop()
            if hi - lo <= 1:
                lengths[bits] = lo + 1
                continue
            mid = (lo + hi) // 2
            held = nodes_at(mid) & bits
            if held:
                stack.append((mid, hi, held))
            if held != bits:
                stack.append((lo, mid, bits ^ held))
        if len(hints) >= MAX_HINTS:
            hints.clear()
        for bits, length in lengths.items():
            while bits and length < n:
                bit = bits & -bits
                bits ^= bit
                hints[first_key, bit] = length
        return lengths

    def slowest_tier(self, block_hashes: Sequence[bytes], node_id: str) -> int:
        """The slowest tier ``node_id`` holds these blocks in (0 when it lists none)."""
        state = self.nodes.get(node_id)
        if state is None:
            return 0
        if not block_hashes:
            return 0
        joined = b"".join(block_hashes)
        if len(joined) == 16 * len(block_hashes):
            keys = np.frombuffer(joined, dtype="<u8")[::2]
        else:
            keys = [block_key(h) for h in block_hashes]
        return int(state.blocks.get_many(keys, 0).max())
