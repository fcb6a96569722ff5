"""Dummy weights at real sizes on the device: made there, and kvmesh's greedy stream equals transformers' on them.

fp32 at 8B needs two copies of 32 GB (kvmesh's and transformers'): Llama-3.2-1B's shape stands in for
the parity check; the 8B shapes are loaded in bf16 and must decode finite, distinct tokens.
"""
from __future__ import annotations

import pytest
import torch

from kvmesh import LLM, SamplingParams
from kvmesh.bench.model import _hf_twin

DEVICE = "cuda"


def test_dummy_1b_greedy_stream_equals_transformers_in_fp32():
    llm = LLM("llama3.2-1b-dummy", device=DEVICE, dtype="float32", num_kv_blocks=256, progress=False)
    assert llm.loaded.model.model.embed_tokens.weight.device.type == torch.device(DEVICE).type
    hf = _hf_twin(llm.loaded).to(DEVICE)
    ids = torch.randint(1000, 100000, (48,), generator=torch.Generator().manual_seed(0)).tolist()
    out = llm.generate([ids], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True), use_tqdm=False)[0]
    with torch.inference_mode():
        t = torch.tensor([ids], device=DEVICE)
        expected = hf.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=16, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    assert len(out.token_ids) == 16 and out.token_ids == expected
    llm.engine.check_integrity()


@pytest.mark.parametrize("model", ["llama3-8b-dummy", "qwen3-8b-dummy"])
def test_dummy_8b_loads_on_the_device_and_decodes(model):
    llm = LLM(model, device=DEVICE, dtype="bfloat16", num_kv_blocks=512, progress=False)
    assert {p.device.type for p in llm.loaded.model.parameters()} == {"cuda"}  # drawn there, never on the host
    ids = torch.randint(1000, 100000, (4, 64), generator=torch.Generator().manual_seed(1)).tolist()
    outs = llm.generate(ids, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert all(len(o.token_ids) == 8 for o in outs)
    assert len({tuple(o.token_ids) for o in outs}) > 1  # different prompts, different streams: not degenerate
    llm.engine.check_integrity()
