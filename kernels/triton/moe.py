"""Triton mixture-of-experts experts: the (token, choice) pairs sorted by expert, one grouped GEMM per projection.

    1. ``align_by_expert`` (torch, on the device, no host sync, shapes fixed by the token count): each expert's
       pairs get a segment of the sorted order padded to a multiple of BLOCK_M, so every tile of BLOCK_M rows
       belongs to one expert (``tile_experts``; -1 for tiles past the last segment). Padding rows hold the
       sentinel pair ``T k`` and compute nothing that is stored.
    2. ``_gate_up_kernel``: program (tile, column block) loads its rows' tokens of x, multiplies them by its
       expert's gate and up rows and stores ``silu(gate) * up`` into the tile's rows of the intermediate
       buffer [padded rows, I].
    3. ``_down_kernel``: program (tile, column block) multiplies the intermediate rows by its expert's down
       projection, scales each row by its pair's routing weight and stores it at the pair's own row of
       [T k, H]; a sum over each token's k rows gives the output.

Every grid is fixed by the token count, so a decode step with experts captures into a CUDA graph. The torch
reference (``kernels/reference/moe.py``) is the oracle (tests/test_kernels.py, in the interpreter on a CPU).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 16


def align_by_expert(expert_ids: torch.Tensor, num_experts: int, block_m: int = BLOCK_M
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted pair ids [P] with the sentinel ``T k`` in padding rows, the expert of each tile [P / block_m]),
    P = T k + E (block_m - 1) rounded up to block_m: every segment fits whatever the routing."""
    flat = expert_ids.flatten()
    num_pairs = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat))  # bincount would read its maximum on the host: no graph capture
    padded = (counts + block_m - 1) // block_m * block_m
    starts = torch.cumsum(padded, 0) - padded  # each expert's first row in the padded order
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    first_of_expert = torch.cumsum(counts, 0) - counts
    rank = torch.arange(num_pairs, device=flat.device) - first_of_expert[sorted_experts]
    num_rows = -(-(num_pairs + num_experts * (block_m - 1)) // block_m) * block_m
    sorted_pairs = torch.full((num_rows,), num_pairs, dtype=torch.int32, device=flat.device)
    sorted_pairs[starts[sorted_experts] + rank] = order.to(torch.int32)
    tile_starts = torch.arange(0, num_rows, block_m, device=flat.device)
    ends = torch.cumsum(padded, 0)
    tile_experts = torch.searchsorted(ends, tile_starts, right=True).to(torch.int32)
    tile_experts = torch.where(tile_experts < num_experts, tile_experts, -1)
    return sorted_pairs, tile_experts


@triton.jit
def _tile_rows(sorted_pairs_ptr, tile, num_pairs, BLOCK_M: tl.constexpr):
    """A tile's rows of the sorted order, their pairs, and which are pairs (not padding)."""
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pairs_ptr + rows)
    return rows, pairs, pairs < num_pairs


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, sorted_pairs_ptr, tile_experts_ptr, inter_ptr,
                    num_pairs, top_k, hidden, inter_size,
                    x_stride, w_stride_e, w_stride_n, inter_stride,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    tile = tl.program_id(0)
    col_block = tl.program_id(1)
    expert = tl.load(tile_experts_ptr + tile)
    if expert < 0:
        return
    rows, pairs, live = _tile_rows(sorted_pairs_ptr, tile, num_pairs, BLOCK_M)
    tokens = tl.where(live, pairs // top_k, 0).to(tl.int64)
    cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < inter_size
    w_base = w_ptr + expert.to(tl.int64) * w_stride_e
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < hidden
        x = tl.load(x_ptr + tokens[:, None] * x_stride + ks[None, :], mask=live[:, None] & k_mask[None, :],
                    other=0.0)
        w_gate = tl.load(w_base + cols[None, :] * w_stride_n + ks[:, None], mask=col_mask[None, :] & k_mask[:, None],
                         other=0.0)
        w_up = tl.load(w_base + (cols[None, :] + inter_size) * w_stride_n + ks[:, None],
                       mask=col_mask[None, :] & k_mask[:, None], other=0.0)
        acc_gate = tl.dot(x, w_gate, acc_gate, input_precision=PRECISION)
        acc_up = tl.dot(x, w_up, acc_up, input_precision=PRECISION)
    h = acc_gate / (1.0 + tl.exp(-acc_gate)) * acc_up
    tl.store(inter_ptr + rows.to(tl.int64)[:, None] * inter_stride + cols[None, :],
             h.to(inter_ptr.dtype.element_ty), mask=live[:, None] & col_mask[None, :])


@triton.jit
def _down_kernel(inter_ptr, w_ptr, sorted_pairs_ptr, tile_experts_ptr, weights_ptr, out_ptr,
                 num_pairs, hidden, inter_size,
                 inter_stride, w_stride_e, w_stride_n, out_stride,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    tile = tl.program_id(0)
    col_block = tl.program_id(1)
    expert = tl.load(tile_experts_ptr + tile)
    if expert < 0:
        return
    rows, pairs, live = _tile_rows(sorted_pairs_ptr, tile, num_pairs, BLOCK_M)
    cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < hidden
    w_base = w_ptr + expert.to(tl.int64) * w_stride_e
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, inter_size, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < inter_size
        h = tl.load(inter_ptr + rows.to(tl.int64)[:, None] * inter_stride + ks[None, :],
                    mask=live[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_base + cols[None, :] * w_stride_n + ks[:, None], mask=col_mask[None, :] & k_mask[:, None],
                    other=0.0)
        acc = tl.dot(h, w, acc, input_precision=PRECISION)
    scale = tl.load(weights_ptr + pairs, mask=live, other=0.0)
    acc = acc * scale[:, None]
    tl.store(out_ptr + pairs.to(tl.int64)[:, None] * out_stride + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=live[:, None] & col_mask[None, :])


def moe_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, expert_ids: torch.Tensor,
                weights: torch.Tensor) -> torch.Tensor:
    """What ``kernels/reference/moe.moe_experts`` computes (see the module docstring for how)."""
    num_tokens, hidden = x.shape
    num_experts, inter_size = gate_up.shape[0], gate_up.shape[1] // 2
    top_k = expert_ids.shape[1]
    assert x.stride(-1) == 1 and gate_up.stride(-1) == 1 and down.stride(-1) == 1
    if num_tokens == 0:
        return torch.zeros(num_tokens, hidden, dtype=x.dtype, device=x.device)
    sorted_pairs, tile_experts = align_by_expert(expert_ids, num_experts)
    num_pairs = num_tokens * top_k
    inter = torch.empty(sorted_pairs.numel(), inter_size, dtype=x.dtype, device=x.device)
    pair_out = torch.empty(num_pairs, hidden, dtype=torch.float32, device=x.device)
    flat_weights = weights.reshape(-1).to(torch.float32).contiguous()
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    block_n, block_k = 64, 32
    num_tiles = tile_experts.numel()
    _gate_up_kernel[(num_tiles, triton.cdiv(inter_size, block_n))](
        x, gate_up, sorted_pairs, tile_experts, inter, num_pairs, top_k, hidden, inter_size,
        x.stride(0), gate_up.stride(0), gate_up.stride(1), inter.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=precision)
    _down_kernel[(num_tiles, triton.cdiv(hidden, block_n))](
        inter, down, sorted_pairs, tile_experts, flat_weights, pair_out, num_pairs, hidden, inter_size,
        inter.stride(0), down.stride(0), down.stride(1), pair_out.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=precision)
    return pair_out.view(num_tokens, top_k, hidden).sum(1).to(x.dtype)
