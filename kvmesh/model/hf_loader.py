"""Load a local Hugging Face model directory: ``config.json`` + ``*.safetensors``."""
from __future__ import annotations

import json
from pathlib import Path

from kvmesh.errors import UnknownModelError
from kvmesh.model.config import ModelConfig


def is_hf_directory(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file()


def weight_files(path: Path) -> list[Path]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise UnknownModelError(f"{path}: no *.safetensors files next to config.json")
    return files


def load_hf_directory(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor], list[Path]]:
    """Returns the config, the state dict (names as in the files) and the weight files read."""
    with open(path / "config.json") as f:
        config = ModelConfig.from_hf_dict(json.load(f))
    files = weight_files(path)
    from safetensors.torch import load_file  # torch: only when weights are read

    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(str(file)))
    return config, state, files
