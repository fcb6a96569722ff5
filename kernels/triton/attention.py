"""Triton paged attention: prefill over a cached prefix (flash-style tiles) and batched decode.

Both read every key from the paged buffer, one KV block (``block_size`` positions)
per loop iteration, with an online softmax in float32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, out_ptr,
    scale, q_stride_t, q_stride_h, o_stride_t, o_stride_h, bt_stride_b,
    c_stride_block, c_stride_pos, c_stride_h,
    head_dim, group_size,
    BLOCK_M: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    tile = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if tile * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len
    kv_head = head // group_size

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < q_len
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < head_dim
    q_offsets = (q_start + rows)[:, None] * q_stride_t + head * q_stride_h + dims[None, :]
    q = tl.load(q_ptr + q_offsets, mask=row_mask[:, None] & dim_mask[None, :], other=0.0)
    q_pos = context_len + rows

    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    last_key = tl.minimum(context_len + (tile + 1) * BLOCK_M, seq_len)
    slots = tl.arange(0, BLOCK_SIZE)
    for j in range(0, tl.cdiv(last_key, BLOCK_SIZE)):
        block = tl.load(block_tables_ptr + seq * bt_stride_b + j).to(tl.int64)
        k_pos = j * BLOCK_SIZE + slots
        kv_offsets = block * c_stride_block + slots[:, None] * c_stride_pos + kv_head * c_stride_h + dims[None, :]
        kv_mask = (k_pos < seq_len)[:, None] & dim_mask[None, :]
        k = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0).to(q.dtype)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        visible = (k_pos[None, :] <= q_pos[:, None]) & (k_pos < seq_len)[None, :]
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        v = tl.load(v_cache_ptr + kv_offsets, mask=kv_mask, other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=PRECISION)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
    out = acc / l_i[:, None]
    o_offsets = (q_start + rows)[:, None] * o_stride_t + head * o_stride_h + dims[None, :]
    tl.store(out_ptr + o_offsets, out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & dim_mask[None, :])


def prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    scale: float,
    block_m: int = 16,
) -> torch.Tensor:
    """query [T, Hq, D] (sequences back to back) -> [T, Hq, D]; see AttentionMetadata."""
    num_tokens, num_heads, head_dim = query.shape
    out = torch.empty_like(query)
    num_seqs = seq_lens.numel()
    if num_tokens == 0 or num_seqs == 0:
        return out
    block_size = k_cache.shape[1]
    assert block_size >= 16 and block_size & (block_size - 1) == 0, "Triton path needs a power-of-two block_size >= 16"
    grid = (num_seqs, num_heads, triton.cdiv(max_query_len, block_m))
    _prefill_kernel[grid](
        query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out,
        scale, query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        head_dim, num_heads // k_cache.shape[2],
        BLOCK_M=block_m, BLOCK_SIZE=block_size, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
    )
    return out


@triton.jit
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, out_ptr,
    scale, q_stride_b, q_stride_h, o_stride_b, o_stride_h, bt_stride_b,
    c_stride_block, c_stride_pos, c_stride_h,
    head_dim, group_size,
    BLOCK_SIZE: tl.constexpr, BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // group_size
    seq_len = tl.load(seq_lens_ptr + seq)
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < head_dim
    q = tl.load(q_ptr + seq * q_stride_b + head * q_stride_h + dims, mask=dim_mask, other=0.0).to(tl.float32)

    m_i = tl.zeros([], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([], dtype=tl.float32)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    slots = tl.arange(0, BLOCK_SIZE)
    for j in range(0, tl.cdiv(seq_len, BLOCK_SIZE)):
        block = tl.load(block_tables_ptr + seq * bt_stride_b + j).to(tl.int64)
        valid = j * BLOCK_SIZE + slots < seq_len
        kv_offsets = block * c_stride_block + slots[:, None] * c_stride_pos + kv_head * c_stride_h + dims[None, :]
        kv_mask = valid[:, None] & dim_mask[None, :]
        k = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0).to(tl.float32)
        scores = tl.sum(k * q[None, :], 1) * scale
        scores = tl.where(valid, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 0))
        p = tl.exp(scores - m_new)
        alpha = tl.exp(m_i - m_new)
        v = tl.load(v_cache_ptr + kv_offsets, mask=kv_mask, other=0.0).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * v, 0)
        l_i = l_i * alpha + tl.sum(p, 0)
        m_i = m_new
    out = acc / l_i
    tl.store(out_ptr + seq * o_stride_b + head * o_stride_h + dims, out.to(out_ptr.dtype.element_ty), mask=dim_mask)


def decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """query [B, Hq, D], one new token per sequence -> [B, Hq, D]."""
    batch, num_heads, head_dim = query.shape
    out = torch.empty_like(query)
    if batch == 0:
        return out
    block_size = k_cache.shape[1]
    assert block_size & (block_size - 1) == 0, "Triton path needs a power-of-two block_size"
    _decode_kernel[(batch, num_heads)](
        query, k_cache, v_cache, block_tables, seq_lens, out,
        scale, query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        head_dim, num_heads // k_cache.shape[2],
        BLOCK_SIZE=block_size, BLOCK_D=triton.next_power_of_2(head_dim),
    )
    return out
