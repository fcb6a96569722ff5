"""Rotary position embedding (the "rotate half" layout Hugging Face Llama uses).

The cos/sin table is computed once in float32 for every position up to the
context length; a forward gathers the rows of its positions, so a prefill that
starts at position k on top of cached KV rotates exactly as a full prefill.
"""
from __future__ import annotations

import math

import torch

from kvmesh.kernels.reference.rotary import rotate
from kvmesh.model.config import RopeScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    return _llama3_scale(inv_freq, scaling)


def _llama3_scale(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths divided by ``factor``, short kept, a smooth ramp between."""
    wavelen = 2 * math.pi / inv_freq
    long_limit = s.original_max_position_embeddings / s.low_freq_factor
    short_limit = s.original_max_position_embeddings / s.high_freq_factor
    ramp = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    blended = (1 - ramp) * inv_freq / s.factor + ramp * inv_freq
    scaled = torch.where(wavelen > long_limit, inv_freq / s.factor, inv_freq)
    in_between = (wavelen >= short_limit) & (wavelen <= long_limit)
    return torch.where(in_between, blended, scaled)


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: RopeScaling | None):
        super().__init__()
        inv_freq = inverse_frequencies(head_dim, theta, scaling)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)
        half = angles.shape[-1] // 2
        sin = angles.sin()
        self.register_buffer("cos_table", angles.cos(), persistent=False)
        # rotate_half(x) * sin == swap_halves(x) * (sin with its first half negated): one op fewer per call,
        # and the same floating-point result (a negation is exact).
        self.register_buffer("signed_sin_table", torch.cat((-sin[:, :half], sin[:, half:]), dim=-1),
                             persistent=False)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin [T, 1, D] for the positions of one forward (shared by every layer)."""
        return (self.cos_table[positions].unsqueeze(1).to(dtype),
                self.signed_sin_table[positions].unsqueeze(1).to(dtype))


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q`` [T, Hq, D] and ``k`` [T, Hkv, D]."""
    return rotate(q, cos, signed_sin), rotate(k, cos, signed_sin)
