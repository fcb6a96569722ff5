"""Torch reference attention over the paged KV buffer (prefill with cached prefix, decode)."""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from kvmesh.device import cpu_features


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
    per_step: dict | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its whole paged context.

    query [T, Hq, D] holds the sequences' new tokens back to back; returns [T, Hq, D]. ``per_step`` (the
    batch's ``AttentionMetadata.per_step``) keeps each sequence's block ids and mask for the step's other layers.
    Reduced precision (bf16/fp16) takes ``chunked_causal_attention`` on CPUs without AMX (GEMMs in
    the input dtype: 2.6x faster than torch's CPU flash kernel at 2,048 tokens in bf16 on 2 EPYC
    cores, and rounding as the decode path does). Where the CPU has AMX, torch's flash kernel uses
    it and is the faster (1.5x at 2 threads, 2.4x at 16 on a Sapphire Rapids), so SDPA serves
    there, as it does fp32 everywhere.
    """
    out = torch.empty_like(query)
    start = 0
    chunked = query.dtype != torch.float32 and not (query.device.type == "cpu" and "amx_tile" in cpu_features())
    shared = {} if per_step is None else per_step
    for i, (q_len, s_len) in enumerate(zip(query_lens, seq_lens)):
        context_len = s_len - q_len
        block_ids = shared.get(("prefill_block_ids", i))
        if block_ids is None:
            block_ids = shared[("prefill_block_ids", i)] = block_tables[i].to(torch.int64)
        k = gather_kv(k_cache, block_ids, s_len).to(query.dtype)  # [S, Hkv, D]
        v = gather_kv(v_cache, block_ids, s_len).to(query.dtype)
        if chunked:
            rows = slice(start, start + q_len)
            out[rows] = chunked_causal_attention(query[rows], k, v, context_len, scale)
            start += q_len
            continue
        # 4-D inputs: torch's fused CPU kernels skip 3-D inputs (4-7x slower).
        q = query[start : start + q_len].transpose(0, 1)[None]  # [1, Hq, q_len, D]
        k, v = k.transpose(0, 1)[None], v.transpose(0, 1)[None]
        if context_len == 0:  # plain causal: the fastest path
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:  # causal, offset by the cached prefix
            mask = shared.get(("prefill_mask", i))
            if mask is None:
                mask = shared[("prefill_mask", i)] = offset_causal_mask(q_len, s_len, query.dtype, query.device)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[start : start + q_len] = o[0].transpose(0, 1)
        start += q_len
    return out


def offset_causal_mask(q_len: int, s_len: int, dtype: torch.dtype, device) -> torch.Tensor:
    """SDPA's additive mask [q_len, s_len] for the last ``q_len`` of ``s_len`` tokens: 0 where a query sees the key
    (keys up to its own position), -inf elsewhere (a float mask: SDPA converts a boolean one on every call)."""
    q_pos = torch.arange(s_len - q_len, s_len, device=device)
    hidden = torch.arange(s_len, device=device)[None, :] > q_pos[:, None]
    return torch.zeros(q_len, s_len, dtype=dtype, device=device).masked_fill_(hidden, float("-inf"))


_CHUNK_SCORE_ELEMENTS = 1 << 22  # scores held at once: ~8 MiB in bf16


def chunked_causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, context_len: int,
                             scale: float) -> torch.Tensor:
    """One sequence: query [Lq, Hq, D] at positions context_len.., key/value [S, Hkv, D] -> [Lq, Hq, D].

    Queries go in chunks of rows; a chunk's scores cover only the keys it can see, so the
    causal upper triangle is skipped chunk by chunk and masked only inside the diagonal block::

        keys:        0 ................ context_len + s ........ context_len + e
        chunk s..e:  [ all visible (prefix + earlier chunks) | lower triangle  ]

    Scores stay in the input dtype (as eager Hugging Face attention); the softmax accumulates
    in fp32 inside torch.
    """
    q_len, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    group = num_heads // num_kv_heads
    keys_t = key.permute(1, 2, 0).contiguous()  # [Hkv, D, S]
    values = value.transpose(0, 1).contiguous()  # [Hkv, S, D]
    out = torch.empty_like(query)
    chunk = max(16, min(128, _CHUNK_SCORE_ELEMENTS // (num_heads * key.shape[0])))
    above_diagonal = torch.ones(chunk, chunk, dtype=torch.bool, device=query.device).triu_(1)
    for s in range(0, q_len, chunk):
        e = min(q_len, s + chunk)
        n, end = e - s, context_len + e
        q = (query[s:e] * scale).view(n, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
        scores = torch.bmm(q.reshape(num_kv_heads, group * n, head_dim), keys_t[:, :, :end])
        scores = scores.view(num_kv_heads, group, n, end)
        scores[..., context_len + s : end].masked_fill_(above_diagonal[:n, :n], float("-inf"))
        probs = torch.softmax(scores, dim=-1).view(num_kv_heads, group * n, end)
        o = torch.bmm(probs, values[:, :end]).view(num_kv_heads, group, n, head_dim)
        out[s:e] = o.permute(2, 0, 1, 3).reshape(n, num_heads, head_dim)
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
