"""Torch reference attention over the paged KV buffer (prefill with cached prefix, decode)."""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F


def gather_kv(cache: torch.Tensor, block_ids: torch.Tensor, length: int) -> torch.Tensor:
    """Keys (or values) of one sequence's first ``length`` positions: [length, H_kv, D]."""
    num_blocks = -(-length // cache.shape[1])
    blocks = cache.index_select(0, block_ids[:num_blocks].to(torch.int64))
    return blocks.reshape(-1, *cache.shape[2:])[:length]


def prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_lens: list[int],
    seq_lens: list[int],
    scale: float,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its whole paged context.

    query [T, Hq, D] holds the sequences' new tokens back to back; returns [T, Hq, D].
    """
    out = torch.empty_like(query)
    start = 0
    for i, (q_len, s_len) in enumerate(zip(query_lens, seq_lens)):
        # 4-D inputs: torch's fused CPU kernels skip 3-D inputs (4-7x slower).
        q = query[start : start + q_len].transpose(0, 1)[None]  # [1, Hq, q_len, D]
        k = gather_kv(k_cache, block_tables[i], s_len).transpose(0, 1)[None].to(q.dtype)
        v = gather_kv(v_cache, block_tables[i], s_len).transpose(0, 1)[None].to(q.dtype)
        context_len = s_len - q_len
        if context_len == 0:  # plain causal: the fastest path
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:  # causal, offset by the cached prefix
            q_pos = torch.arange(context_len, s_len, device=query.device)
            mask = torch.arange(s_len, device=query.device)[None, :] <= q_pos[:, None]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[start : start + q_len] = o[0].transpose(0, 1)
        start += q_len
    return out


class DecodeIndex(NamedTuple):
    """What every layer of one decode step shares: which blocks to gather and which keys are past the end."""

    flat_block_ids: torch.Tensor  # [B * num_blocks] int64, row-major over the batch
    past_end: torch.Tensor  # [B, 1, 1, num_blocks * block_size] bool, True where a key position >= seq_len


def decode_index(block_tables: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int, block_size: int) -> DecodeIndex:
    num_blocks = -(-max_seq_len // block_size)
    flat_ids = block_tables[:, :num_blocks].reshape(-1).to(torch.int64)
    key_pos = torch.arange(num_blocks * block_size, device=seq_lens.device)
    past_end = key_pos[None, :] >= seq_lens.to(torch.int64)[:, None]
    return DecodeIndex(flat_ids, past_end[:, None, None, :])


def decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    scale: float,
    index: DecodeIndex | None = None,
) -> torch.Tensor:
    """One new token per sequence, batched: query [B, Hq, D] -> [B, Hq, D].

    One gather per cache, then two batched matmuls per KV head group (softmax in float32): for the
    single-row queries of decode this is several times faster on the CPU than the fused SDPA kernel,
    whose per-call set-up dominates at these sizes. ``index`` (from ``decode_index``) may be computed
    once per step and shared by every layer.
    """
    batch, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if index is None:
        index = decode_index(block_tables, seq_lens, max_seq_len, block_size)
    span = index.past_end.shape[-1]
    k = k_cache.index_select(0, index.flat_block_ids).view(batch, span, num_kv_heads, head_dim).transpose(1, 2)
    v = v_cache.index_select(0, index.flat_block_ids).view(batch, span, num_kv_heads, head_dim).transpose(1, 2)
    k, v = k.contiguous().to(query.dtype), v.contiguous().to(query.dtype)  # [B, Hkv, S, D]
    q = query.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)  # [B, Hkv, G, D]
    scores = torch.matmul(q, k.transpose(-1, -2)).float().mul_(scale)  # [B, Hkv, G, S]
    scores.masked_fill_(index.past_end, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(query.dtype)
    return torch.matmul(probs, v).view(batch, num_heads, head_dim)
