"""Triton kernels that fuse a layer's elementwise work: RMSNorm (with its residual add), SiLU-mul, and
RoPE with the K/V store.

Each is one launch where the torch reference takes several, and each rounds as the reference does
(float32 statistics and products, rounded to the activation dtype at the same points), so the fused
and reference paths agree to the last bit in most rows and to one rounding elsewhere.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, x_stride, r_stride, o_stride, hidden, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = x + tl.load(residual_ptr + row * r_stride + cols, mask=mask, other=0.0)
        tl.store(x_ptr + row * x_stride + cols, x, mask=mask)  # the stream, in place
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, 0) / hidden + eps)
    normed = (xf * rstd).to(x.dtype)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * o_stride + cols, (w.to(tl.float32) * normed.to(tl.float32)).to(out_ptr.dtype.element_ty),
             mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
             ) -> torch.Tensor:
    """``weight * rms_norm(x [+ residual])`` over the last dim of a 2-D ``x``; with ``residual`` the sum is
    written into ``x`` in place first (the caller's stream)."""
    assert x.dim() == 2 and x.stride(-1) == 1 and weight.is_contiguous()
    num_rows, hidden = x.shape
    out = torch.empty_like(x)
    if num_rows == 0:
        return out
    if residual is not None:
        assert residual.shape == x.shape and residual.stride(-1) == 1
    block = triton.next_power_of_2(hidden)
    _rms_norm_kernel[(num_rows,)](
        x, x if residual is None else residual, weight, out, x.stride(0),
        0 if residual is None else residual.stride(0), out.stride(0), hidden, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=4 if block <= 2048 else 8,
    )
    return out


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, gu_stride, o_stride, width, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(gate_up_ptr + row * gu_stride + cols, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + row * gu_stride + width + cols, mask=mask, other=0.0)
    gf = gate.to(tl.float32)
    silu = (gf / (1.0 + tl.exp(-gf))).to(gate.dtype)
    tl.store(out_ptr + row * o_stride + cols, (silu.to(tl.float32) * up.to(tl.float32)).to(gate.dtype), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up`` [T, 2 I] (gate columns, then up columns) -> [T, I]."""
    assert gate_up.dim() == 2 and gate_up.stride(-1) == 1
    num_rows, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(num_rows, width, dtype=gate_up.dtype, device=gate_up.device)
    if num_rows == 0:
        return out
    block = min(2048, triton.next_power_of_2(width))
    _silu_mul_kernel[(num_rows, triton.cdiv(width, block))](
        gate_up, out, gate_up.stride(0), out.stride(0), width, BLOCK=block, num_warps=4)
    return out


@triton.jit
def _rope_store_kernel(
    qkv_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, q_out_ptr, k_out_ptr,
    qkv_stride, cos_stride, sin_stride, q_stride_t, k_stride_t,
    cache_stride_block, cache_stride_pos, cache_stride_h,
    num_heads, num_kv_heads, block_size,
    HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, KEYS_OUT: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    half: tl.constexpr = HEAD_DIM // 2
    dims = tl.arange(0, HEAD_DIM)
    swapped = (dims + half) % HEAD_DIM
    heads = tl.arange(0, BLOCK_H)
    num_qk = num_heads + num_kv_heads
    row = qkv_ptr + token * qkv_stride
    cos = tl.load(cos_ptr + token * cos_stride + dims)[None, :].to(tl.float32)
    sin = tl.load(sin_ptr + token * sin_stride + dims)[None, :].to(tl.float32)
    mask = (heads < num_qk)[:, None]
    x = tl.load(row + heads[:, None] * HEAD_DIM + dims[None, :], mask=mask, other=0.0)
    xs = tl.load(row + heads[:, None] * HEAD_DIM + swapped[None, :], mask=mask, other=0.0)
    dtype = x.dtype
    rotated = ((x.to(tl.float32) * cos).to(dtype).to(tl.float32) + (xs.to(tl.float32) * sin).to(dtype).to(tl.float32)
               ).to(dtype)
    is_q = (heads < num_heads)[:, None]
    tl.store(q_out_ptr + token * q_stride_t + heads[:, None] * HEAD_DIM + dims[None, :], rotated, mask=is_q)
    if KEYS_OUT:  # the rotated keys for attention that reads them as computed
        tl.store(k_out_ptr + token * k_stride_t + (heads - num_heads)[:, None] * HEAD_DIM + dims[None, :], rotated,
                 mask=mask & (heads >= num_heads)[:, None])
    slot = tl.load(slot_ptr + token)
    if slot >= 0:  # padding rows (slot -1) store nothing
        block = slot // block_size
        offset = slot % block_size
        base = block * cache_stride_block + offset * cache_stride_pos
        kv_heads = heads - num_heads
        is_k = mask & (heads >= num_heads)[:, None]
        tl.store(k_cache_ptr + base + kv_heads[:, None] * cache_stride_h + dims[None, :],
                 rotated.to(k_cache_ptr.dtype.element_ty), mask=is_k)
        v_heads = tl.arange(0, BLOCK_H)
        v_mask = (v_heads < num_kv_heads)[:, None]
        v = tl.load(row + (num_qk + v_heads)[:, None] * HEAD_DIM + dims[None, :], mask=v_mask, other=0.0)
        tl.store(v_cache_ptr + base + v_heads[:, None] * cache_stride_h + dims[None, :],
                 v.to(v_cache_ptr.dtype.element_ty), mask=v_mask)


def rope_store(qkv: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int,
               keys_out: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as ``kernels.ops.rope_store``: rotate queries and keys of the fused projection, store
    keys and values at ``slot_mapping`` (-1: not stored), return the queries [T, Hq, D]; the rotated keys
    also into ``keys_out`` [T, Hkv, D] (unit-stride rows) when given."""
    num_tokens = qkv.shape[0]
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    q = torch.empty(num_tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if num_tokens == 0:
        return q
    assert qkv.stride(-1) == 1 and head_dim & (head_dim - 1) == 0 and k_cache.stride() == v_cache.stride()
    assert keys_out is None or (keys_out.shape == (num_tokens, num_kv_heads, head_dim) and
                                keys_out.stride(1) == head_dim and keys_out.stride(2) == 1)
    cos2, sin2 = cos.reshape(num_tokens, head_dim), signed_sin.reshape(num_tokens, head_dim)
    _rope_store_kernel[(num_tokens,)](
        qkv, cos2, sin2, k_cache, v_cache, slot_mapping, q, q if keys_out is None else keys_out,
        qkv.stride(0), cos2.stride(0), sin2.stride(0), q.stride(0), 0 if keys_out is None else keys_out.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        num_heads, num_kv_heads, k_cache.shape[1],
        HEAD_DIM=head_dim, BLOCK_H=triton.next_power_of_2(num_heads + num_kv_heads), KEYS_OUT=keys_out is not None,
        num_warps=4,
    )
    return q
