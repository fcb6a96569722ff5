"""Hugging Face parameter names <-> kvmesh's fused layout.

kvmesh runs one matmul for q, k and v (``qkv_proj``) and one for gate and up
(``gate_up_proj``): fewer, wider matmuls. Checkpoints keep Hugging Face's names;
these two functions translate at load and export time.

Mixture-of-experts layers keep transformers' stacked in-memory layout (``model/moe.py``); checkpoints store
one tensor per expert (Qwen3-MoE: ``mlp.experts.E.gate_proj``/``up_proj``/``down_proj``; Mixtral:
``block_sparse_moe.experts.E.w1``/``w3``/``w2``, its router ``block_sparse_moe.gate``) and GGUF files one
stacked tensor per projection: loading stacks and renames them.
"""
from __future__ import annotations

import re

import torch

from kvmesh.model.config import ModelConfig

_QKV = ("q_proj", "k_proj", "v_proj")
_GATE_UP = ("gate_proj", "up_proj")
_EXPERT_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))  # Qwen3-MoE, Mixtral checkpoints


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
        if cfg.is_moe_layer(i):
            _stack_experts(out, f"model.layers.{i}", cfg.num_experts)
    return out


def _stack_experts(out: dict[str, torch.Tensor], layer: str, num_experts: int) -> None:
    """One MoE layer's checkpoint tensors -> ``mlp.gate.weight``, ``mlp.experts.gate_up_proj``/``down_proj``."""
    mlp, mixtral = f"{layer}.mlp", f"{layer}.block_sparse_moe"
    for name in [n for n in out if n.startswith(mixtral + ".")]:
        out[mlp + name[len(mixtral):]] = out.pop(name)
    for gate, up, down in _EXPERT_NAMES:
        per_expert = [[f"{mlp}.experts.{e}.{p}.weight" for e in range(num_experts)] for p in (gate, up, down)]
        if all(n in out for names in per_expert for n in names):
            gates, ups, downs = ([out.pop(n) for n in names] for names in per_expert)
            out[f"{mlp}.experts.gate_up_proj"] = torch.cat([torch.stack(gates), torch.stack(ups)], dim=1)
            out[f"{mlp}.experts.down_proj"] = torch.stack(downs)
    stacked = [f"{mlp}.experts.{p}" for p in _GATE_UP]  # GGUF: [E, I, H] each
    if all(n in out for n in stacked):
        out[f"{mlp}.experts.gate_up_proj"] = torch.cat([out.pop(n) for n in stacked], dim=1)


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
