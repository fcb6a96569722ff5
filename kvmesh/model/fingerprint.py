"""Model fingerprint: the first field of the block-hash namespace (docs/design.md §4).

It changes whenever the weights, the config or the dtype change, so KV computed
by one model can never be matched by another. Weights are digested from their
source files when there are any (cheap: bytes stream through blake2b) or from
the tensors themselves (random presets).
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from kvmesh.model.config import ModelConfig

_CHUNK = 1 << 22


def digest_files(paths: list[Path]) -> str:
    h = hashlib.blake2b(digest_size=16, person=b"kvmesh-wt-files")
    for path in sorted(paths):
        h.update(path.name.encode() + b"\0")
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
    return h.hexdigest()


def digest_state_dict(state_dict: dict[str, torch.Tensor]) -> str:
    h = hashlib.blake2b(digest_size=16, person=b"kvmesh-wt-tensr")
    for name in sorted(state_dict):
        t = state_dict[name].detach().contiguous().cpu()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}\0".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def model_fingerprint(config: ModelConfig, dtype: torch.dtype, weights_digest: str) -> str:
    h = hashlib.blake2b(digest_size=16, person=b"kvmesh-model-v1")
    h.update(config.to_json().encode())
    h.update(str(dtype).encode())
    h.update(weights_digest.encode())
    return h.hexdigest()
