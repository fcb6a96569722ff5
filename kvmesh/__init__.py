"""kvmesh: prefill/decode disaggregated LLM serving with a cluster-wide KV-cache pool."""
from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # Lazy, so `import kvmesh.kernels` or the CLI's --help do not pay for torch and the model.
    if name == "LLM":
        from kvmesh.engine.llm import LLM
        return LLM
    if name == "SamplingParams":
        from kvmesh.engine.sampling_params import SamplingParams
        return SamplingParams
    raise AttributeError(f"module 'kvmesh' has no attribute {name!r}")
