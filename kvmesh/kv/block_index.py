"""BlockIndex: how the block pool finds blocks, by hash and by chain.

    get(hash)            -> the block holding the hash
    chain(last, length)  -> the ``length`` blocks of the chain ending at block ``last``, root side first,
                            read from the pool's parent links (``parents``, an int32 array it owns)

One small interface, two implementations that give the same answers:

- ``NativeBlockIndex``: a fixed-size open-addressing table in numpy memory, probed and walked by
  ``kernels/cpu/block_index.c``. A run of new hashes (a prompt's blocks) goes in with one call
  over the joined digests, and a matched chain's blocks come out of one walk: no Python object per
  entry, which is what a dict costs (~90 us to insert 2,048 blocks against ~13 here).
- ``DictBlockIndex``: a dict and a Python walk; where the native library is not loaded, or
  ``KVMESH_BLOCK_INDEX=dict``.

``make_block_index`` picks. The index holds no lock: the pool calls it under its own. It checks
nothing the pool already knows (a hash is in at most one block, a block holds at most one hash).
"""
from __future__ import annotations

import array
import ctypes
import os
from collections.abc import Iterator, Sequence
from typing import Protocol

import numpy as np

from kvmesh.kernels.cpu import library as native
from kvmesh.kv.block_hash import BlockHash

ADDED = -1  # add_run's answer when every hash went in


class BlockIndex(Protocol):
    def get(self, block_hash: BlockHash) -> int | None:
        """The block holding ``block_hash``, or None."""

    def add_run(self, block_hashes: Sequence[BlockHash], block_ids: Sequence[int], consecutive: bool) -> int:
        """Map ``block_hashes[i]`` to ``block_ids[i]``, all or none; ``consecutive``: the ids are
        ``block_ids[0], block_ids[0] + 1, ...`` (fresh allocations). Returns ``ADDED``, else the position
        of the first hash already held (or repeated in the run), and nothing is added."""

    def remove(self, block_hash: BlockHash) -> None:
        """Forget ``block_hash`` (which is held)."""

    def chain(self, last_block: int, length: int) -> list[int]:
        """The ``length`` blocks ending at ``last_block`` along the parent links, the root side first
        (the caller knows the chain is that long)."""

    def items(self) -> Iterator[tuple[BlockHash, int]]:
        """Every (hash, block) pair, in no order (for ``check_integrity``)."""

    def __len__(self) -> int: ...


def make_block_index(block_ids: list[int], parents: array.array) -> BlockIndex:
    """An index for a pool whose blocks are ``block_ids`` (``list(range(num_blocks))``) and whose parent
    links are ``parents`` (``array('i')``, never resized); both stay the pool's, read here. The native
    table where the library loads and ``KVMESH_BLOCK_INDEX`` is not ``dict``."""
    choice = os.environ.get("KVMESH_BLOCK_INDEX", "auto")
    if choice not in ("auto", "native", "dict"):
        raise ValueError(f"KVMESH_BLOCK_INDEX={choice!r}: expected auto, native or dict")
    if choice != "dict":
        lib = native.load_holding_gil()
        if lib is not None:
            return NativeBlockIndex(block_ids, parents, lib)
        if choice == "native":
            raise RuntimeError("KVMESH_BLOCK_INDEX=native, but the native library is not loaded (see the log)")
    return DictBlockIndex(parents)


class DictBlockIndex:
    def __init__(self, parents: array.array):
        self._blocks: dict[BlockHash, int] = {}
        self._parents = parents
        self.get = self._blocks.get

    def add_run(self, block_hashes: Sequence[BlockHash], block_ids: Sequence[int], consecutive: bool) -> int:
        blocks = self._blocks
        if not blocks.keys().isdisjoint(block_hashes):
            return next(i for i, h in enumerate(block_hashes) if h in blocks)
        before = len(blocks)
        blocks.update(zip(block_hashes, block_ids))
        if len(blocks) != before + len(block_hashes):  # a hash twice in the run: take the run back out
            for h in block_hashes:
                blocks.pop(h, None)
            seen: set[BlockHash] = set()
            return next(i for i, h in enumerate(block_hashes) if h in seen or seen.add(h))
        return ADDED

    def remove(self, block_hash: BlockHash) -> None:
        del self._blocks[block_hash]

    def chain(self, last_block: int, length: int) -> list[int]:
        out, parents, block = [0] * length, self._parents, last_block
        for i in range(length - 1, -1, -1):
            if block < 0:
                raise ValueError(f"the chain ending at block {last_block} is shorter than {length}")
            out[i] = block
            block = parents[block]
        return out

    def items(self) -> Iterator[tuple[BlockHash, int]]:
        return iter(self._blocks.items())

    def __len__(self) -> int:
        return len(self._blocks)


class NativeBlockIndex:
    """See ``kernels/cpu/block_index.c`` for the table's layout; at most half full by construction."""

    def __init__(self, block_ids: list[int], parents: array.array, lib: ctypes.PyDLL):
        num_slots = 1 << max(4, (2 * len(block_ids) - 1).bit_length())
        self._keys = np.zeros(2 * num_slots, dtype=np.uint64)
        self._keys.fill(0)  # fault the pages in now (zeros alone maps them lazily), not mid-insert
        self._vals = np.full(num_slots, -1, dtype=np.int32)
        self._table = (self._keys.ctypes.data, self._vals.ctypes.data, num_slots - 1)
        self._parents_ptr = parents.buffer_info()[0]
        self._out = np.empty(len(block_ids), dtype=np.int32)  # chain's answer, before it becomes a list
        self._out_ptr = self._out.ctypes.data
        self._block_ids = block_ids
        self._block_id_objects = np.array(block_ids, dtype=object)  # the same int objects, for a bulk take
        self._num_entries = 0
        self._find, self._chain = lib.block_index_find, lib.block_index_chain
        self._add_run, self._remove = lib.block_index_add_run, lib.block_index_remove

    def get(self, block_hash: BlockHash) -> int | None:
        block = self._find(*self._table, block_hash)
        return None if block < 0 else block

    def add_run(self, block_hashes: Sequence[BlockHash], block_ids: Sequence[int], consecutive: bool) -> int:
        if not block_hashes:
            return ADDED
        digests = b"".join(block_hashes)
        if len(digests) != 16 * len(block_hashes):
            raise ValueError("block hashes must be 16 bytes each")
        if consecutive:
            result = self._add_run(*self._table, digests, len(block_hashes), None, block_ids[0])
        else:
            ids = array.array("i", block_ids)
            result = self._add_run(*self._table, digests, len(block_hashes), ids.buffer_info()[0], 0)
        if result == ADDED:
            self._num_entries += len(block_hashes)
        return result

    def remove(self, block_hash: BlockHash) -> None:
        if self._remove(*self._table, block_hash) < 0:
            raise KeyError(block_hash)
        self._num_entries -= 1

    def chain(self, last_block: int, length: int) -> list[int]:
        consecutive = self._chain(self._parents_ptr, last_block, length, self._out_ptr)
        if consecutive < 0:
            raise ValueError(f"the chain ending at block {last_block} is shorter than {length}")
        if consecutive:  # one run of fresh allocations: a slice of the shared id list
            return self._block_ids[last_block - length + 1 : last_block + 1]
        return self._block_id_objects.take(self._out[:length]).tolist()

    def items(self) -> Iterator[tuple[BlockHash, int]]:
        for slot in np.flatnonzero(self._vals >= 0):
            yield self._keys[2 * slot : 2 * slot + 2].tobytes(), int(self._vals[slot])

    def __len__(self) -> int:
        return self._num_entries
