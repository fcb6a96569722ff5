"""Attention and cache kernels: torch references (CPU) and Triton (CUDA), dispatched in ``ops``; native CPU kernels
(``cpu``, ctypes); the prefix cache's CPython extensions (``extensions``: the block hash chain, the pool's index)."""
__all__ = ["AttentionMetadata"]


def __getattr__(name: str):
    # Lazy, so that importing a torch-free part of the package (the CPU library's loader, from a process that
    # never runs the model) does not import torch.
    if name == "AttentionMetadata":
        from kvmesh.kernels.attention_metadata import AttentionMetadata
        return AttentionMetadata
    raise AttributeError(f"module 'kvmesh.kernels' has no attribute {name!r}")
