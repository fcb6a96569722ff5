"""The Llama-family model, its config, loaders (HF directory, GGUF, presets) and fingerprint."""
from kvmesh.model.config import ModelConfig
from kvmesh.model.loader import LoadedModel, load_model

__all__ = ["LoadedModel", "ModelConfig", "load_model"]
