"""Hugging Face parameter names <-> kvmesh's fused layout.

kvmesh runs one matmul for q, k and v (``qkv_proj``) and one for gate and up
(``gate_up_proj``): fewer, wider matmuls. Checkpoints keep Hugging Face's names;
these two functions translate at load and export time.
"""
from __future__ import annotations

import re

import torch

from kvmesh.model.config import ModelConfig

_QKV = ("q_proj", "k_proj", "v_proj")
_GATE_UP = ("gate_proj", "up_proj")


def fuse_hf_state_dict(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """HF names in, kvmesh names out (tensors concatenated along the output dimension)."""
    out = dict(state)
    for i in range(cfg.num_layers):
        attn, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        kinds = ("weight", "bias") if cfg.attention_bias else ("weight",)
        for kind in kinds:
            names = [f"{attn}.{p}.{kind}" for p in _QKV]
            if all(n in out for n in names):
                out[f"{attn}.qkv_proj.{kind}"] = torch.cat([out.pop(n) for n in names])
        names = [f"{mlp}.{p}.weight" for p in _GATE_UP]
        if all(n in out for n in names):
            out[f"{mlp}.gate_up_proj.weight"] = torch.cat([out.pop(n) for n in names])
    return out


def split_to_hf(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """kvmesh names in, HF names out (views, no copies)."""
    q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    out = {}
    for name, t in state.items():
        if m := re.fullmatch(r"(.*)\.qkv_proj\.(weight|bias)", name):
            for part, piece in zip(_QKV, t.split([q_size, kv_size, kv_size])):
                out[f"{m[1]}.{part}.{m[2]}"] = piece
        elif m := re.fullmatch(r"(.*)\.gate_up_proj\.weight", name):
            for part, piece in zip(_GATE_UP, t.chunk(2)):
                out[f"{m[1]}.{part}.weight"] = piece
        else:
            out[name] = t
    return out
