"""The Llama family (Llama 2/3, Qwen2, Qwen3, SmolLM2; Qwen3-MoE and Mixtral, whose MLPs are mixtures of
experts, ``model/moe.py``) over the paged KV buffer.

Parameter names follow Hugging Face (``model.layers.N.self_attn.q_proj.weight``
...), so a Hugging Face state dict loads as it is. The forward takes a flat
batch of tokens (decodes first, then prefill chunks) with their positions and
an AttentionMetadata; it writes the new K/V into the buffer and returns hidden
states. ``compute_logits`` runs the head only on the rows that need sampling.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from kvmesh.kernels import ops
from kvmesh.kernels.attention_metadata import AttentionMetadata
from kvmesh.model.config import ModelConfig
from kvmesh.model.layers import RMSNorm, SwiGLU
from kvmesh.model.moe import SparseMoE
from kvmesh.model.rope import RotaryEmbedding, apply_rope
from kvmesh.model.weight_names import fuse_hf_state_dict, split_to_hf


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, group=None):
        """``cfg``: with tensor parallelism (``group``), this rank's heads (``TPShard.local_config``)."""
        super().__init__()
        self.group = group
        self.layer_idx = layer_idx
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.split_sizes = [q_size, kv_size, kv_size]
        self.qkv_proj = nn.Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                kv_buffer: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        k_cache = kv_buffer[:, self.layer_idx, 0]
        v_cache = kv_buffer[:, self.layer_idx, 1]
        fresh_kv = None  # the keys and values as computed, for attention that reads them so (kernels/ops)
        if hasattr(self, "q_norm"):
            q, k, v = qkv.split(self.split_sizes, dim=-1)
            q = self.q_norm(q.reshape(num_tokens, self.num_heads, self.head_dim))
            k = self.k_norm(k.reshape(num_tokens, self.num_kv_heads, self.head_dim))
            q, k = apply_rope(q, k, *rope)
            v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
            ops.store_kv(k, v, k_cache, v_cache, md)
            if ops.takes_fresh_kv(qkv, md):
                fresh_kv = (k, v)
        elif ops.takes_fresh_kv(qkv, md):
            k = torch.empty(num_tokens, self.num_kv_heads, self.head_dim, dtype=qkv.dtype, device=qkv.device)
            q = ops.rope_store(qkv, *rope, k_cache, v_cache, md, self.num_heads, keys_out=k)
            v = qkv[:, self.split_sizes[0] + self.split_sizes[1]:].view(num_tokens, self.num_kv_heads, self.head_dim)
            fresh_kv = (k, v)
        else:  # rotation and the cache write in one kernel call where the CPU kernels are there
            q = ops.rope_store(qkv, *rope, k_cache, v_cache, md, self.num_heads)
        out = ops.paged_attention(q, k_cache, v_cache, md, self.scale, fresh_kv)
        out = self.o_proj(out.reshape(num_tokens, -1))
        return out if self.group is None else self.group.all_reduce(out)  # o_proj is row-parallel


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, group=None):
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx, group)
        if cfg.is_moe_layer(layer_idx):
            self.mlp = SparseMoE(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok,
                                 cfg.moe_intermediate_size, cfg.norm_topk_prob, group)
        else:
            self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, group)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, pending: torch.Tensor | None, rope, kv_buffer, md
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the residual stream; pending: the previous layer's MLP output not yet added to it (None
        for the first layer). Returns (stream, this layer's MLP output): each residual add is fused
        into the norm that follows it."""
        if pending is None:
            h = self.input_layernorm(x)
        else:
            x, h = self.input_layernorm.add_forward(x, pending)
        x, h = self.post_attention_layernorm.add_forward(x, self.self_attn(h, rope, kv_buffer, md))
        return x, self.mlp(h)


class LlamaBackbone(nn.Module):
    def __init__(self, cfg: ModelConfig, group=None):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, group) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


@contextlib.contextmanager
def _uninitialized_parameters():
    """Build modules without their random init (the weights are replaced right after)."""
    saved = nn.Linear.reset_parameters, nn.Embedding.reset_parameters
    nn.Linear.reset_parameters = nn.Embedding.reset_parameters = lambda self: None
    try:
        yield
    finally:
        nn.Linear.reset_parameters, nn.Embedding.reset_parameters = saved


class LlamaForCausalLM(nn.Module):
    """Call ``forward`` under ``torch.inference_mode``; it mutates ``kv_buffer`` in place."""

    @classmethod
    def uninitialized(cls, cfg: ModelConfig, group=None, vocab_start: int = 0) -> LlamaForCausalLM:
        """A model whose parameters hold garbage until ``load_weights_assign``."""
        with _uninitialized_parameters():
            return cls(cfg, group, vocab_start)

    def __init__(self, cfg: ModelConfig, group=None, vocab_start: int = 0):
        """``group``: a tensor-parallel group (``kvmesh/parallel``): ``cfg`` is then this rank's part of the model
        (``TPShard.local_config``), whose vocabulary rows start at ``vocab_start``."""
        super().__init__()
        self.config = cfg
        self.group = group
        self.vocab_start = vocab_start
        self.model = LlamaBackbone(cfg, group)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_buffer: torch.Tensor,
                md: AttentionMetadata, num_layers: int | None = None) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden]; K/V of all T tokens are stored.

        ``num_layers``: run only the first layers (then the final norm), storing K/V of those layers
        only: an early-exit draft of the same model (speculative decoding's self-draft).
        """
        x = self._embed(input_ids)
        rope = self.rope.lookup(positions, x.dtype)
        pending = None
        for layer in self.model.layers[:num_layers]:
            x, pending = layer(x, pending, rope, kv_buffer, md)
        return self.model.norm(x) if pending is None else self.model.norm.add_forward(x, pending)[1]

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            return self.model.embed_tokens(input_ids)
        local = input_ids - self.vocab_start  # this rank's rows; the others' ids look up zeros, summed away
        outside = (local < 0) | (local >= self.config.vocab_size)
        x = self.model.embed_tokens(local.masked_fill(outside, 0))
        return self.group.all_reduce(x.masked_fill(outside.unsqueeze(-1), 0))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits [rows, vocab] in float32; with tensor parallelism the whole vocabulary on rank 0, None on the
        other ranks (each computes its rows of the vocabulary, gathered to rank 0)."""
        logits = self.lm_head(hidden).float()
        return logits if self.group is None else self.group.gather_columns(logits)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights under Hugging Face's names (for exporting and for reference models)."""
        return split_to_hf(self.state_dict(), self.config)

    def load_weights_assign(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Adopt a Hugging Face-named state dict (tensors are taken, not copied).

        Missing or unexpected names raise; tied embeddings end up as one parameter.
        """
        state = {k: v for k, v in state_dict.items() if not k.endswith("rotary_emb.inv_freq")}
        state = fuse_hf_state_dict(state, self.config)
        if self.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        expected = {name for name, _ in self.named_parameters()}
        missing, unexpected = sorted(expected - state.keys()), sorted(state.keys() - expected)
        if missing or unexpected:
            raise ValueError(f"weights do not match the config: missing {missing[:5]}, unexpected {unexpected[:5]}")
        self.load_state_dict(state, strict=False, assign=True)
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
