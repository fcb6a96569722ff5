"""Torch reference: write new K/V into blocks, pack and unpack block runs.

The KV buffer is block-major, ``[num_blocks, num_layers, 2, block_size, H_kv, D]``;
one layer's K (or V) is the strided view ``kv[:, layer, 0]`` of shape
``[num_blocks, block_size, H_kv, D]``.
"""
from __future__ import annotations

import torch


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``key``/``value`` [T, H_kv, D] into the caches at ``slot_mapping`` [T]; slot -1 is skipped."""
    block_size = k_cache.shape[1]
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    block_ids = torch.div(slot_mapping, block_size, rounding_mode="floor")
    offsets = slot_mapping % block_size
    k_cache[block_ids, offsets] = key.to(k_cache.dtype)
    v_cache[block_ids, offsets] = value.to(v_cache.dtype)


def store_kv_at(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                block_ids: torch.Tensor, offsets: torch.Tensor) -> None:
    """``store_kv`` with the slots already split into (block, offset) int64 tensors, every row stored."""
    k_cache[block_ids, offsets] = key.to(k_cache.dtype)
    v_cache[block_ids, offsets] = value.to(v_cache.dtype)


def pack_blocks(kv_buffer: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Copy whole blocks ``kv_buffer[block_ids]`` into one contiguous staging tensor."""
    packed = kv_buffer.index_select(0, block_ids.to(torch.int64))
    if out is None:
        return packed
    out.copy_(packed)
    return out


def unpack_blocks(kv_buffer: torch.Tensor, block_ids: torch.Tensor, packed: torch.Tensor) -> None:
    """Scatter a staging tensor of whole blocks back into ``kv_buffer[block_ids]``."""
    kv_buffer.index_copy_(0, block_ids.to(torch.int64), packed.to(kv_buffer.dtype))
