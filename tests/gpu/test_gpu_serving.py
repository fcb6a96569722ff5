"""On a CUDA device: SmolLM2 against transformers on the same GPU, sampling, KV staging, a 1P+1D cluster.

Everything here runs the serving path (``--device cuda``): the model, the KV buffer and the Triton
kernels on the GPU, the transfer engine on a host mirror of the KV buffer unless GPUDirect RDMA is there.
"""
from __future__ import annotations

import random

import pytest
import torch

from kvmesh import LLM, SamplingParams
from kvmesh.bench.model import _hf_twin
from kvmesh.cluster.local_launcher import LocalCluster
from kvmesh.transfer.kv_memory import KVMemory, MemoryChoice
from tests.conftest import run_prefill

PROMPTS = [[(i * 977 + j * 31) % 49152 for j in range(n)] for i, n in enumerate((6, 17, 40))]  # ids
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-4), (torch.bfloat16, 0.05)])
def test_smollm2_on_the_gpu_matches_transformers_on_the_gpu(dtype, tolerance):
    """SmolLM2's shape (seeded weights: the GGUF is more than a device call carries) against transformers' model
    holding the same tensors: logits of every prompt position within the dtype's rounding of their scale; in fp32
    (Triton's ieee dots) the greedy streams of the batched engine equal transformers' ``generate``."""
    llm = LLM("smollm2-135m-dummy", dtype=dtype, device="cuda", num_kv_blocks=256, progress=False)
    assert llm.loaded.device.type == "cuda"
    hf = _hf_twin(llm.loaded)
    for ids in PROMPTS:
        ours, _, _ = run_prefill(llm.loaded, ids)
        with torch.inference_mode():
            ref = hf(torch.tensor([ids], device="cuda")).logits[0].float()
        scale = ref.abs().max().item()  # seeded weights' logits reach the hundreds: the bound is relative
        assert (ours.float() - ref).abs().max().item() < tolerance * scale, ids
    if dtype == torch.float32:
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        for ids, out in zip(PROMPTS, outs):
            with torch.inference_mode():
                want = hf.generate(torch.tensor([ids], device="cuda"), max_new_tokens=24, min_new_tokens=24,
                                   do_sample=False)[0, len(ids):].tolist()
            assert out.token_ids == want, ids
    llm.engine.check_integrity()


def test_seeded_sampling_on_the_gpu_repeats_itself():
    """Requests' generators live on the CPU: sampled rows are drawn there, whatever the model's device."""
    llm = LLM("tiny-llama", device="cuda", num_kv_blocks=256, progress=False)
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, top_k=40, seed=7, logprobs=2)
    first, second = (llm.generate([list(range(3, 40))] * 2, params, use_tqdm=False) for _ in range(2))
    assert [o.token_ids for o in first] == [o.token_ids for o in second]
    llm.engine.check_integrity()


def test_host_staging_copies_device_blocks_both_ways():
    kv = torch.randn(64, 2, 2, 16, 2, 8, device="cuda")
    memory = KVMemory(kv, MemoryChoice("host-staging", "test"))
    assert memory.registered.device.type == "cpu" and memory.registered.is_pinned()
    memory.stage_out([5, 6, 7, 40])
    assert torch.equal(memory.registered[[5, 6, 7, 40]], kv[[5, 6, 7, 40]].cpu())
    memory.registered[9] = 3.0
    memory.stage_in([9])
    assert torch.equal(kv[9].cpu(), torch.full_like(kv[9].cpu(), 3.0))


def test_one_prefill_one_decode_on_one_gpu_match_the_single_node_engine():
    """Both node processes on one GPU (fp32); every prompt past a block is computed by the prefill node and
    pushed; the tokens equal the single-node engine's on the same GPU."""
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (70, 33, 100, 17, 48)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    single = LLM("tiny-llama", device="cuda", num_kv_blocks=256, progress=False)
    want = [o.token_ids for o in single.generate(prompts, params, use_tqdm=False)]
    args = ["--device", "cuda", "--num-kv-blocks", "256", "--kv-placement", "threshold:0"]
    with LocalCluster(num_prefill=1, num_decode=1, node_args=args, cluster="gpu-1p1d") as cluster:
        out = cluster.client("decode-0").generate_many(prompts, params)
        assert [c.error for c in out] == [""] * len(prompts)
        assert [c.token_ids for c in out] == want
        assert all(c.stats.tokens_from_prefill_node > 0 for c, p in zip(out, prompts) if len(p) > 32)
        decode = cluster.client("decode-0").stats(check=True)
        assert decode["device"].startswith("cuda:0")
        memory = decode["kv_memory"]
        assert memory["mode"] == "direct" or memory["blocks_staged_in"] > 0, memory
