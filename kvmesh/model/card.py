"""What a router needs of a model, read without torch or weights: its config and tokenizer.

A preset's config comes from its table, a GGUF file's from its metadata (tensors stay
unread), an HF directory's from ``config.json``; the tokenizer is kvmesh's byte tokenizer
(tiny presets) or the Hugging Face one (``tokenizers``, through transformers' fast
tokenizer classes, which import no torch). ``tests/test_router.py`` checks that a running
``kvmesh router`` never maps libtorch.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from kvmesh.errors import UnknownModelError
from kvmesh.model.config import ModelConfig
from kvmesh.model.hf_loader import is_hf_directory
from kvmesh.model.presets import PRESETS
from kvmesh.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer


@dataclass(frozen=True)
class TokenizerCard:
    """What a router needs of a model: its name, config and tokenizer. No weights are read."""

    name: str
    config: ModelConfig
    tokenizer: Tokenizer


def load_tokenizer(name_or_path: str) -> TokenizerCard:
    """The config and tokenizer of a preset, a GGUF file (metadata only) or an HF directory, without weights."""
    preset = PRESETS.get(name_or_path)
    path = Path(name_or_path).expanduser()
    if preset is not None and preset.config is not None:
        return TokenizerCard(name_or_path, preset.config, preset_tokenizer(preset.config))
    if preset is not None or path.suffix == ".gguf":
        import gguf

        from kvmesh.model.gguf_loader import gguf_config

        gguf_path = preset.gguf_path() if preset is not None else path
        if not gguf_path.is_file():
            raise UnknownModelError(f"GGUF file {gguf_path} does not exist")
        config = gguf_config(gguf.GGUFReader(str(gguf_path)))  # metadata; tensors stay memory-mapped, unread
        return TokenizerCard(name_or_path, config, HFTokenizer.from_gguf(gguf_path, config.eos_token_ids))
    if is_hf_directory(path):
        config = ModelConfig.from_hf_dict(json.loads((path / "config.json").read_text()))
        return TokenizerCard(name_or_path, config, directory_tokenizer(path, config))
    raise UnknownModelError(f"unknown model {name_or_path!r}: not a preset ({', '.join(PRESETS)}), "
                            "a directory with config.json, or a .gguf file")


def preset_tokenizer(config: ModelConfig) -> Tokenizer:
    """A random preset's tokenizer: bytes, ending at the model's own end tokens (token-id prompts for real vocabularies)."""
    return ByteTokenizer(config.vocab_size, config.eos_token_ids or (257,))


def directory_tokenizer(path: Path, config: ModelConfig) -> Tokenizer:
    """An HF directory's tokenizer, or the byte tokenizer where it ships none (the loader uses it too)."""
    has_hf_tokenizer = any((path / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"))
    if has_hf_tokenizer:
        return HFTokenizer.from_directory(path, config.eos_token_ids)
    return preset_tokenizer(config)
