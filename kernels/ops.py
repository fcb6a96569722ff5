"""The one dispatch point: every kernel call of the model goes through here.

CUDA tensors take the Triton kernels (paged attention, the K/V store, and fused RMSNorm with its
residual add, SiLU-mul and RoPE with the store: one launch each), except steps of long prompts with
no cached prefix, whose attention goes through torch's SDPA (flash kernels) on the keys and values
as the layer computed them (``takes_fresh_kv``). On the CPU, decode
attention, prefill attention (fp32 for a few new tokens, and past that where it measures faster than
torch's SDPA on this machine; bf16 for a few new tokens), RMSNorm (with its fused residual
add) and RoPE + K/V store take the native kernels (``kernels/cpu``, compiled on first use) where
they load and take the arguments, everything else the torch reference. ``KVMESH_KERNELS=torch``
forces the reference anywhere; ``KVMESH_KERNELS=triton`` forces Triton (on the CPU that needs
``TRITON_INTERPRET=1``, for tests).
"""
from __future__ import annotations

import functools
import logging
import os
import time

import torch
import torch.nn.functional as F

from kvmesh.device import cpu_features
from kvmesh.kernels.attention_metadata import AttentionMetadata
from kvmesh.kernels.cpu import library as native
from kvmesh.kernels.reference import attention as ref_attention
from kvmesh.kernels.reference import cache_ops as ref_cache
from kvmesh.kernels.reference import moe as ref_moe
from kvmesh.kernels.reference import norm as ref_norm
from kvmesh.kernels.reference.rotary import rotate

log = logging.getLogger("kvmesh.kernels")


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def use_native(tensor: torch.Tensor) -> bool:
    """CPU tensors take the native kernels unless ``KVMESH_KERNELS`` asks for another path. bf16 only on CPUs
    with AVX-512, where their 16-lane float32 sums round as torch's (and transformers') do; with 8-lane sums
    (AVX2) a rounding in a few rows moves and greedy streams part from transformers', so torch's kernels
    serve bf16 there (``--dtype auto`` picks float32 on such CPUs anyway)."""
    if tensor.dtype == torch.bfloat16 and "avx512f" not in cpu_features():
        return False
    return tensor.device.type == "cpu" and os.environ.get("KVMESH_KERNELS", "auto") == "auto"


def use_triton(tensor: torch.Tensor) -> bool:
    mode = os.environ.get("KVMESH_KERNELS", "auto")
    if mode == "torch":
        return False
    if mode == "triton":
        return True
    if mode != "auto":
        raise ValueError(f"KVMESH_KERNELS={mode!r}: expected auto, torch or triton")
    return tensor.is_cuda and triton_available()


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             md: AttentionMetadata) -> None:
    """Write new K/V [T, H_kv, D] into one layer's caches at the batch's slots."""
    if use_triton(key):
        from kvmesh.kernels.triton import cache_ops
        cache_ops.store_kv(key, value, k_cache, v_cache, md.slot_mapping)
    elif md.slot_block_ids is not None:
        ref_cache.store_kv_at(key, value, k_cache, v_cache, md.slot_block_ids, md.slot_offsets)
    else:
        ref_cache.store_kv(key, value, k_cache, v_cache, md.slot_mapping)


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    md: AttentionMetadata, scale: float,
                    fresh_kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Attention for a mixed batch: decode kernel on the leading decodes, prefill kernel on the rest. A batch
    of one kind returns that kernel's output as it is (no output buffer, no copy into it). ``fresh_kv``: the
    step's keys and values [T, H_kv, D] as computed, given where ``takes_fresh_kv`` said so."""
    if fresh_kv is not None:
        return fresh_prompts_attention(query, *fresh_kv, md.query_lens_cpu, scale)
    d = md.num_decodes
    if not md.num_prefills:
        return decode_attention(query, k_cache, v_cache, md.block_tables, md.seq_lens, md.max_seq_len, scale,
                                md.per_step)
    if not d:
        return prefill_attention(query, k_cache, v_cache, md.block_tables, md.seq_lens, md.query_start_loc,
                                 md.query_lens_cpu, md.seq_lens_cpu, md.max_query_len, scale, md.per_step)
    out = torch.empty_like(query)
    out[:d] = decode_attention(query[:d], k_cache, v_cache, md.block_tables[:d], md.seq_lens[:d],
                               max(md.seq_lens_cpu[:d]), scale, md.per_step)
    out[d:] = prefill_attention(query[d:], k_cache, v_cache, md.block_tables[d:], md.seq_lens[d:],
                                md.query_start_loc[d:] - d, md.query_lens_cpu[d:], md.seq_lens_cpu[d:],
                                max(md.query_lens_cpu[d:]), scale, md.per_step)
    return out


NATIVE_BF16_PREFILL_MAX_TOKENS = 32
# Where the CPU has AMX, torch's flash kernel computes bf16 faster, but for a few new tokens over a cached context its
# gathered copy of the context and its mask cost more than the native kernel's whole work over the blocks in place.
NATIVE_BF16_AMX_PREFILL_MAX_TOKENS = 16
NATIVE_FP32_PREFILL_SHORT_TOKENS = 8  # fp32 chunks this short take the native kernel without a measurement


def can_prefill_natively(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, max_query_len: int,
                         over_context: bool) -> bool:
    """fp32: the native kernel for a few new tokens, else where it measured faster than torch's SDPA on this
    machine (``native_fp32_prefill_is_faster``: its lead differs by CPU). bf16: only a few new tokens (the chunked
    GEMMs are faster for long prompts since they multiply in bf16); where the CPU has AMX, fewer still and only
    ``over_context`` (every sequence's new tokens after cached ones): torch's flash kernel serves bf16 there once its
    gather and mask are worth it, and fresh prompts keep its roundings."""
    if query.dtype == torch.bfloat16:
        amx = "amx_tile" in cpu_features()
        if max_query_len > (NATIVE_BF16_AMX_PREFILL_MAX_TOKENS if amx else NATIVE_BF16_PREFILL_MAX_TOKENS) or \
                amx and not over_context:
            return False
    if query.dtype not in (torch.float32, torch.bfloat16) or not native.can_attend(query, k_cache, v_cache):
        return False
    return query.dtype == torch.bfloat16 or max_query_len <= NATIVE_FP32_PREFILL_SHORT_TOKENS or \
        native_fp32_prefill_is_faster(query.shape[1], k_cache.shape[2], query.shape[2], k_cache.shape[1],
                                      torch.get_num_threads())


@functools.cache
def native_fp32_prefill_is_faster(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                                  num_threads: int) -> bool:
    """Measured once per process, shape and thread count: the native fp32 prefill kernel against the torch
    reference on a 64-token chunk over a 512-token context, each the best of three runs (the native kernel's
    lead differs by CPU, so the machine decides). Logged; False where the native kernel fails."""
    gen = torch.Generator().manual_seed(0)
    num_blocks = 512 // block_size
    kv = torch.randn(num_blocks, 2, block_size, num_kv_heads, head_dim, generator=gen)
    k_cache, v_cache = kv[:, 0], kv[:, 1]
    query = torch.randn(64, num_heads, head_dim, generator=gen)
    tables = torch.arange(num_blocks, dtype=torch.int32).unsqueeze(0)
    scale = head_dim ** -0.5

    def best(fn) -> float:
        times = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)
    try:
        native_s = best(lambda: native.prefill_attention(query, k_cache, v_cache, tables, [64], [512], scale))
    except native.NativeKernelError:
        return False
    torch_s = best(lambda: ref_attention.prefill_attention(query, k_cache, v_cache, tables, [64], [512], scale))
    log.info(
        "fp32 prefill attention (%d heads, %d KV heads, head dim %d, %d threads): native %.2f ms, torch %.2f ms: "
        "taking the %s kernel", num_heads, num_kv_heads, head_dim, num_threads, native_s * 1e3, torch_s * 1e3,
        "native" if native_s < torch_s else "torch")
    return native_s < torch_s


def prefill_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                      query_lens_cpu: list[int], seq_lens_cpu: list[int], max_query_len: int,
                      scale: float, per_step: dict | None = None) -> torch.Tensor:
    """``per_step`` (the batch's ``AttentionMetadata.per_step``) keeps what every layer can share."""
    if use_triton(query):
        from kvmesh.kernels.triton import attention
        return attention.prefill_attention(query, k_cache, v_cache, block_tables, seq_lens,
                                           query_start_loc, max_query_len, scale)
    if use_native(query) and can_prefill_natively(query, k_cache, v_cache, max_query_len,
                                                  all(q < s for q, s in zip(query_lens_cpu, seq_lens_cpu))):
        return native.prefill_attention(query, k_cache, v_cache, block_tables, query_lens_cpu, seq_lens_cpu, scale)
    return ref_attention.prefill_attention(query, k_cache, v_cache, block_tables,
                                           query_lens_cpu, seq_lens_cpu, scale, per_step)


# Steps of prompts with no cached prefix, one of them this long, take SDPA on CUDA. On an H200 (docs/gpu.md) SDPA
# beat the paged kernel at every length measured (512 to 8,192 tokens), but on keys gathered back from the blocks
# it lost at 2,048 (the gathers and copies cost more than it saved); it now reads them as the layer computed them.
FRESH_PROMPT_SDPA_MIN_TOKENS = 1024


def takes_fresh_kv(qkv: torch.Tensor, md: AttentionMetadata) -> bool:
    """Whether this step's attention should be given the keys and values as computed (``paged_attention``'s
    ``fresh_kv``): prompts with nothing cached, one of them long, on CUDA through the Triton dispatch."""
    return md.fresh_prompts and md.max_query_len >= FRESH_PROMPT_SDPA_MIN_TOKENS and qkv.is_cuda and use_triton(qkv)


def fresh_prompts_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                            query_lens_cpu: list[int], scale: float) -> torch.Tensor:
    """Causal attention of prompts with no cached prefix, each attending to its own new tokens only, through
    torch's SDPA (its flash kernels on CUDA). query [T, Hq, D], keys and values [T, H_kv, D] (any strides with
    unit-stride rows: views of the fused projection do) -> [T, Hq, D]. One prompt returns SDPA's output as a
    view; several are written into one buffer."""
    num_heads, num_kv_heads = query.shape[1], keys.shape[1]

    def attend(start: int, end: int) -> torch.Tensor:
        q, k, v = (t[start:end].transpose(0, 1).unsqueeze(0) for t in (query, keys, values))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=num_heads != num_kv_heads)
        return o[0].transpose(0, 1)

    if len(query_lens_cpu) == 1:
        return attend(0, query_lens_cpu[0])
    out = torch.empty_like(query)
    start = 0
    for num_tokens in query_lens_cpu:
        out[start: start + num_tokens] = attend(start, start + num_tokens)
        start += num_tokens
    return out


def decode_attention(query, k_cache, v_cache, block_tables, seq_lens, max_seq_len: int,
                     scale: float, per_step: dict | None = None) -> torch.Tensor:
    """``per_step`` (the batch's ``AttentionMetadata.per_step``) keeps what every layer can share."""
    if use_triton(query):
        from kvmesh.kernels.triton import attention
        return attention.decode_attention(query, k_cache, v_cache, block_tables, seq_lens, scale, max_seq_len)
    if use_native(query) and native.can_attend(query, k_cache, v_cache):
        return native.decode_attention(query, k_cache, v_cache, block_tables, seq_lens, scale)
    index = None if per_step is None else per_step.get("decode_index")
    if index is None:
        index = ref_attention.decode_index(block_tables, seq_lens, max_seq_len, k_cache.shape[1])
        if per_step is not None:
            per_step["decode_index"] = index
    return ref_attention.decode_attention(query, k_cache, v_cache, block_tables, seq_lens,
                                          max_seq_len, scale, index)


def rope_store(qkv: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, md: AttentionMetadata, num_heads: int,
               keys_out: torch.Tensor | None = None) -> torch.Tensor:
    """Rotate the queries and keys of a fused projection ``qkv`` [T, (Hq + 2 Hkv) * D] with
    ``RotaryEmbedding.lookup``'s tables, store keys and values at the batch's slots; returns the
    queries [T, Hq, D] (contiguous). ``keys_out`` [T, Hkv, D]: the rotated keys are written there too."""
    if keys_out is None and use_native(qkv) and md.slot_block_ids is not None and \
            native.can_rope_store(qkv, cos, k_cache, v_cache):
        return native.rope_store(qkv, cos, signed_sin, k_cache, v_cache, md.slot_block_ids, md.slot_offsets, num_heads)
    num_tokens = qkv.shape[0]
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    if use_triton(qkv) and head_dim & (head_dim - 1) == 0 and qkv.stride(-1) == 1:
        from kvmesh.kernels.triton import fused
        return fused.rope_store(qkv, cos, signed_sin, k_cache, v_cache, md.slot_mapping, num_heads, keys_out)
    q_size = num_heads * head_dim
    qk = qkv[:, : q_size + num_kv_heads * head_dim].view(num_tokens, num_heads + num_kv_heads, head_dim)
    qk = rotate(qk, cos, signed_sin)  # queries and keys side by side in the fused projection: one rotation
    v = qkv[:, q_size + num_kv_heads * head_dim:].view(num_tokens, num_kv_heads, head_dim)
    store_kv(qk[:, num_heads:], v, k_cache, v_cache, md)
    if keys_out is not None:
        keys_out.copy_(qk[:, num_heads:])
    return qk[:, :num_heads].contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * rms_norm(x)`` over the last dim (float32 statistics, Hugging Face's roundings)."""
    if use_native(x) and native.can_norm(x, weight):
        return native.rms_norm(x, weight, eps)
    if _can_fuse_rows(x, weight):
        from kvmesh.kernels.triton import fused
        return fused.rms_norm(x, weight, eps)
    return ref_norm.rms_norm(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x + residual, rms_norm(x + residual))``. The native path adds in place and returns ``x`` itself,
    so callers must not keep using the old ``x``."""
    if use_native(x) and native.can_norm(x, weight, residual):
        return x, native.rms_norm(x, weight, eps, residual=residual)
    if _can_fuse_rows(x, weight) and residual.shape == x.shape and residual.stride(-1) == 1:
        from kvmesh.kernels.triton import fused
        return x, fused.rms_norm(x, weight, eps, residual=residual)
    return ref_norm.add_rms_norm(x, residual, weight, eps)


def _can_fuse_rows(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """The Triton row kernels take 2-D activations with unit-stride rows and a contiguous weight."""
    return use_triton(x) and x.dim() == 2 and x.stride(-1) == 1 and weight.is_contiguous()


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for the fused projection ``gate_up`` [T, 2 I] (gate columns first) -> [T, I]."""
    if use_triton(gate_up) and gate_up.dim() == 2 and gate_up.stride(-1) == 1:
        from kvmesh.kernels.triton import fused
        return fused.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def moe_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, expert_ids: torch.Tensor,
                weights: torch.Tensor) -> torch.Tensor:
    """A mixture-of-experts block's experts (``kernels/reference/moe.py`` says what it computes)."""
    if use_triton(x):
        from kvmesh.kernels.triton import moe
        return moe.moe_experts(x, gate_up, down, expert_ids, weights)
    return ref_moe.moe_experts(x, gate_up, down, expert_ids, weights)


def pack_blocks(kv_buffer: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Gather whole blocks into one contiguous staging tensor (for transfer engines without gather)."""
    if use_triton(kv_buffer):
        from kvmesh.kernels.triton import cache_ops
        return cache_ops.pack_blocks(kv_buffer, block_ids, out)
    return ref_cache.pack_blocks(kv_buffer, block_ids, out)


def unpack_blocks(kv_buffer: torch.Tensor, block_ids: torch.Tensor, packed: torch.Tensor) -> None:
    """Scatter a staging tensor of whole blocks into ``kv_buffer[block_ids]``."""
    if use_triton(kv_buffer):
        from kvmesh.kernels.triton import cache_ops
        cache_ops.unpack_blocks(kv_buffer, block_ids, packed)
    else:
        ref_cache.unpack_blocks(kv_buffer, block_ids, packed)
