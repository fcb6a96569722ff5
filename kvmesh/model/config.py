"""ModelConfig: the one description of a Llama-family model kvmesh runs (dense, or mixture-of-experts).

Built from a Hugging Face ``config.json`` dict, from GGUF metadata, or by a
preset. Everything downstream (model, KV layout, fingerprint) reads this.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from kvmesh.cpu_info import cpu_features  # noqa: F401 (parse_dtype looks it up here; tests patch it)
from kvmesh.errors import UnsupportedModelError

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3_moe", "mixtral")
_HF_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
               "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM"}
_MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "moe_layer_step",
               "dense_layers")

DTYPE_NAMES = ("float32", "bfloat16", "float16")  # the torch dtypes of these names: parse_dtype


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3 style frequency scaling (``rope_type == "llama3"``)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # one of SUPPORTED_ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    qk_norm: bool = False  # Qwen3: RMSNorm per head on q and k
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # Mixture of experts (num_experts 0: dense). A MoE layer's router picks num_experts_per_tok experts per
    # token (weights renormalised to sum 1 when norm_topk_prob); every moe_layer_step-th layer is one, except
    # dense_layers, whose MLP is dense with intermediate_size (Qwen3-MoE's decoder_sparse_step, mlp_only_layers).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    moe_layer_step: int = 1
    dense_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"architecture {self.architecture!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        if self.num_heads % self.num_kv_heads != 0:
            raise UnsupportedModelError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise UnsupportedModelError(f"num_experts_per_tok={self.num_experts_per_tok} must be within 1.."
                                        f"{self.num_experts} experts")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx``'s MLP is a mixture of experts."""
        return self.is_moe and layer_idx not in self.dense_layers and (layer_idx + 1) % self.moe_layer_step == 0

    def to_json(self) -> str:
        """Canonical JSON (sorted keys): the config part of the model fingerprint. A dense model leaves the
        mixture-of-experts fields out (its fingerprint is what it was before they existed)."""
        fields = asdict(self)
        if not self.is_moe:
            for name in _MOE_FIELDS:
                fields.pop(name)
        return json.dumps(fields, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_hf_dict(cls, cfg: dict) -> ModelConfig:
        """Map a Hugging Face ``config.json`` dict onto a ModelConfig."""
        try:
            return cls._from_hf_dict(cfg)
        except KeyError as e:
            raise UnsupportedModelError(f"config.json lacks the required key {e.args[0]!r}") from None

    @classmethod
    def _from_hf_dict(cls, cfg: dict) -> ModelConfig:
        model_type = cfg.get("model_type", "")
        if model_type == "mistral":
            model_type = "llama"
        if model_type == "mixtral" and cfg.get("sliding_window") is not None:
            raise UnsupportedModelError(f"sliding-window attention (sliding_window={cfg['sliding_window']}) is not "
                                        "supported")
        if model_type not in SUPPORTED_ARCHITECTURES:
            archs = cfg.get("architectures") or [model_type or "<none>"]
            raise UnsupportedModelError(
                f"model_type {model_type!r} ({', '.join(archs)}) is not supported "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        # transformers >= 5 keeps theta and scaling together in "rope_parameters".
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            architecture=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
            rope_scaling=_rope_scaling_from_hf(rope),
            attention_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            **_moe_from_hf(model_type, cfg),
        )


def _moe_from_hf(model_type: str, cfg: dict) -> dict:
    """The mixture-of-experts fields of a Hugging Face config (none for a dense model)."""
    if model_type == "qwen3_moe":
        # Published configs say num_experts; transformers 5 saves the same number as num_local_experts.
        num_experts = cfg["num_experts"] if "num_experts" in cfg else cfg["num_local_experts"]
        return {"num_experts": num_experts, "num_experts_per_tok": cfg["num_experts_per_tok"],
                "moe_intermediate_size": cfg["moe_intermediate_size"],
                "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),
                "moe_layer_step": int(cfg.get("decoder_sparse_step", 1)),
                "dense_layers": tuple(cfg.get("mlp_only_layers") or ())}
    if model_type == "mixtral":
        return {"num_experts": cfg["num_local_experts"], "num_experts_per_tok": cfg["num_experts_per_tok"],
                "moe_intermediate_size": cfg["intermediate_size"], "norm_topk_prob": True}
    return {}


def _rope_scaling_from_hf(scaling: dict | None) -> RopeScaling | None:
    if not scaling:
        return None
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return None
    if kind != "llama3":
        raise UnsupportedModelError(f"rope scaling {kind!r} is not supported (supported: llama3)")
    return RopeScaling(
        factor=float(scaling["factor"]),
        low_freq_factor=float(scaling["low_freq_factor"]),
        high_freq_factor=float(scaling["high_freq_factor"]),
        original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
    )


def auto_dtype(device: str | torch.device = "cpu") -> torch.dtype:
    """``--dtype auto``: bfloat16 on CUDA and on CPUs with native bf16 math (AMX or AVX512-BF16), else float32."""
    import torch

    if torch.device(device).type == "cuda":
        return torch.bfloat16
    features = cpu_features()
    return torch.bfloat16 if ("amx_bf16" in features or "avx512_bf16" in features) else torch.float32


def parse_dtype(name: str | torch.dtype, device: str | torch.device = "cpu") -> torch.dtype:
    """A dtype name ("float32", "bf16", ... or "auto", resolved for ``device``) -> torch dtype."""
    import torch  # here, so that reading a config (a router) never imports torch

    if isinstance(name, torch.dtype):
        return name
    if name == "auto":
        return auto_dtype(device)
    aliases = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
    key = aliases.get(name, name)
    if key not in DTYPE_NAMES:
        raise ValueError(f"unknown dtype {name!r} (choose from {', '.join(DTYPE_NAMES)})")
    return getattr(torch, key)


def to_hf_dict(cfg: ModelConfig) -> dict:
    """The Hugging Face ``config.json`` dict of a ModelConfig (for saving and for parity tests)."""
    model_type = cfg.architecture
    hf = {
        "model_type": model_type,
        "architectures": [_HF_CLASSES[model_type]],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "hidden_act": "silu",
        "attention_bias": cfg.attention_bias if model_type != "qwen2" else True,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": list(cfg.eos_token_ids) if len(cfg.eos_token_ids) != 1 else cfg.eos_token_ids[0],
    }
    if model_type == "qwen3_moe":
        hf.update(num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                  moe_intermediate_size=cfg.moe_intermediate_size, norm_topk_prob=cfg.norm_topk_prob,
                  decoder_sparse_step=cfg.moe_layer_step, mlp_only_layers=list(cfg.dense_layers))
    elif model_type == "mixtral":
        hf.update(num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                  intermediate_size=cfg.moe_intermediate_size, sliding_window=None)
    if cfg.rope_scaling is not None:
        s = cfg.rope_scaling
        hf["rope_scaling"] = {
            "rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position_embeddings,
        }
    return hf
