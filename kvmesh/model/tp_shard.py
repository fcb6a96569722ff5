"""Which part of a Llama-family model one tensor-parallel rank holds, and its weights cut to that part.

A rank of ``size`` holds (Megatron's split, as vLLM does):

    query heads      a contiguous 1/size of them              (q_proj rows, o_proj columns)
    KV heads         the ones its query heads read: 1/size of them, or when size > num_kv_heads one
                     head shared by size / num_kv_heads ranks (replicated, as vLLM does)
    MLP              1/size of the intermediate dimension     (gate/up rows, down_proj columns)
    experts          1/size of every expert's intermediate    (the same cut of each; the router whole)
    vocabulary       1/size of the rows                       (embedding and lm_head rows)

Column-parallel layers (QKV, gate-up) need no communication; the row-parallel ones (o_proj, down_proj)
and the vocabulary-parallel embedding produce partial sums that one all-reduce completes; logits are
gathered along the vocabulary. Norms, RoPE and biases of row-parallel layers stay whole.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kvmesh.errors import KvmeshError
from kvmesh.model.config import ModelConfig


class TensorParallelError(KvmeshError, ValueError):
    """A tensor-parallel size this model cannot be split by, or a rank that failed."""


def check_tp_size(cfg: ModelConfig, size: int) -> None:
    """Raises TensorParallelError, naming every dimension ``size`` does not divide."""
    if size < 1:
        raise TensorParallelError(f"the tensor-parallel size must be at least 1, got {size}")
    problems = [f"{what} ({n})" for what, n in (("attention heads", cfg.num_heads),
                                                 ("MLP intermediate size", cfg.intermediate_size),
                                                 ("experts' intermediate size", cfg.moe_intermediate_size),
                                                 ("vocabulary", cfg.vocab_size)) if n % size]
    kv = cfg.num_kv_heads
    if (kv % size if size <= kv else size % kv):
        problems.append(f"KV heads ({kv}: the size must divide them or be a multiple of them)")
    if problems:
        raise TensorParallelError(f"tensor-parallel size {size} does not divide this model's "
                                  f"{', '.join(problems)}; choose a size that divides them")


@dataclass(frozen=True)
class TPShard:
    """Rank ``rank`` of ``size`` for ``config`` (checked by ``check_tp_size`` on creation)."""

    config: ModelConfig
    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        check_tp_size(self.config, self.size)
        if not 0 <= self.rank < self.size:
            raise TensorParallelError(f"rank {self.rank} outside a tensor-parallel group of {self.size}")

    @property
    def num_heads(self) -> int:
        return self.config.num_heads // self.size

    @property
    def num_kv_heads(self) -> int:
        return max(1, self.config.num_kv_heads // self.size)

    @property
    def kv_head_ids(self) -> list[int]:
        """The model's KV heads this rank holds, in the order its KV buffer keeps them."""
        kv = self.config.num_kv_heads
        if self.size <= kv:
            return list(range(self.rank * self.num_kv_heads, (self.rank + 1) * self.num_kv_heads))
        return [self.rank // (self.size // kv)]

    def local_config(self) -> ModelConfig:
        """The shapes this rank's modules are built with (head_dim and hidden size unchanged)."""
        cfg = self.config
        return replace(cfg, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                       intermediate_size=cfg.intermediate_size // self.size, vocab_size=cfg.vocab_size // self.size,
                       moe_intermediate_size=cfg.moe_intermediate_size // self.size)

    def vocab_range(self) -> tuple[int, int]:
        per = self.config.vocab_size // self.size
        return self.rank * per, (self.rank + 1) * per

    def shard_hf(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of one Hugging Face-named tensor of the whole model (a view where it can be)."""
        if self.size == 1:
            return tensor
        cfg, hd = self.config, self.config.head_dim
        if name.endswith(".experts.gate_up_proj"):  # [E, 2I, H]: this rank's rows of the gate half and the up half
            per = cfg.moe_intermediate_size // self.size
            gate, up = tensor.chunk(2, dim=1)
            return torch.cat([gate.narrow(1, self.rank * per, per), up.narrow(1, self.rank * per, per)], dim=1)
        if name.endswith(".experts.down_proj"):  # [E, H, I]
            per = cfg.moe_intermediate_size // self.size
            return _cols(tensor, self.rank * per, per)
        leaf = name.rsplit(".", 2)[-2]  # "q_proj" of "model.layers.0.self_attn.q_proj.weight"
        if leaf == "q_proj":
            return _rows(tensor, self.rank * self.num_heads * hd, self.num_heads * hd)
        if leaf in ("k_proj", "v_proj"):
            first = self.kv_head_ids[0]
            return _rows(tensor, first * hd, self.num_kv_heads * hd)
        if leaf == "o_proj":
            return _cols(tensor, self.rank * self.num_heads * hd, self.num_heads * hd)
        per = cfg.intermediate_size // self.size
        if leaf in ("gate_proj", "up_proj"):
            return _rows(tensor, self.rank * per, per)
        if leaf == "down_proj":
            return _cols(tensor, self.rank * per, per)
        if leaf in ("embed_tokens", "lm_head"):
            start, end = self.vocab_range()
            return _rows(tensor, start, end - start)
        return tensor  # norms and anything else every rank holds whole

    def shard_state_dict(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {name: self.shard_hf(name, t) for name, t in state.items()}


def _rows(t: torch.Tensor, start: int, n: int) -> torch.Tensor:
    return t.narrow(0, start, n)


def _cols(t: torch.Tensor, start: int, n: int) -> torch.Tensor:
    return t.narrow(-1, start, n) if t.dim() > 1 else t
