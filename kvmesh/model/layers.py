"""Small building blocks of the Llama family: RMSNorm and the SwiGLU MLP."""
from __future__ import annotations

import torch
from torch import nn

from kvmesh.kernels import ops


class RMSNorm(nn.Module):
    """Normalises in float32 and scales in the input dtype (as Hugging Face Llama does)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x + residual, norm(x + residual))``; may add into ``x`` in place (do not reuse the old x)."""
        return ops.add_rms_norm(x, residual, self.weight, self.eps)


class SwiGLU(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, group=None):
        """``group``: a tensor-parallel group (``kvmesh/parallel``); ``intermediate_size`` is then this rank's part
        and ``down_proj``'s partial sums are all-reduced."""
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)  # gate rows, then up rows
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.down_proj(ops.silu_mul(self.gate_up_proj(x)))
        return out if self.group is None else self.group.all_reduce(out)
