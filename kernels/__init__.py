"""Attention and cache kernels: torch references (CPU) and Triton (CUDA), dispatched in ``ops``."""
from kvmesh.kernels.attention_metadata import AttentionMetadata

__all__ = ["AttentionMetadata"]
