"""Mixture-of-experts experts, grouped by expert, in torch: the CPU path and the oracle of the Triton kernel."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def sort_by_expert(expert_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order [T k]: the flattened (token, choice) pairs sorted by expert, stable; counts [E]: pairs per
    expert). ``order // k`` is each sorted pair's token."""
    flat = expert_ids.flatten()
    return torch.argsort(flat, stable=True), torch.bincount(flat, minlength=num_experts)


def moe_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, expert_ids: torch.Tensor,
                weights: torch.Tensor) -> torch.Tensor:
    """x [T, H]; gate_up [E, 2I, H] (gate rows first); down [E, H, I]; expert_ids, weights [T, k] ->
    sum over k of ``weights * down_e(silu(gate_e x) * up_e x)`` [T, H] in x's dtype.

    Each expert with tokens runs its two matmuls once over all of them (one Python iteration per expert, none
    per token); a token's contributions are added in ascending expert order, as transformers adds them."""
    top_k = expert_ids.shape[1]
    order, counts = sort_by_expert(expert_ids, gate_up.shape[0])
    token_of = order // top_k
    rows = x.index_select(0, token_of)
    out_rows = torch.empty_like(rows)
    start = 0
    for expert, n in enumerate(counts.tolist()):
        if n:
            gate, up = F.linear(rows[start:start + n], gate_up[expert]).chunk(2, dim=-1)
            out_rows[start:start + n] = F.linear(F.silu(gate) * up, down[expert])
            start += n
    scaled = (out_rows * weights.flatten()[order].unsqueeze(-1)).to(x.dtype)
    return torch.zeros_like(x).index_add_(0, token_of, scaled)
