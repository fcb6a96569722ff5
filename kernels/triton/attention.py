"""Triton paged attention: prefill over a cached prefix (flash-style tiles) and batched decode.

Both read every key from the paged buffer with an online softmax in float32. Prefill
runs query tiles (128 rows for 16-bit prompts) against ``block_n`` keys gathered across pages
per step, unmasked up to the tile's diagonal; decode gathers ``block_n`` keys across pages per step, runs a whole GQA group per program and splits long
contexts over several programs (split-K), merged by a second kernel.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

LOG2_E = 1.4426950408889634  # softmax through exp2: scores are scaled by log2(e) once


@triton.jit
def _prefill_tile(acc, m_i, l_i, q, q_pos, k_cache_ptr, v_cache_ptr, table_ptr, first, last, seq_len, kv_head,
                  dims, dim_mask, qk_scale, c_stride_block, c_stride_pos, c_stride_h,
                  MASKED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, PRECISION: tl.constexpr):
    """Keys [first, last) in steps of BLOCK_N, gathered across pages, into the running softmax. MASKED:
    the causal diagonal and the sequence's end are checked (the steps before the diagonal skip it)."""
    cols = tl.arange(0, BLOCK_N)
    for start in range(first, last, BLOCK_N):
        pos = start + cols
        page = tl.load(table_ptr + pos // BLOCK_SIZE, mask=pos < seq_len, other=0).to(tl.int64)
        kv_offsets = page[:, None] * c_stride_block + (pos % BLOCK_SIZE)[:, None] * c_stride_pos \
            + kv_head * c_stride_h + dims[None, :]
        kv_mask = (pos < seq_len)[:, None] & dim_mask[None, :]
        k = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0).to(q.dtype)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        if MASKED:
            visible = (pos[None, :] <= q_pos[:, None]) & (pos < seq_len)[None, :]
            scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        p = tl.math.exp2(scores - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        v = tl.load(v_cache_ptr + kv_offsets, mask=kv_mask, other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=PRECISION)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, out_ptr,
    qk_scale, q_stride_t, q_stride_h, o_stride_t, o_stride_h, bt_stride_b,
    c_stride_block, c_stride_pos, c_stride_h,
    head_dim, group_size,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One (query tile, head, sequence). The last tiles of a prompt attend to the most keys, so the grid
    runs them first; keys before the tile's diagonal take the unmasked loop."""
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.program_id(2)
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
    q_offsets = (q_start + rows).to(tl.int64)[:, None] * q_stride_t + head * q_stride_h + dims[None, :]
    q = tl.load(q_ptr + q_offsets, mask=row_mask[:, None] & dim_mask[None, :], other=0.0)
    q_pos = context_len + rows

    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    table_ptr = block_tables_ptr + seq * bt_stride_b
    diagonal = (context_len + tile * BLOCK_M) // BLOCK_N * BLOCK_N  # every key before it is seen by every row
    last_key = tl.minimum(context_len + (tile + 1) * BLOCK_M, seq_len)
    acc, m_i, l_i = _prefill_tile(acc, m_i, l_i, q, q_pos, k_cache_ptr, v_cache_ptr, table_ptr, 0, diagonal,
                                  seq_len, kv_head, dims, dim_mask, qk_scale, c_stride_block, c_stride_pos,
                                  c_stride_h, False, BLOCK_N, BLOCK_SIZE, PRECISION)
    acc, m_i, l_i = _prefill_tile(acc, m_i, l_i, q, q_pos, k_cache_ptr, v_cache_ptr, table_ptr, diagonal, last_key,
                                  seq_len, kv_head, dims, dim_mask, qk_scale, c_stride_block, c_stride_pos,
                                  c_stride_h, True, BLOCK_N, BLOCK_SIZE, PRECISION)
    out = acc / l_i[:, None]
    o_offsets = (q_start + rows).to(tl.int64)[:, None] * o_stride_t + head * o_stride_h + dims[None, :]
    tl.store(out_ptr + o_offsets, out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & dim_mask[None, :])


class PrefillConfig(NamedTuple):
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def prefill_config(dtype: torch.dtype, head_dim: int, max_query_len: int) -> PrefillConfig:
    """Tiles by dtype, prompt length and device, from ``kvmesh bench kernels``' sweep on an H200 (docs/gpu.md):
    16-bit prompts past 64 tokens take 128 x 128 tiles where the shared memory holds them (Hopper), 128 x 64
    elsewhere; short ones 64-row tiles or less. float32 keeps small tiles (its operands are twice the size, and it
    is the tests' dtype, not a serving one)."""
    if dtype == torch.float32:
        return PrefillConfig(32, 32, 4, 2)
    if max_query_len <= 64:
        return PrefillConfig(max(16, triton.next_power_of_2(max_query_len)), 64, 4, 3)
    if head_dim <= 128 and _large_shared_memory():
        return PrefillConfig(128, 128, 8, 2)
    return PrefillConfig(128, 64, 8 if head_dim > 64 else 4, 3 if head_dim <= 128 else 2)


@functools.cache
def _large_shared_memory() -> bool:
    """Hopper and later: 228 KB of shared memory per SM (two stages of 128 x 128 K/V tiles fit)."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


def prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    scale: float,
    config: PrefillConfig | None = None,
) -> torch.Tensor:
    """query [T, Hq, D] (sequences back to back) -> [T, Hq, D]; see AttentionMetadata. ``config``
    overrides the tile choice (benchmarks sweep it)."""
    num_tokens, num_heads, head_dim = query.shape
    out = torch.empty_like(query)
    num_seqs = seq_lens.numel()
    if num_tokens == 0 or num_seqs == 0:
        return out
    block_size = k_cache.shape[1]
    assert block_size & (block_size - 1) == 0, "Triton path needs a power-of-two block_size"
    cfg = config or prefill_config(query.dtype, head_dim, max_query_len)
    grid = (triton.cdiv(max_query_len, cfg.block_m), num_heads, num_seqs)
    _prefill_kernel[grid](
        query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out,
        scale * LOG2_E, query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        head_dim, num_heads // k_cache.shape[2],
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_SIZE=block_size,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


@triton.jit
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, acc_ptr, ml_ptr, out_ptr,
    scale, q_stride_b, q_stride_h, bt_stride_b, c_stride_block, c_stride_pos, c_stride_h, o_stride_b, o_stride_h,
    head_dim, group_size, tokens_per_split, num_splits,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr, DIRECT: tl.constexpr,
):
    """One (sequence, KV head, split): every query head of the group against ``tokens_per_split`` keys.
    DIRECT (one split per sequence): the normalised output itself, with no partial results to merge."""
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
    store_rows = row_mask[:, None] & dim_mask[None, :]
    if DIRECT:
        out = acc / l_i[:, None]
        tl.store(out_ptr + seq * o_stride_b + heads[:, None] * o_stride_h + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=store_rows)
    else:  # partial results, unnormalised: acc [B, Hq, S, D], (m, l) [B, Hq, S, 2]
        part = (seq * tl.num_programs(1) * group_size + heads) * num_splits + split
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
    per step gathered across pages; a second kernel merges the splits' partial softmaxes. A batch
    large enough to fill the device with one split per sequence writes its output directly: one
    launch, no partial results.
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
    direct = splits == 1
    parts = (batch, num_heads, splits)
    acc = out if direct else torch.empty(*parts, head_dim, dtype=torch.float32, device=query.device)
    ml = out if direct else torch.empty(*parts, 2, dtype=torch.float32, device=query.device)
    block_d = max(16, triton.next_power_of_2(head_dim))
    _decode_split_kernel[(batch, num_kv_heads, splits)](
        query, k_cache, v_cache, block_tables, seq_lens, acc, ml, out,
        scale, query.stride(0), query.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), out.stride(0), out.stride(1),
        head_dim, group, tokens_per_split, splits,
        BLOCK_SIZE=block_size, BLOCK_N=block_n, BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_D=block_d,
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32", DIRECT=direct,
    )
    if direct:
        return out
    _decode_reduce_kernel[(batch, num_heads)](
        acc, ml, out, out.stride(0), out.stride(1), head_dim, num_heads, splits,
        BLOCK_S=max(2, triton.next_power_of_2(splits)), BLOCK_D=block_d,
    )
    return out
