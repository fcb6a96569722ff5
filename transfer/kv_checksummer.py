"""KVChecksummer: the crc32 of KV blocks and of host memory, long lists split among a few threads.

One per node, made before the parts that use it: the node's ``BlockChecksums`` (the stored crc32 of cached
blocks, which its lower tiers read and fill too) computes through it, and the transfer agent checks what
lands and what it sends with it. A GPU's blocks are checksummed by one kernel launch on the GPU (no block
copied to the host); host memory on the calling thread, or on the checksum threads for long lists (the crc32
library and zlib release the GIL). ``close`` stops the threads.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from kvmesh.kv import fast_crc
from kvmesh.openmp_pool import serial_this_thread

_PARALLEL_CHECKSUM_BYTES = 8 * 2**20  # shorter lists are checksummed on the calling thread


class KVChecksummer:
    def __init__(self, kv_buffer: torch.Tensor, name: str = "kv"):
        """``kv_buffer``: the node's KV blocks [num_blocks, ...] (a block's bytes are contiguous)."""
        self.kv_buffer = kv_buffer
        self.block_bytes = kv_buffer[0].numel() * kv_buffer.element_size()
        self._num_threads = min(4, os.cpu_count() or 1)
        self._threads = ThreadPoolExecutor(self._num_threads, thread_name_prefix=f"kvmesh-crc-{name}",
                                           initializer=serial_this_thread) \
            if self._num_threads > 1 else None

    def per_block(self, fn: Callable[[list], list[int]], items: list) -> list[int]:
        """``fn(items)`` (one value per block), a long list split among the checksum threads."""
        if len(items) * self.block_bytes < _PARALLEL_CHECKSUM_BYTES or self._threads is None:
            return fn(items)
        n = self._num_threads
        parts = [items[i * len(items) // n:(i + 1) * len(items) // n] for i in range(n)]
        return [c for part in self._threads.map(fn, parts) for c in part]

    def addresses(self, addrs: list[int]) -> list[int]:
        """crc32 of the block-sized host memory at each address (a lower tier's, the host-visible KV memory)."""
        return self.per_block(lambda part: fast_crc.crc32_at(part, self.block_bytes), addrs)

    def kv_blocks(self, block_ids: list[int]) -> list[int]:
        """crc32 of KV blocks where the KV buffer lives."""
        if self.kv_buffer.is_cuda:
            return fast_crc.crc32_blocks(self.kv_buffer, block_ids)
        return self.per_block(lambda part: fast_crc.crc32_blocks(self.kv_buffer, part), block_ids)

    def close(self) -> None:
        if self._threads is not None:
            self._threads.shutdown(wait=True)
