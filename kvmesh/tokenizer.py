"""Tokenizers: the model's own (transformers, offline) and a byte-level one for tiny presets."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Protocol


class Tokenizer(Protocol):
    eos_token_ids: tuple[int, ...]

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...

    def apply_chat_template(self, messages: list[dict]) -> str:
        """The prompt text of a chat, ending where the assistant's answer starts."""


def plain_chat_template(messages: list[dict]) -> str:
    """``role: content`` lines, then ``assistant:`` (for models without a template of their own)."""
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; ``bos`` and ``eos`` follow. Decoding drops the specials."""

    def __init__(self, vocab_size: int = 320, eos_token_ids: tuple[int, ...] = (257,)):
        """``eos_token_ids``: a model's own end tokens where it has a real vocabulary but no tokenizer (dummy weights)."""
        if vocab_size < 258:
            raise ValueError("ByteTokenizer needs vocab_size >= 258")
        self.vocab_size = vocab_size
        self.bos_token_id = 256
        self.eos_token_ids = tuple(eos_token_ids)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: list[int]) -> str:
        return bytes(t for t in token_ids if t < 256).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict]) -> str:
        return plain_chat_template(messages)


class HFTokenizer:
    """Wraps a transformers tokenizer; ``encode`` adds no special tokens (the prompt is used as given)."""

    def __init__(self, hf_tokenizer, eos_token_ids: tuple[int, ...]):
        self._tok = hf_tokenizer
        ids = set(eos_token_ids)
        if hf_tokenizer.eos_token_id is not None:
            ids.add(hf_tokenizer.eos_token_id)
        self.eos_token_ids = tuple(sorted(ids))

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False)

    def decode(self, token_ids: list[int]) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict]) -> str:
        if getattr(self._tok, "chat_template", None):
            return self._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return plain_chat_template(messages)

    @classmethod
    def from_directory(cls, path: Path, eos_token_ids: tuple[int, ...]) -> HFTokenizer:
        from transformers import AutoTokenizer

        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        return cls(AutoTokenizer.from_pretrained(str(path), local_files_only=True), eos_token_ids)

    @classmethod
    def from_gguf(cls, path: Path, eos_token_ids: tuple[int, ...]) -> HFTokenizer:
        """Build the tokenizer stored in a GGUF file.

        transformers converts GGUF vocabularies slowly (~10 s for 49k tokens), so the
        converted tokenizer is cached under ``$KVMESH_CACHE_DIR`` keyed by file identity.
        """
        from transformers import AutoTokenizer, PreTrainedTokenizerFast

        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from kvmesh.model.gguf_loader import cache_dir as kvmesh_cache_dir
        from kvmesh.model.gguf_loader import file_identity_key

        cache_dir = kvmesh_cache_dir() / "tokenizers" / file_identity_key(path)
        if (cache_dir / "tokenizer.json").is_file():
            return cls(PreTrainedTokenizerFast.from_pretrained(str(cache_dir), local_files_only=True), eos_token_ids)
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
        try:  # saved whole into a folder of its own, then renamed: a process starting meanwhile never reads half
            cache_dir.parent.mkdir(parents=True, exist_ok=True)
            staging = tempfile.mkdtemp(dir=cache_dir.parent, prefix=f".{cache_dir.name}.")
        except OSError:
            return cls(tok, eos_token_ids)  # a read-only home only costs the next start its conversion time
        try:
            tok.save_pretrained(staging)
            os.rename(staging, cache_dir)
        except OSError:
            pass  # another process converting the same file renamed its copy first
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return cls(tok, eos_token_ids)
