"""Resolve a model name or path into a ready model, its tokenizer and its fingerprint.

Accepted: a preset name (``tiny-llama``, ``tiny-qwen3``, ``smollm2-135m``), a
local Hugging Face directory (config.json + safetensors), or a ``.gguf`` file.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kvmesh.device import resolve_device
from kvmesh.errors import UnknownModelError
from kvmesh.model.config import ModelConfig, parse_dtype
from kvmesh.model.cpu_linear import can_pack, pack_linears
from kvmesh.model.fingerprint import digest_files, digest_state_dict, model_fingerprint
from kvmesh.model.gguf_loader import load_gguf_cached
from kvmesh.model.hf_loader import is_hf_directory, load_hf_directory
from kvmesh.model.llama import LlamaForCausalLM
from kvmesh.model.presets import PRESETS, random_state_dict
from kvmesh.model.card import directory_tokenizer
from kvmesh.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer


@dataclass(frozen=True)
class LoadedModel:
    name: str
    config: ModelConfig
    model: LlamaForCausalLM
    tokenizer: Tokenizer
    dtype: torch.dtype
    device: torch.device
    fingerprint: str
    load_seconds: float


def build_model(config: ModelConfig, state_dict: dict[str, torch.Tensor], dtype: torch.dtype,
                device: torch.device) -> LlamaForCausalLM:
    """Instantiate without a throwaway random init, adopt the given weights, pack them on the CPU."""
    with torch.device(device):
        model = LlamaForCausalLM.uninitialized(config)
    model.load_weights_assign({k: v.to(device=device, dtype=dtype) for k, v in state_dict.items()})
    if can_pack(device, dtype):
        pack_linears(model)
    return model.eval()


def load_model(name_or_path: str, dtype: str | torch.dtype = "float32", device: str | torch.device = "cpu",
               progress: bool = True) -> LoadedModel:
    start = time.perf_counter()
    torch_device = resolve_device(device) if isinstance(device, str) else torch.device(device)
    torch_dtype = parse_dtype(dtype, torch_device)
    preset = PRESETS.get(name_or_path)
    path = Path(name_or_path).expanduser()
    if preset is not None and preset.config is not None:
        config = preset.config
        state = random_state_dict(config, preset.seed or 0)
        weights_digest = digest_state_dict(state)
        tokenizer: Tokenizer = ByteTokenizer(config.vocab_size)
    elif preset is not None or path.suffix == ".gguf":
        gguf_path = preset.gguf_path() if preset is not None else path
        if not gguf_path.is_file():
            raise UnknownModelError(f"GGUF file {gguf_path} does not exist")
        config, state = load_gguf_cached(gguf_path, progress=progress)
        weights_digest = digest_files([gguf_path])
        tokenizer = HFTokenizer.from_gguf(gguf_path, config.eos_token_ids)
    elif is_hf_directory(path):
        config, state, files = load_hf_directory(path)
        weights_digest = digest_files(files)
        tokenizer = directory_tokenizer(path, config)
    else:
        raise UnknownModelError(
            f"unknown model {name_or_path!r}: not a preset ({', '.join(PRESETS)}), "
            "a directory with config.json, or a .gguf file"
        )
    model = build_model(config, state, torch_dtype, torch_device)
    return LoadedModel(
        name=name_or_path, config=config, model=model, tokenizer=tokenizer, dtype=torch_dtype,
        device=torch_device, fingerprint=model_fingerprint(config, torch_dtype, weights_digest),
        load_seconds=time.perf_counter() - start,
    )
