"""Torch reference: the rotary embedding's rotation ("rotate half" layout, as Hugging Face Llama)."""
from __future__ import annotations

import torch


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [T, H, D] (queries, keys, or both side by side) with ``RotaryEmbedding.lookup``'s tables."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * signed_sin
