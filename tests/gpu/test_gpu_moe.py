"""Mixtures of experts on the device: the Triton expert kernels inside the model, with and without CUDA graphs,
against the CPU engine and transformers; the published 30B-A3B shape loads and decodes."""
from __future__ import annotations

import pytest
import torch

from kvmesh import LLM, SamplingParams
from kvmesh.bench.model import _hf_twin

DEVICE = "cuda"
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("model", ["tiny-qwen3-moe", "tiny-mixtral"])
def test_tiny_moe_greedy_streams_on_the_device_equal_the_cpu_in_fp32(model):
    prompts = [[(i * 13 + j) % 250 + 3 for j in range(n)] for i, n in enumerate((5, 31, 70, 9))]
    want = [o.token_ids for o in LLM(model, num_kv_blocks=64, progress=False).generate(prompts, GREEDY,
                                                                                         use_tqdm=False)]
    for eager in (True, False):
        llm = LLM(model, device=DEVICE, dtype="float32", num_kv_blocks=64, max_num_seqs=8, progress=False,
                  enforce_eager=eager)
        assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == want, eager
        if not eager:
            assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.num_replays > 0
        llm.engine.check_integrity()


def test_qwen3_30b_a3b_shape_loads_and_decodes_like_transformers_on_its_weights():
    llm = LLM("qwen3-30b-a3b-dummy", device=DEVICE, dtype="bfloat16", num_kv_blocks=256, max_num_seqs=8,
              progress=False)
    ids = torch.randint(0, 151936, (32,), generator=torch.Generator().manual_seed(0)).tolist()
    out = llm.generate([ids], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.token_ids) == 8
    # transformers' greedy pick after the prompt and after each of our tokens (random weights may well repeat
    # one token: the check is that transformers picks the same ones on the same prefixes)
    hf = _hf_twin(llm.loaded)
    with torch.inference_mode():
        logits = hf(torch.tensor([ids + out.token_ids[:-1]], device=DEVICE)).logits[0, len(ids) - 1:].float()
    picks = logits.argmax(-1).tolist()
    assert picks[0] == out.token_ids[0]
    assert sum(p == t for p, t in zip(picks, out.token_ids)) >= 6, (picks, out.token_ids)  # bf16 routing: near-ties
