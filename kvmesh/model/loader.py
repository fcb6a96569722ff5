"""Resolve a model name or path into a ready model, its tokenizer and its fingerprint.

Accepted: a preset name (``kvmesh.model.presets``), a local Hugging Face directory
(config.json + safetensors), or a ``.gguf`` file. ``load_format="dummy"`` reads only the
config and tokenizer of any of them and draws the weights on the device
(``model/dummy_weights.py``); dummy presets always load that way.
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
from kvmesh.model.card import directory_tokenizer, load_tokenizer, preset_tokenizer
from kvmesh.model.dummy_weights import dummy_fingerprint, fill_dummy_weights
from kvmesh.model.tp_shard import TPShard
from kvmesh.tokenizer import HFTokenizer, Tokenizer


@dataclass(frozen=True)
class LoadedModel:
    name: str
    config: ModelConfig  # the whole model's (with tensor parallelism, ``model.config`` is this rank's part)
    model: LlamaForCausalLM
    tokenizer: Tokenizer
    dtype: torch.dtype
    device: torch.device
    fingerprint: str  # the whole model's: the same at every tensor-parallel size
    load_seconds: float
    tp_size: int = 1


def build_model(config: ModelConfig, state_dict: dict[str, torch.Tensor], dtype: torch.dtype,
                device: torch.device, shard: TPShard | None = None, group=None) -> LlamaForCausalLM:
    """Instantiate without a throwaway random init, adopt the given weights, pack them on the CPU.

    ``shard``/``group``: one tensor-parallel rank's part of the model (``kvmesh/parallel``), cut from the whole
    ``state_dict``."""
    if shard is not None:
        state_dict = shard.shard_state_dict(state_dict)
    with torch.device(device):
        model = _uninitialized(config, shard, group)
    model.load_weights_assign({k: v.to(device=device, dtype=dtype) for k, v in state_dict.items()})
    if can_pack(device, dtype):
        pack_linears(model)
    return model.eval()


LOAD_FORMATS = ("auto", "dummy")
DUMMY_SEED = 0  # the seed of ``--load-format dummy`` for models that are not dummy presets


def load_dummy(name_or_path: str, dtype: torch.dtype, device: torch.device, start: float,
               tp: tuple[int, int, object] | None = None) -> LoadedModel:
    """Config and tokenizer read (no weights); parameters drawn in place on ``device`` in ``dtype``."""
    preset = PRESETS.get(name_or_path)
    card = load_tokenizer(name_or_path)
    seed = preset.seed if preset is not None and preset.seed is not None else DUMMY_SEED
    shard, group = _shard_of(card.config, tp)
    saved_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # parameters made in their dtype: no float32 copy (RoPE tables stay float32)
    try:
        with torch.device(device):
            model = _uninitialized(card.config, shard, group)
    finally:
        torch.set_default_dtype(saved_dtype)
    fill_dummy_weights(model, seed, shard)
    if can_pack(device, dtype):
        pack_linears(model)
    return LoadedModel(
        name=name_or_path, config=card.config, model=model.eval(), tokenizer=card.tokenizer, dtype=dtype,
        device=device, fingerprint=dummy_fingerprint(card.config, dtype, device, seed),
        load_seconds=time.perf_counter() - start, tp_size=1 if shard is None else shard.size,
    )


def _uninitialized(config: ModelConfig, shard: TPShard | None, group) -> LlamaForCausalLM:
    """The whole model of ``config``, or with a shard that rank's part of it."""
    if shard is None:
        return LlamaForCausalLM.uninitialized(config)
    return LlamaForCausalLM.uninitialized(shard.local_config(), group, shard.vocab_range()[0])


def _shard_of(config: ModelConfig, tp: tuple[int, int, object] | None) -> tuple[TPShard | None, object]:
    """``tp``: (rank, size, group) or None; the shard (None at size 1, checked against ``config``) and group."""
    if tp is None:
        return None, None
    rank, size, group = tp
    shard = TPShard(config, rank, size)
    return (shard, group) if size > 1 else (None, None)


def load_model(name_or_path: str, dtype: str | torch.dtype = "float32", device: str | torch.device = "cpu",
               progress: bool = True, load_format: str = "auto", tp: tuple[int, int, object] | None = None
               ) -> LoadedModel:
    """Load a model for ``device``; ``load_format``: ``auto`` (its weights) or ``dummy`` (seeded, made on the device).
    ``tp``: (rank, size, ``TPGroup``): this tensor-parallel rank's part only (``kvmesh/parallel``); a size the
    model cannot be split by raises TensorParallelError."""
    if load_format not in LOAD_FORMATS:
        raise UnknownModelError(f"unknown load format {load_format!r} (choose from {', '.join(LOAD_FORMATS)})")
    start = time.perf_counter()
    torch_device = resolve_device(device) if isinstance(device, str) else torch.device(device)
    torch_dtype = parse_dtype(dtype, torch_device)
    preset = PRESETS.get(name_or_path)
    path = Path(name_or_path).expanduser()
    if load_format == "dummy" or (preset is not None and preset.dummy):
        return load_dummy(name_or_path, torch_dtype, torch_device, start, tp)
    if preset is not None and preset.config is not None:
        config = preset.config
        state = random_state_dict(config, preset.seed or 0)
        weights_digest = digest_state_dict(state)
        tokenizer: Tokenizer = preset_tokenizer(config)
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
    shard, group = _shard_of(config, tp)
    model = build_model(config, state, torch_dtype, torch_device, shard, group)
    return LoadedModel(
        name=name_or_path, config=config, model=model, tokenizer=tokenizer, dtype=torch_dtype,
        device=torch_device, fingerprint=model_fingerprint(config, torch_dtype, weights_digest),
        load_seconds=time.perf_counter() - start, tp_size=1 if shard is None else shard.size,
    )
