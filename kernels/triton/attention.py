"""Triton paged attention: prefill over a cached prefix (flash-style tiles) and batched decode.

Both read every key from the paged buffer with an online softmax in float32. Prefill
steps one KV block (``block_size`` positions) per iteration; decode gathers ``block_n``
keys across pages per step, runs a whole GQA group per program and splits long
contexts over several programs (split-K), merged by a second kernel.
"""
from __future__ import annotations

import functools

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
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, acc_ptr, ml_ptr,
    scale, q_stride_b, q_stride_h, bt_stride_b, c_stride_block, c_stride_pos, c_stride_h,
    head_dim, group_size, tokens_per_split, num_splits,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One (sequence, KV head, split): every query head of the group against ``tokens_per_split`` keys."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    rows = tl.arange(0, BLOCK_G)  # query heads of this KV head's group (padded)
    dims = tl.arange(0, BLOCK_D)
    row_mask = rows < group_size
    dim_mask = dims < head_dim
    heads = kv_head * group_size + rows
    q = tl.load(q_ptr + seq * q_stride_b + heads[:, None] * q_stride_h + dims[None, :],
                mask=row_mask[:, None] & dim_mask[None, :], other=0.0)

    m_i = tl.zeros([BLOCK_G], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    cols = tl.arange(0, BLOCK_N)
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, seq_len)
    for first in range(start, end, BLOCK_N):  # at least one valid key per step: the softmax stays finite
        pos = first + cols
        valid = pos < end
        page = tl.load(block_tables_ptr + seq * bt_stride_b + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        kv_offsets = page[:, None] * c_stride_block + (pos % BLOCK_SIZE)[:, None] * c_stride_pos \
            + kv_head * c_stride_h + dims[None, :]
        kv_mask = valid[:, None] & dim_mask[None, :]
        k = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        v = tl.load(v_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
    # Partial results, unnormalised: acc [B, Hq, S, D], (m, l) [B, Hq, S, 2].
    part = (seq * tl.num_programs(1) * group_size + heads) * num_splits + split
    store_rows = row_mask[:, None] & dim_mask[None, :]
    tl.store(acc_ptr + part[:, None] * head_dim + dims[None, :], acc, mask=store_rows)
    tl.store(ml_ptr + part * 2, m_i, mask=row_mask)
    tl.store(ml_ptr + part * 2 + 1, l_i, mask=row_mask)


@triton.jit
def _decode_reduce_kernel(acc_ptr, ml_ptr, out_ptr, o_stride_b, o_stride_h, head_dim, num_heads, num_splits,
                          BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """Combine one (sequence, query head)'s splits: softmax-weighted sum of their partial outputs."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_D)
    split_mask = splits < num_splits
    base = (seq * num_heads + head) * num_splits
    m = tl.load(ml_ptr + (base + splits) * 2, mask=split_mask, other=float("-inf"))
    l = tl.load(ml_ptr + (base + splits) * 2 + 1, mask=split_mask, other=0.0)
    m_max = tl.max(m, 0)
    w = tl.where(split_mask, tl.exp(m - m_max), 0.0)  # an empty split: m = -inf, weight 0
    acc = tl.load(acc_ptr + (base + splits)[:, None] * head_dim + dims[None, :],
                  mask=split_mask[:, None] & (dims < head_dim)[None, :], other=0.0)
    out = tl.sum(acc * w[:, None], 0) / tl.sum(l * w, 0)
    tl.store(out_ptr + seq * o_stride_b + head * o_stride_h + dims, out.to(out_ptr.dtype.element_ty),
             mask=dims < head_dim)


@functools.cache
def _num_sms() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else 4


def _num_splits(batch: int, num_kv_heads: int, max_seq_len: int, block_n: int) -> int:
    """Enough (sequence, KV head, split) programs to fill the device, never a split without keys."""
    target = 2 * _num_sms()
    wanted = -(-target // (batch * num_kv_heads))
    return max(1, min(wanted, -(-max_seq_len // block_n), 64))


def decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int | None = None,
    block_n: int = 64,
) -> torch.Tensor:
    """query [B, Hq, D], one new token per sequence -> [B, Hq, D].

    Split-K over the context: program (sequence, KV head, split) runs every query head of the
    KV head's group at once (one read of each key serves the whole group), ``block_n`` keys
    per step gathered across pages; a second kernel merges the splits' partial softmaxes.
    """
    batch, num_heads, head_dim = query.shape
    out = torch.empty_like(query)
    if batch == 0:
        return out
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    assert block_size & (block_size - 1) == 0, "Triton path needs a power-of-two block_size"
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max().item())
    group = num_heads // num_kv_heads
    splits = _num_splits(batch, num_kv_heads, max_seq_len, block_n)
    tokens_per_split = -(-max_seq_len // (splits * block_n)) * block_n
    splits = -(-max_seq_len // tokens_per_split)
    acc = torch.empty(batch, num_heads, splits, head_dim, dtype=torch.float32, device=query.device)
    ml = torch.empty(batch, num_heads, splits, 2, dtype=torch.float32, device=query.device)
    block_d = max(16, triton.next_power_of_2(head_dim))
    _decode_split_kernel[(batch, num_kv_heads, splits)](
        query, k_cache, v_cache, block_tables, seq_lens, acc, ml,
        scale, query.stride(0), query.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        head_dim, group, tokens_per_split, splits,
        BLOCK_SIZE=block_size, BLOCK_N=block_n, BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_D=block_d,
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
    )
    _decode_reduce_kernel[(batch, num_heads)](
        acc, ml, out, out.stride(0), out.stride(1), head_dim, num_heads, splits,
        BLOCK_S=max(2, triton.next_power_of_2(splits)), BLOCK_D=block_d,
    )
    return out
