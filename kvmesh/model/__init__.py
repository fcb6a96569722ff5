"""The Llama-family model, its config, loaders (HF directory, GGUF, presets), fingerprint, and the torch-free
model card a router reads (``card``)."""
from __future__ import annotations

__all__ = ["LoadedModel", "ModelConfig", "load_model"]


def __getattr__(name: str):
    # Lazy: ``kvmesh.model.card`` (a router) must not import the model, hence torch.
    if name == "ModelConfig":
        from kvmesh.model.config import ModelConfig
        return ModelConfig
    if name in ("LoadedModel", "load_model"):
        from kvmesh.model import loader
        return getattr(loader, name)
    raise AttributeError(f"module 'kvmesh.model' has no attribute {name!r}")
