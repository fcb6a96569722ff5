"""Dummy weights (``--load-format dummy``): seeded random weights of a real shape, made on the device.

Speed is measured at real sizes without downloading real weights: every parameter is drawn
in place on the target device, in the target dtype, from a generator seeded by
``(seed, parameter name)``, so nothing is read from disk, no second copy is held, and every
process that asks for the same model, dtype, device kind and seed builds the same weights.
Their fingerprint is therefore computed from that recipe, not from the tensors (hashing 16 GB
of weights would take longer than making them). CPU and CUDA generators draw different
numbers, so the device kind is part of the recipe.

Scales keep activations finite and logits spread at any depth: linears draw with standard
deviation ``1/sqrt(fan_in)`` (each projection of a normalised input has unit scale), embeddings
with 1, norms are 1 plus a little noise, biases small. Greedy choices are then rarely near-ties,
so streams of kvmesh and transformers on the same dummy weights can be compared token by token.
"""
from __future__ import annotations

import hashlib

import torch

from kvmesh.model.config import ModelConfig
from kvmesh.model.fingerprint import model_fingerprint

RECIPE_VERSION = "dummy-v1"


def parameter_seed(seed: int, name: str) -> int:
    """The generator seed of one parameter: independent of the order parameters are made in."""
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8, person=b"kvmesh-dummy").digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _std_of(name: str, param: torch.Tensor) -> tuple[float, float]:
    """(mean, standard deviation) a parameter is drawn with."""
    if "norm" in name:
        return 1.0, 0.02
    if name.endswith(".bias"):
        return 0.0, 0.02
    if "embed_tokens" in name:
        return 0.0, 1.0
    return 0.0, param.shape[-1] ** -0.5


@torch.no_grad()
def fill_dummy_weights(model: torch.nn.Module, seed: int, shard=None) -> None:
    """Draw every parameter of ``model`` in place on its own device and dtype (tied ones once).

    ``shard``: ``model`` is one tensor-parallel rank's part (``kvmesh/model/tp_shard.py``): each parameter is
    drawn whole, as the whole model draws it, and cut to this rank's part, one parameter at a time (no rank
    holds more than one whole parameter), so every TP size gets the same weights."""
    whole = None
    if shard is not None and shard.size > 1:
        from kvmesh.model.llama import LlamaForCausalLM

        with torch.device("meta"):
            whole = dict(LlamaForCausalLM.uninitialized(shard.config).named_parameters())
    for name, param in model.named_parameters():
        generator = torch.Generator(device=param.device).manual_seed(parameter_seed(seed, name))
        if whole is None:
            mean, std = _std_of(name, param)
            param.normal_(mean, std, generator=generator)
            continue
        mean, std = _std_of(name, whole[name])
        drawn = torch.empty(whole[name].shape, dtype=param.dtype, device=param.device)
        drawn.normal_(mean, std, generator=generator)
        param.copy_(_cut(name, drawn, shard))


def _cut(name: str, tensor: torch.Tensor, shard) -> torch.Tensor:
    """A kvmesh-named (fused) tensor of the whole model cut to ``shard``'s part."""
    from kvmesh.model.weight_names import fuse_hf_state_dict, split_to_hf

    pieces = shard.shard_state_dict(split_to_hf({name: tensor}, shard.config))
    (fused,) = fuse_hf_state_dict(pieces, shard.local_config()).values()
    return fused


def dummy_fingerprint(config: ModelConfig, dtype: torch.dtype, device: torch.device, seed: int) -> str:
    """The fingerprint of dummy weights: the recipe that makes them (config, dtype, device kind, seed)."""
    return model_fingerprint(config, dtype, f"{RECIPE_VERSION}:seed={seed}:device={device.type}")


def num_parameters(config: ModelConfig) -> int:
    """Parameters of a Llama-family model of this config (tied embeddings counted once), without building it."""
    h, kv = config.hidden_size, config.num_kv_heads * config.head_dim
    q = config.num_heads * config.head_dim
    per_layer = h * (q + 2 * kv) + q * h + 2 * h
    if config.attention_bias:
        per_layer += q + 2 * kv
    if config.qk_norm:
        per_layer += 2 * config.head_dim
    mlps = sum(config.num_experts * (3 * h * config.moe_intermediate_size + h) if config.is_moe_layer(i) else
               3 * h * config.intermediate_size for i in range(config.num_layers))
    embeddings = config.vocab_size * h * (1 if config.tie_word_embeddings else 2)
    return config.num_layers * per_layer + mlps + embeddings + h
