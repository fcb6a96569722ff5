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

from kvmesh.metadata.keys import HoldingsKey
from kvmesh.metadata.records import RecordError

GONE = 255  # a log entry's code for "no longer held"; 0, 1, 2 are tiers (compute buffer, host memory, disk)
LOG, SNAPSHOT = "l", "s"
MAX_HINTS = 1 << 16  # remembered lookup lengths (cleared when full)
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


def decode_record(data: bytes) -> tuple[list[int], bytes]:
    """The record's keys and codes; RecordError when it is not one."""
    if len(data) < _HEADER.size:
        raise RecordError("holdings record: too short")
    magic, count = _HEADER.unpack_from(data)
    if magic != _MAGIC or len(data) != _HEADER.size + 9 * count:
        raise RecordError("holdings record: bad magic or length")
    keys = array("Q")
    keys.frombytes(data[_HEADER.size : _HEADER.size + 8 * count])
    if sys.byteorder != "little":  # pragma: no cover
        keys.byteswap()
    codes = data[_HEADER.size + 8 * count :]
    if any(c > 2 and c != GONE for c in set(codes)):
        raise RecordError("holdings record: unknown entry code")
    return keys.tolist(), codes


Diff = tuple[list[int], list[int]]  # (block keys newly held, block keys no longer held)


@dataclass(slots=True)
class NodeHoldings:
    """One node's holdings as a reader knows them: block key -> fastest tier, as of record ``seq``."""

    blocks: dict[int, int] = field(default_factory=dict)
    seq: int = -1
    keys: set[str] = field(default_factory=set)  # the node's record keys in etcd now (none left: it is gone)
    # snapshot seq -> part -> (keys, codes): parts seen of snapshots not yet whole
    partial: dict[int, dict[int, tuple[list[int], bytes]]] = field(default_factory=dict)
    logs: dict[int, tuple[list[int], bytes]] = field(default_factory=dict)  # while a listing is replayed

    def apply_log(self, seq: int, keys: list[int], codes: bytes) -> Diff:
        """A log record; one at or below ``seq`` is already folded in and is skipped."""
        added, removed = [], []
        if seq <= self.seq:
            return added, removed
        blocks = self.blocks
        for k, c in zip(keys, codes):
            if c == GONE:
                if blocks.pop(k, None) is not None:
                    removed.append(k)
            else:
                if k not in blocks:
                    added.append(k)
                blocks[k] = c
        self.seq = seq
        return added, removed

    def add_snapshot_part(self, key: HoldingsKey, keys: list[int], codes: bytes) -> Diff | None:
        """One part of snapshot ``key.seq``; once every part is in and it is newer than ``seq``, it replaces
        the blocks (returns what changed), else None."""
        if key.seq <= self.seq:
            return None
        parts = self.partial.setdefault(key.seq, {})
        parts[key.part] = (keys, codes)
        if len(parts) < key.num_parts:
            return None
        blocks: dict[int, int] = {}
        for part_keys, part_codes in parts.values():
            blocks.update(zip(part_keys, part_codes))
        old, self.blocks, self.seq = self.blocks, blocks, key.seq
        self.partial = {s: p for s, p in self.partial.items() if s > key.seq}
        return [k for k in blocks if k not in old], [k for k in old if k not in blocks]

    def finish_replay(self) -> Diff:
        """After a listing: the logs it held past the newest whole snapshot, in order."""
        logs, self.logs = self.logs, {}
        added, removed = set(), set()
        for seq in sorted(logs):
            a, r = self.apply_log(seq, *logs[seq])
            added.update(a)
            removed.difference_update(a)
            removed.update(r)
            added.difference_update(r)
        return list(added), list(removed)


class HoldingsTable:
    """Every node's holdings and, per block key, a bitmask of the nodes holding it (one slot per node), so a
    lookup probes one dict per step of its binary search whatever the number of nodes. Written by one
    thread (the mirror's); lookups from others read it without a lock (each dict operation is atomic; an
    answer may be a moment stale, which the index tolerates)."""

    def __init__(self):
        self.nodes: dict[str, NodeHoldings] = {}
        self._slot_of: dict[str, int] = {}
        self._node_at: list[str | None] = []
        self._holders: dict[int, int] = {}  # block key -> bitmask of node slots
        # (first block key, node bit) -> the length a lookup found last: tried first, with two probes
        self._hints: dict[tuple[int, int], int] = {}

    def __len__(self) -> int:
        """(block, holder) pairs listed."""
        return sum(len(s.blocks) for s in list(self.nodes.values()))

    def state(self, node_id: str) -> NodeHoldings:
        state = self.nodes.get(node_id)
        if state is None:
            state = self.nodes[node_id] = NodeHoldings()
            free = next((i for i, n in enumerate(self._node_at) if n is None), len(self._node_at))
            if free == len(self._node_at):
                self._node_at.append(None)
            self._node_at[free], self._slot_of[node_id] = node_id, free
        return state

    def change(self, node_id: str, diff: Diff | None) -> None:
        """Reflect what ``node_id`` newly holds and no longer holds in the per-block bitmasks."""
        if not diff:
            return
        bit, holders = 1 << self._slot_of[node_id], self._holders
        added, removed = diff
        for k in added:
            holders[k] = holders.get(k, 0) | bit
        for k in removed:
            v = holders.get(k, 0) & ~bit
            if v:
                holders[k] = v
            else:
                holders.pop(k, None)

    def finish_replay(self) -> None:
        """After a listing was replayed: each node's logs past its newest whole snapshot, into the bitmasks."""
        for node_id, state in list(self.nodes.items()):
            self.change(node_id, state.finish_replay())

    def remove(self, node_id: str) -> None:
        """``node_id`` is gone (its lease ended): forget everything it held."""
        state = self.nodes.get(node_id)
        if state is None:
            return
        self.change(node_id, ([], list(state.blocks)))
        del self.nodes[node_id]
        self._node_at[self._slot_of.pop(node_id)] = None

    def lookup(self, block_hashes: Sequence[bytes], exclude: str = "") -> dict[str, int]:
        """node_id -> number of leading blocks of the chain it holds (nodes holding none omitted).

        What a node holds of a chain is a prefix (nodes publish whole chains and evict tails first; where the
        index is stale the answer is advisory anyway), so each holder of the first block gets a binary search;
        the searches run together, each probe (one dict read: the bitmask of the block's holders) narrowing
        every search it falls inside, so holders of the same length share all their probes. A search first
        tries the length found last time for the same first block and node (a shared system prompt's, mostly):
        two probes confirm it, or narrow the search.
        """
        n = len(block_hashes)
        if not n:
            return {}
        holders, unpack, hints = self._holders, _KEY.unpack_from, self._hints
        first_key = unpack(block_hashes[0])[0]
        first = holders.get(first_key, 0)
        if not first:
            return {}
        probed = {0: first, n - 1: holders.get(unpack(block_hashes[n - 1])[0], 0)}

        def nodes_at(i: int) -> int:
            v = probed.get(i)
            if v is None:
                v = probed[i] = holders.get(unpack(block_hashes[i])[0], 0)
            return v

        searches = []  # [lo (held), hi (not held), bit]
        out, node_at = {}, self._node_at
        while first:
            bit = first & -first
            first ^= bit
            if probed[n - 1] & bit:
                out[bit] = n
                continue
            search = [0, n - 1, bit]
            hint = hints.get((first_key, bit), 0)
            if 0 < hint < n - 1:
                if nodes_at(hint - 1) & bit:
                    search[0] = hint - 1
                    if not nodes_at(hint) & bit:
                        search[1] = hint
                else:
                    search[1] = hint - 1
            searches.append(search)
        for search in searches:
            while search[1] - search[0] > 1:
                mid = (search[0] + search[1]) // 2
                at = nodes_at(mid)
                for other in searches:  # this probe narrows every search it falls inside
                    if other[0] < mid < other[1]:
                        other[0 if at & other[2] else 1] = mid
            out[search[2]] = search[0] + 1
            if len(hints) >= MAX_HINTS:
                hints.clear()
            hints[first_key, search[2]] = search[0] + 1
        named = {}
        for bit, length in out.items():
            slot = bit.bit_length() - 1
            node_id = node_at[slot] if slot < len(node_at) else None
            if node_id is not None and node_id != exclude:
                named[node_id] = length
        return named

    def slowest_tier(self, block_hashes: Sequence[bytes], node_id: str) -> int:
        """The slowest tier ``node_id`` holds these blocks in (0 when it lists none)."""
        state = self.nodes.get(node_id)
        if state is None:
            return 0
        get = state.blocks.get
        return max((get(block_key(h), 0) for h in block_hashes), default=0)
