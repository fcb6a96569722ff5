"""The mixture-of-experts feed-forward block (Qwen3-MoE, Mixtral): a router picks ``k`` of ``E`` experts per
token, each a SwiGLU MLP; a token's output is their outputs weighted by the router's probabilities.

Parameters keep Hugging Face's in-memory names and layout (transformers >= 5), stacked per layer:

    mlp.gate.weight               [E, hidden]           the router
    mlp.experts.gate_up_proj      [E, 2 I, hidden]      each expert's gate rows, then its up rows
    mlp.experts.down_proj         [E, hidden, I]

The forward is grouped by expert (``kernels/ops.moe_experts``): the (token, choice) pairs are sorted by
expert, each expert with tokens runs two matmuls over all of its tokens at once, and the weighted results
are summed back per token: every selected expert's weights are read once per step, never once per token.
With tensor parallelism each rank holds 1/size of every expert's intermediate dimension (the router whole),
and one all-reduce completes the block, as the dense MLP does.
"""
from __future__ import annotations

import torch
from torch import nn

from kvmesh.kernels import ops


def route(router_logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, expert ids [T, k]): the ``top_k`` most probable experts of each token under a
    float32 softmax, their probabilities renormalised to sum 1 when ``normalize``."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, expert_ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, expert_ids


class Experts(nn.Module):
    """``num_experts`` SwiGLU MLPs stacked in two tensors (see the module docstring)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return ops.moe_experts(x, self.gate_up_proj, self.down_proj, expert_ids, weights)


class SparseMoE(nn.Module):
    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int,
                 normalize: bool, group=None):
        """``group``: a tensor-parallel group; ``intermediate_size`` is then this rank's part of each expert's."""
        super().__init__()
        self.top_k, self.normalize, self.group = top_k, normalize, group
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = Experts(num_experts, hidden_size, intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, expert_ids = route(self.gate(x), self.top_k, self.normalize)
        out = self.experts(x, expert_ids, weights)
        return out if self.group is None else self.group.all_reduce(out)  # experts' down_proj is row-parallel
