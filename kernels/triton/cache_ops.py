"""Triton kernels: write new K/V into blocks by slot, copy whole blocks (pack/unpack)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    key_stride_t, key_stride_h, value_stride_t, value_stride_h,
    cache_stride_block, cache_stride_pos, cache_stride_h,
    num_heads, head_dim, block_size,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:  # padding token: nothing to store
        return
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < num_heads) & (dims < head_dim)
    block = slot // block_size
    offset = slot % block_size
    dst = block * cache_stride_block + offset * cache_stride_pos + heads * cache_stride_h + dims
    k = tl.load(key_ptr + token * key_stride_t + heads * key_stride_h + dims, mask=mask)
    v = tl.load(value_ptr + token * value_stride_t + heads * value_stride_h + dims, mask=mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Same contract as ``kernels.reference.cache_ops.store_kv``."""
    num_tokens, num_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    assert key.stride(-1) == 1 and value.stride(-1) == 1 and k_cache.stride(-1) == 1
    assert k_cache.stride() == v_cache.stride()
    _store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        num_heads, head_dim, k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_D=triton.next_power_of_2(head_dim),
    )


@triton.jit
def _copy_blocks_kernel(src_ptr, dst_ptr, src_ids_ptr, dst_ids_ptr, block_numel, CHUNK: tl.constexpr):
    pair = tl.program_id(0)
    chunk = tl.program_id(1)
    src_block = tl.load(src_ids_ptr + pair).to(tl.int64)
    dst_block = tl.load(dst_ids_ptr + pair).to(tl.int64)
    offsets = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = offsets < block_numel
    data = tl.load(src_ptr + src_block * block_numel + offsets, mask=mask)
    tl.store(dst_ptr + dst_block * block_numel + offsets, data, mask=mask)


def copy_blocks(src: torch.Tensor, src_ids: torch.Tensor, dst: torch.Tensor, dst_ids: torch.Tensor) -> None:
    """``dst[dst_ids[i]] = src[src_ids[i]]`` for whole blocks of two contiguous block-major tensors."""
    assert src.is_contiguous() and dst.is_contiguous() and src.dtype == dst.dtype
    assert src.shape[1:] == dst.shape[1:]
    num_pairs = src_ids.numel()
    if num_pairs == 0:
        return
    block_numel = src[0].numel()
    chunk = min(4096, triton.next_power_of_2(block_numel))
    grid = (num_pairs, triton.cdiv(block_numel, chunk))
    _copy_blocks_kernel[grid](src, dst, src_ids, dst_ids, block_numel, CHUNK=chunk)


def pack_blocks(kv_buffer: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    if out is None:
        out = torch.empty((block_ids.numel(), *kv_buffer.shape[1:]), dtype=kv_buffer.dtype, device=kv_buffer.device)
    order = torch.arange(block_ids.numel(), device=block_ids.device, dtype=block_ids.dtype)
    copy_blocks(kv_buffer, block_ids, out, order)
    return out


def unpack_blocks(kv_buffer: torch.Tensor, block_ids: torch.Tensor, packed: torch.Tensor) -> None:
    order = torch.arange(block_ids.numel(), device=block_ids.device, dtype=block_ids.dtype)
    copy_blocks(packed, order, kv_buffer, block_ids)
