"""Load a GGUF file (llama.cpp's format) with the ``gguf`` package, dequantizing to float32.

llama.cpp's converter permutes the rows of the Llama Q and K projections (it
interleaves the two rotary halves); ``_unpermute`` undoes that so the weights
work with the "rotate half" RoPE of Hugging Face and kvmesh. Mixtures of experts: ``qwen3moe`` files and
``llama`` files with experts (Mixtral), whose experts come stacked (``ffn_gate_exps`` [E, I, H], ...).
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import asdict
from pathlib import Path

import numpy as np
from tqdm import tqdm

from kvmesh.errors import UnsupportedModelError
from kvmesh.file_lock import exclusive
from kvmesh.model.config import ModelConfig, RopeScaling

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "ffn_gate_inp": "mlp.gate",
}
_EXPERT_NAMES = {"ffn_gate_exps": "mlp.experts.gate_proj", "ffn_up_exps": "mlp.experts.up_proj",
                 "ffn_down_exps": "mlp.experts.down_proj"}  # stacked; model/weight_names.py joins gate and up
_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3_moe"}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    value = field.contents()
    return value


def gguf_config(reader) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in _ARCHITECTURES:
        raise UnsupportedModelError(f"GGUF architecture {arch!r} is not supported (supported: "
                                    f"{', '.join(_ARCHITECTURES)})")
    num_heads = int(_field(reader, f"{arch}.attention.head_count"))
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    tensor_names = {t.name for t in reader.tensors}
    vocab = _field(reader, f"{arch}.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    intermediate = int(_field(reader, f"{arch}.feed_forward_length"))
    num_experts = int(_field(reader, f"{arch}.expert_count", 0) or 0)
    architecture = "mixtral" if arch == "llama" and num_experts else _ARCHITECTURES[arch]
    experts = {} if not num_experts else {
        "num_experts": num_experts, "num_experts_per_tok": int(_field(reader, f"{arch}.expert_used_count")),
        "moe_intermediate_size": int(_field(reader, f"{arch}.expert_feed_forward_length", intermediate)),
        "norm_topk_prob": bool(_field(reader, f"{arch}.expert_weights_norm", True)),
        "dense_layers": tuple(i for i in range(int(_field(reader, f"{arch}.block_count")))  # no router: dense
                              if f"blk.{i}.ffn_gate_inp.weight" not in tensor_names)}
    return ModelConfig(
        architecture=architecture,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_layers=int(_field(reader, f"{arch}.block_count")),
        num_heads=num_heads,
        num_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", num_heads)),
        head_dim=int(_field(reader, f"{arch}.attention.key_length", hidden // num_heads)),
        max_position_embeddings=int(_field(reader, f"{arch}.context_length", 2048)),
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        attention_bias=arch == "qwen2",
        qk_norm=arch in ("qwen3", "qwen3moe"),
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
        **experts,
    )


def _unpermute(w: np.ndarray, num_heads: int) -> np.ndarray:
    rows = w.shape[0]
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_name(gguf_name: str) -> str:
    base, _, kind = gguf_name.rpartition(".")  # kind: weight | bias
    if base.startswith("blk."):
        _, layer, part = base.split(".", 2)
        if part in _EXPERT_NAMES:
            return f"model.layers.{layer}.{_EXPERT_NAMES[part]}"
        if part not in _LAYER_NAMES:
            raise UnsupportedModelError(f"unexpected GGUF tensor {gguf_name!r}")
        return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"
    if base not in _GLOBAL_NAMES:
        raise UnsupportedModelError(f"unexpected GGUF tensor {gguf_name!r}")
    return f"{_GLOBAL_NAMES[base]}.{kind}"


def load_gguf(path: Path, progress: bool = True) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    import gguf
    import torch  # here: reading a GGUF's config (a router) needs no torch

    reader = gguf.GGUFReader(str(path))
    config = gguf_config(reader)
    state: dict[str, torch.Tensor] = {}
    tensors = [t for t in reader.tensors if not t.name.startswith("rope_")]
    for t in tqdm(tensors, desc=f"loading {path.name}", disable=not progress, leave=False):
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        w = w.reshape([int(n) for n in reversed(t.shape)])  # GGUF lists dims innermost first
        permuted = config.architecture in ("llama", "mixtral")  # llama.cpp's "llama" files
        if permuted and t.name.endswith("attn_q.weight"):
            w = _unpermute(w, config.num_heads)
        elif permuted and t.name.endswith("attn_k.weight"):
            w = _unpermute(w, config.num_kv_heads)
        if not w.flags.writeable:  # unquantized tensors are views of the read-only memory map
            w = w.copy()
        state[_hf_name(t.name)] = torch.from_numpy(np.ascontiguousarray(w))
    return config, state


def cache_dir() -> Path:
    return Path(os.environ.get("KVMESH_CACHE_DIR", Path.home() / ".cache" / "kvmesh"))


def file_identity_key(path: Path) -> str:
    """Names a file's cached derivatives: path, size and mtime (a rewritten file gets a new key)."""
    stat = path.stat()
    ident = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    return hashlib.blake2b(ident.encode(), digest_size=8).hexdigest()


def load_gguf_cached(path: Path, progress: bool = True) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """``load_gguf`` with the dequantized weights kept as safetensors under ``$KVMESH_CACHE_DIR``.

    Parsing and dequantizing a GGUF costs ~10 s for SmolLM2-135M; the cached copy loads in
    well under a second. A cache that cannot be written only costs the next load that time.
    """
    entry = cache_dir() / "gguf" / file_identity_key(path)
    with exclusive(entry.parent / f".{entry.name}.lock"):  # processes starting at once convert it once
        return _load_or_convert(path, entry, progress)


def _load_or_convert(path: Path, entry: Path, progress: bool) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file, save_file

    if (entry / "config.json").is_file() and (entry / "model.safetensors").is_file():
        cfg = json.loads((entry / "config.json").read_text())
        scaling = cfg.pop("rope_scaling")
        cfg["eos_token_ids"] = tuple(cfg["eos_token_ids"])
        cfg["dense_layers"] = tuple(cfg.get("dense_layers", ()))
        config = ModelConfig(**cfg, rope_scaling=RopeScaling(**scaling) if scaling else None)
        return config, load_file(str(entry / "model.safetensors"))
    config, state = load_gguf(path, progress=progress)
    try:  # each file written under a name of its own and renamed: processes converting at once never mix
        entry.mkdir(parents=True, exist_ok=True)
        _write_into_place(entry / "model.safetensors", lambda tmp: save_file(state, str(tmp)))
        _write_into_place(entry / "config.json", lambda tmp: tmp.write_text(json.dumps(asdict(config))))
    except OSError:
        pass
    return config, state


def _write_into_place(path: Path, write) -> None:
    """``write(tmp)`` to a fresh temporary file beside ``path``, then rename it to ``path``."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    os.close(fd)
    try:
        write(Path(tmp))
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)
