"""A plain free-list block allocator (the prefix-caching block pool replaces it in kvmesh.kv)."""
from __future__ import annotations

from kvmesh.errors import OutOfBlocksError


class SimpleBlockAllocator:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free_ids = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._used = [False] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_ids)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free_ids)

    def allocate(self, num_blocks: int) -> list[int]:
        if not self.can_allocate(num_blocks):
            raise OutOfBlocksError(f"asked for {num_blocks} blocks, {len(self._free_ids)} free of {self.num_blocks}")
        ids = [self._free_ids.pop() for _ in range(num_blocks)]
        for i in ids:
            self._used[i] = True
        return ids

    def free(self, block_ids: list[int]) -> None:
        for i in block_ids:
            if not self._used[i]:
                raise ValueError(f"block {i} freed twice")
            self._used[i] = False
        self._free_ids.extend(reversed(block_ids))

    def check_integrity(self) -> None:
        num_used = sum(self._used)
        assert num_used + len(self._free_ids) == self.num_blocks, "free + used != total"
        assert len(set(self._free_ids)) == len(self._free_ids), "a block is free twice"
        assert not any(self._used[i] for i in self._free_ids), "a used block is on the free list"
