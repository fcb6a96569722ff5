"""The one registered KV buffer of a node (docs/design.md §3).

    kv[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
       block b = kv[b]: every layer's K and V of block_size positions, contiguous

A run of consecutive block ids is therefore one contiguous byte range whatever
the depth of the model: one transfer descriptor per run. Attention reads a layer
as the strided view ``kv[:, layer, 0]`` (K) / ``kv[:, layer, 1]`` (V).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvmesh.model.config import ModelConfig


@dataclass(frozen=True)
class KVLayout:
    num_blocks: int
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_blocks, self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    def allocate(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """Zeroed buffer (zeros keep never-written slots finite for masked kernels)."""
        return torch.zeros(self.shape, dtype=self.dtype, device=device)

    @classmethod
    def for_model(cls, config: ModelConfig, dtype: torch.dtype, block_size: int, *,
                  num_blocks: int | None = None, memory_bytes: int | None = None) -> KVLayout:
        """Size by an explicit ``num_blocks`` or by the blocks that fit ``memory_bytes``."""
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        layout = cls(num_blocks or 1, config.num_layers, block_size, config.num_kv_heads, config.head_dim, dtype)
        if num_blocks is None:
            if memory_bytes is None:
                raise ValueError("give num_blocks or memory_bytes")
            num_blocks = memory_bytes // layout.bytes_per_block
        if num_blocks < 1:
            raise ValueError(f"a KV buffer of {num_blocks} blocks is empty (block of {layout.bytes_per_block} bytes)")
        return cls(num_blocks, config.num_layers, block_size, config.num_kv_heads, config.head_dim, dtype)
