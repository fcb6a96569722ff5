"""On a CUDA device: the compiled Triton kernels (bf16 included) and the model on the GPU.

tests/test_kernels.py runs on the GPU too (its DEVICE is cuda there); this file adds
what only a GPU can show: bf16 through the model, and GPU == CPU logits.
"""
from __future__ import annotations

import pytest
import torch

from kvmesh.kernels import ops
from kvmesh.model import load_model
from tests.conftest import run_prefill


def test_dispatch_picks_triton_for_cuda_tensors():
    assert ops.use_triton(torch.zeros(1, device="cuda"))
    assert not ops.use_triton(torch.zeros(1))


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3"])
def test_gpu_forward_matches_cpu(name):
    cpu = load_model(name)
    gpu = load_model(name, device="cuda")
    tokens = list(range(5, 140))
    want, _, _ = run_prefill(cpu, tokens)
    got, kv, blocks = run_prefill(gpu, tokens[:77])
    got_rest, _, _ = run_prefill(gpu, tokens[77:], kv=kv, block_ids=blocks, start=77)
    assert (got.cpu() - want[:77]).abs().max().item() < 1e-3
    assert (got_rest.cpu() - want[77:]).abs().max().item() < 1e-3


def test_bf16_model_on_gpu_tracks_fp32():
    fp32 = load_model("tiny-llama", device="cuda")
    bf16 = load_model("tiny-llama", device="cuda", dtype="bfloat16")
    tokens = list(range(20, 120))
    a, _, _ = run_prefill(fp32, tokens)
    b, _, _ = run_prefill(bf16, tokens)
    assert (a - b).abs().max().item() < 0.25
    assert (a.argmax(-1) == b.argmax(-1)).float().mean().item() > 0.9
