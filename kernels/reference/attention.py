"""Torch reference attention over the paged KV buffer (prefill with cached prefix, decode)."""
from __future__ import annotations

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


def decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    scale: float,
) -> torch.Tensor:
    """One new token per sequence, batched: query [B, Hq, D] -> [B, Hq, D]."""
    block_size = k_cache.shape[1]
    num_blocks = -(-max_seq_len // block_size)
    table = block_tables[:, :num_blocks].to(torch.int64)
    batch = query.shape[0]
    k = k_cache[table].reshape(batch, num_blocks * block_size, *k_cache.shape[2:])
    v = v_cache[table].reshape(batch, num_blocks * block_size, *v_cache.shape[2:])
    k = k.transpose(1, 2).to(query.dtype)  # [B, Hkv, S, D]
    v = v.transpose(1, 2).to(query.dtype)
    k_pos = torch.arange(num_blocks * block_size, device=query.device)
    mask = (k_pos[None, :] < seq_lens.to(torch.int64)[:, None])[:, None, None, :]  # [B, 1, 1, S]
    q = query.unsqueeze(2)  # [B, Hq, 1, D]
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return o.squeeze(2)
