"""BlockIndex: the block pool's hash records: which hash each block holds, the chains, and hash -> block.

Per block (int32 arrays the pool reads directly in its loops)::

    slot_of_block[b]   >= 0 while b holds a hash, -1 when not
    parents[b]         the block holding the previous hash of b's chain, -1 for a root (or no hash)
    num_children[b]    blocks whose parent b is (a block with children is never evicted)

and ``get(hash)`` -> the block holding it, ``chain(last, length)`` -> the blocks of a chain from its
last block up. Two implementations give the same answers:

- ``NativeBlockIndex``: an open-addressing table in numpy memory; records are changed and read by
  ``kernels/extensions/block_index.c`` (a CPython extension; see it for the layout). A run of new
  hashes, whatever its block ids, is recorded with one call that reads the caller's lists of digests
  and ids in place: no Python object or loop per block.
- ``DictBlockIndex``: a dict and a list of hashes per block, in Python; where the extension does not
  build, or ``KVMESH_BLOCK_INDEX=dict``.

``make_block_index`` picks. The index holds no lock: the pool calls it under its own.
"""
from __future__ import annotations

import ctypes
import os
from array import array
from collections.abc import Iterator, Sequence
from types import ModuleType
from typing import NamedTuple, Protocol

import numpy as np

from kvmesh.kernels.extensions import loader as extensions
from kvmesh.kv.block_hash import BlockHash

NOT_HELD = -2  # remove_blocks: the block held no hash
ADDED = -1  # add_run: every hash recorded; i >= 0: hash i already held; <= -2: block (-2 - result) holds one
NO_BLOCK = -1


class Removed(NamedTuple):
    block_hash: BlockHash
    parent: int  # NO_BLOCK for a root


class RemovedBlocks(NamedTuple):
    """What ``remove_blocks`` did, per block asked: ``parents[i]`` is NOT_HELD when block i held no hash, else
    its parent (NO_BLOCK for a root) with its hash at ``hashes[16 i : 16 i + 16]`` and, when it had a parent,
    the parent's at ``parent_hashes[16 i : 16 i + 16]`` (joined: sliced only by callers that need them)."""
    parents: list[int]
    hashes: bytes
    parent_hashes: bytes
    num_removed: int


class BlockIndex(Protocol):
    block_ids: list[int]  # list(range(num_blocks)): the pool hands out these int objects, chain slices them
    slot_of_block: array
    parents: array
    num_children: array

    def get(self, block_hash: BlockHash) -> int | None:
        """The block holding ``block_hash``, or None."""

    def hash_of(self, block_id: int) -> BlockHash | None:
        """The hash ``block_id`` holds, or None."""

    def add_run(self, block_hashes: Sequence[BlockHash], block_ids: Sequence[int], consecutive: bool,
                parent: int) -> int:
        """Record ``block_hashes[i]`` in ``block_ids[i]``, chained (the first block's parent is ``parent``),
        all or none; ``consecutive``: the ids are ``block_ids[0], block_ids[0] + 1, ...``. Returns
        ``ADDED``; else the position of the first hash already held (or repeated), or ``-2 - i`` when
        block ``i`` of the run already holds a hash, and nothing changed."""

    def remove_block(self, block_id: int) -> Removed | None:
        """Forget ``block_id``'s hash and links (it must have no children); None if it held none."""

    def remove_blocks(self, block_ids: Sequence[int], with_hashes: bool = True) -> RemovedBlocks:
        """``remove_block`` for each of ``block_ids`` in order (an eviction's victims: leaves, or parents of
        blocks removed before them in the list); ``with_hashes`` False: the caller needs no hashes (they may
        come back empty)."""

    def take_free(self, next_ids: list[int], prev_ids: list[int], num: int, ref: list[int], epoch: list[int],
                  with_hashes: bool = True) -> tuple[list[int], RemovedBlocks]:
        """Allocation from the pool's free queue (``next_ids`` / ``prev_ids``: its links, the sentinel at index
        ``num_blocks``): unlink the ``num`` least recently used free blocks that are no cached block's parent,
        counting as gone the digests of those taken before, remove their digests, and set each one's ``ref`` to 1
        and bump its ``epoch``. Returns the blocks in ascending order and ``remove_blocks``'s answer for them in
        the order taken (a parent after its children; no digests unless ``with_hashes``). The caller checked
        the queue holds ``num`` blocks."""

    def count_held(self, block_ids: Sequence[int], block_hashes: Sequence[BlockHash]) -> int:
        """How many leading ``block_ids`` still hold ``block_hashes``."""

    def chain(self, last_block: int, length: int) -> list[int]:
        """The ``length`` blocks ending at ``last_block`` along the parent links, the root side first
        (the caller knows the chain is that long)."""

    def items(self) -> Iterator[tuple[BlockHash, int]]:
        """Every (hash, block) pair, in no order (for ``check_integrity``)."""

    def check_integrity(self) -> None:
        """Raise AssertionError unless the table and the per-block records agree."""

    def __len__(self) -> int: ...


def make_block_index(num_blocks: int) -> BlockIndex:
    """The native index where the library loads and ``KVMESH_BLOCK_INDEX`` is not ``dict``, else the dict."""
    choice = os.environ.get("KVMESH_BLOCK_INDEX", "auto")
    if choice not in ("auto", "native", "dict"):
        raise ValueError(f"KVMESH_BLOCK_INDEX={choice!r}: expected auto, native or dict")
    if choice != "dict":
        ext = extensions.load("block_index")
        if ext is not None:
            return NativeBlockIndex(num_blocks, ext)
        if choice == "native":
            raise RuntimeError("KVMESH_BLOCK_INDEX=native, but the native block index did not build (see the log)")
    return DictBlockIndex(num_blocks)


def _int32s(num: int, value: int) -> array:
    return array("i", [value]) * num


def _no_block(block_id: int, num_blocks: int):
    raise IndexError(f"block {block_id} is not one of this pool's {num_blocks}")


class DictBlockIndex:
    def __init__(self, num_blocks: int):
        self.block_ids = list(range(num_blocks))
        self.slot_of_block, self.parents, self.num_children = (_int32s(num_blocks, v) for v in (-1, NO_BLOCK, 0))
        self._hashes: list[BlockHash | None] = [None] * num_blocks
        self._ids, self._zeros, self._ones = array("i", range(num_blocks)), _int32s(num_blocks, 0), \
            _int32s(num_blocks, 1)  # sources of the slice writes of consecutive runs
        self._blocks: dict[BlockHash, int] = {}
        self.get = self._blocks.get

    def hash_of(self, block_id: int) -> BlockHash | None:
        return self._hashes[block_id]

    def add_run(self, block_hashes: Sequence[BlockHash], block_ids: Sequence[int], consecutive: bool,
                parent: int) -> int:
        n = len(block_hashes)
        if n == 0:
            return ADDED
        if len(block_ids) != n:
            raise ValueError("one 16-byte hash per block expected")
        refused = self._refusal(block_hashes, block_ids, consecutive, parent)
        if refused is not None:
            return refused
        slots, hashes, parents, num_children = self.slot_of_block, self._hashes, self.parents, self.num_children
        if parent != NO_BLOCK:
            num_children[parent] += 1
        if consecutive:  # slice writes; a block holding no hash was nobody's parent
            first = block_ids[0]
            hashes[first : first + n] = block_hashes
            slots[first : first + n] = self._zeros[:n]
            parents[first + 1 : first + n] = self._ids[first : first + n - 1]
            parents[first] = parent
            num_children[first : first + n - 1] = self._ones[: n - 1]
            return ADDED
        for b, h in zip(block_ids, block_hashes):
            hashes[b] = h
            slots[b] = 0
            parents[b] = parent
            parent = b
        for b in block_ids[:-1]:
            num_children[b] = 1
        return ADDED

    def _refusal(self, block_hashes: Sequence[BlockHash], block_ids: Sequence[int], consecutive: bool,
                 parent: int) -> int | None:
        """``add_run``'s answer when it refuses the run (nothing recorded then); None after the hashes went
        into the dict (the caller writes the per-block records)."""
        blocks, slots, n = self._blocks, self.slot_of_block, len(block_hashes)
        first, last = (block_ids[0], block_ids[-1]) if consecutive else (min(block_ids), max(block_ids))
        if first < 0 or last >= len(slots) or parent >= len(slots):
            raise IndexError(f"a block of {list(block_ids)} (parent {parent}) is not one of this pool's {len(slots)}")
        if slots[first : first + n].count(-1) != n if consecutive else any(slots[b] >= 0 for b in block_ids):
            return -2 - next(i for i, b in enumerate(block_ids) if slots[b] >= 0)
        if not blocks.keys().isdisjoint(block_hashes):
            return next(i for i, h in enumerate(block_hashes) if h in blocks)
        before = len(blocks)
        blocks.update(zip(block_hashes, block_ids))  # then count: cheaper than a set of the hashes first
        if len(blocks) == before + n and (consecutive or len(set(block_ids)) == n):
            return None
        for h in block_hashes:  # something twice in the run: take the hashes back out, say where
            blocks.pop(h, None)
        seen_hashes: set[BlockHash] = set()
        seen_blocks: set[int] = set()
        for i, (h, b) in enumerate(zip(block_hashes, block_ids)):
            if h in seen_hashes or b in seen_blocks:
                return i if h in seen_hashes else -2 - i
            seen_hashes.add(h)
            seen_blocks.add(b)
        raise AssertionError("a repeat was counted but not found")  # pragma: no cover

    def remove_block(self, block_id: int) -> Removed | None:
        h = self._hashes[block_id]
        if h is None:
            return None
        del self._blocks[h]
        self._hashes[block_id] = None
        self.slot_of_block[block_id] = -1
        parent = self.parents[block_id]
        if parent != NO_BLOCK:
            self.num_children[parent] -= 1
        self.parents[block_id] = NO_BLOCK
        return Removed(h, parent)

    def remove_blocks(self, block_ids: Sequence[int], with_hashes: bool = True) -> RemovedBlocks:
        parents, hashes, parent_hashes, num_removed = [], [], [], 0
        for b in block_ids:
            h = self._hashes[b] if 0 <= b < len(self._hashes) else _no_block(b, len(self._hashes))
            parent = self.parents[b]
            parent_hash = self._hashes[parent] if h is not None and parent != NO_BLOCK else None
            if h is None:
                parents.append(NOT_HELD)
            else:
                self.remove_block(b)
                parents.append(parent)
                num_removed += 1
            hashes.append(h or bytes(16))
            parent_hashes.append(parent_hash or bytes(16))
        return RemovedBlocks(parents, b"".join(hashes), b"".join(parent_hashes), num_removed)

    def take_free(self, next_ids: list[int], prev_ids: list[int], num: int, ref: list[int], epoch: list[int],
                  with_hashes: bool = True) -> tuple[list[int], RemovedBlocks]:
        sentinel, nxt, prev, slot = len(self._hashes), next_ids, prev_ids, self.slot_of_block
        num_children, parent_of = self.num_children, self.parents
        taken: list[int] = []
        orphaned: dict[int, int] = {}
        skipped: set[int] = set()
        block = nxt[sentinel]
        while len(taken) < num:
            if block == sentinel:
                raise RuntimeError("free blocks left, but each is a cached block's parent")
            following = nxt[block]
            if num_children[block] > orphaned.get(block, 0):
                skipped.add(block)
            else:
                before = prev[block]
                nxt[before] = following
                prev[following] = before
                taken.append(block)
                parent = parent_of[block] if slot[block] >= 0 else NO_BLOCK
                if parent != NO_BLOCK:
                    orphaned[parent] = orphaned.get(parent, 0) + 1
                    if parent in skipped and num_children[parent] == orphaned[parent]:
                        following, skipped = nxt[sentinel], set()  # a block passed over is a leaf now
            block = following
        removed = self.remove_blocks(taken, with_hashes)
        for block in taken:
            ref[block] = 1
            epoch[block] += 1
        taken.sort()
        return taken, removed

    def count_held(self, block_ids: Sequence[int], block_hashes: Sequence[BlockHash]) -> int:
        num = 0
        for b, h in zip(block_ids, block_hashes):
            if self._hashes[b] != h:
                break
            num += 1
        return num

    def chain(self, last_block: int, length: int) -> list[int]:
        out, parents, block = [0] * length, self.parents, last_block
        for i in range(length - 1, -1, -1):
            if block < 0:
                raise ValueError(f"the chain ending at block {last_block} is shorter than {length}")
            out[i] = block
            block = parents[block]
        return out

    def items(self) -> Iterator[tuple[BlockHash, int]]:
        return iter(self._blocks.items())

    def check_integrity(self) -> None:
        for h, b in self._blocks.items():
            assert self._hashes[b] == h and self.slot_of_block[b] >= 0, f"block {b} does not hold its hash"
        assert sum(h is not None for h in self._hashes) == len(self._blocks), "stray block hash"

    def __len__(self) -> int:
        return len(self._blocks)


class _Records(ctypes.Structure):
    """``block_index_t`` of block_index.c: where the table and the per-block arrays live."""

    _fields_ = [("keys", ctypes.c_void_p), ("vals", ctypes.c_void_p), ("mask", ctypes.c_int64),
                ("slot_of_block", ctypes.c_void_p), ("parents", ctypes.c_void_p), ("num_children", ctypes.c_void_p),
                ("num_blocks", ctypes.c_int64)]


class NativeBlockIndex:
    """See ``kernels/extensions/block_index.c`` (a CPython extension: each call holds the GIL and reads the
    caller's lists in place); the table is at most half full by construction. The arrays it points into live
    as long as this object."""

    def __init__(self, num_blocks: int, ext: ModuleType):
        num_slots = 1 << max(4, (2 * num_blocks - 1).bit_length())
        self.slot_of_block, self.parents, self.num_children = (_int32s(num_blocks, v) for v in (-1, NO_BLOCK, 0))
        self._keys = np.zeros(2 * num_slots, dtype=np.uint64)
        self._keys.fill(0)  # fault the pages in now (zeros alone maps them lazily), not mid-insert
        self._vals = np.full(num_slots, -1, dtype=np.int32)
        self._records = _Records(self._keys.ctypes.data, self._vals.ctypes.data, num_slots - 1,
                                 *(a.buffer_info()[0] for a in (self.slot_of_block, self.parents, self.num_children)),
                                 num_blocks)
        self._ix = ctypes.addressof(self._records)
        self._num_blocks = num_blocks
        self.block_ids = list(range(num_blocks))
        self._num_entries = 0
        self._ext = ext
        self._find = ext.find

    def get(self, block_hash: BlockHash) -> int | None:
        block = self._find(self._ix, block_hash)
        return None if block < 0 else block

    def hash_of(self, block_id: int) -> BlockHash | None:
        return self._ext.digest_of(self._ix, block_id)

    def add_run(self, block_hashes: Sequence[BlockHash], block_ids: Sequence[int], consecutive: bool,
                parent: int) -> int:
        if not block_hashes:
            return ADDED
        if len(block_ids) != len(block_hashes):
            raise ValueError("one 16-byte hash per block expected")
        result = self._ext.add_run(self._ix, block_hashes, None if consecutive else block_ids, block_ids[0], parent)
        if result == ADDED:
            self._num_entries += len(block_hashes)
        elif result <= -2 and not all(0 <= b < self._num_blocks for b in (*block_ids, max(parent, 0))):
            raise IndexError(f"a block of {list(block_ids)} (parent {parent}) is not one of this pool's "
                             f"{self._num_blocks}")
        return result

    def remove_block(self, block_id: int) -> Removed | None:
        removed = self._ext.remove_block(self._ix, block_id)
        if removed is None:
            return None
        self._num_entries -= 1
        return Removed(removed[1], removed[0])

    def remove_blocks(self, block_ids: Sequence[int], with_hashes: bool = True) -> RemovedBlocks:
        if not block_ids:
            return RemovedBlocks([], b"", b"", 0)
        removed = RemovedBlocks(*self._ext.remove_blocks(self._ix, block_ids, with_hashes))
        self._num_entries -= removed.num_removed
        return removed

    def take_free(self, next_ids: list[int], prev_ids: list[int], num: int, ref: list[int], epoch: list[int],
                  with_hashes: bool = True) -> tuple[list[int], RemovedBlocks]:
        taken, parents, hashes, parent_hashes, num_removed = self._ext.take_free(
            self._ix, next_ids, prev_ids, self.block_ids, num, ref, epoch, with_hashes)
        self._num_entries -= num_removed
        return taken, RemovedBlocks(parents, hashes, parent_hashes, num_removed)

    def count_held(self, block_ids: Sequence[int], block_hashes: Sequence[BlockHash]) -> int:
        return self._ext.count_held(self._ix, block_ids, block_hashes)

    def chain(self, last_block: int, length: int) -> list[int]:
        return self._ext.chain(self._ix, last_block, length, self.block_ids)

    def items(self) -> Iterator[tuple[BlockHash, int]]:
        slots = np.flatnonzero(self._vals >= 0)
        digests = self._keys.reshape(-1, 2)[slots].tobytes()
        return zip(np.frombuffer(digests, dtype="V16").tolist(), self._vals[slots].tolist())

    def check_integrity(self) -> None:
        code = self._ext.check(self._ix)
        assert code == 0, f"native block index inconsistent (block_index_check: {code})"
        assert int((self._vals >= 0).sum()) == self._num_entries, "entry count drifted"

    def __len__(self) -> int:
        return self._num_entries
