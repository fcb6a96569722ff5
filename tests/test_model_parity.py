"""kvmesh's forward against Hugging Face transformers on the same weights."""
from __future__ import annotations

import pytest
import torch

from kvmesh import LLM, SamplingParams
from kvmesh.device import cpu_features
from tests.conftest import hf_reference, run_prefill

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far"]
# Three chunks of the bf16 prefill attention (128 rows each at this length) and a part of a fourth.
LONG_PROMPT = " ".join(f"Step {i}: add {i * 7 % 13} apples to the basket, then count them again." for i in range(16))


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3"])
def test_tiny_preset_logits_match_transformers(name, request):
    loaded = request.getfixturevalue(name.replace("-", "_"))
    hf = hf_reference(loaded)
    gen = torch.Generator().manual_seed(7)
    for length in (1, 15, 16, 17, 77, 300):  # 300 passes llama3 scaling's original context of 64
        ids = torch.randint(0, 256, (length,), generator=gen).tolist()
        ours, _, _ = run_prefill(loaded, ids)
        with torch.inference_mode():
            ref = hf(torch.tensor([ids])).logits[0]
        assert (ours - ref).abs().max().item() < 1e-4, f"{name} length {length}"


def test_smollm2_logits_match_transformers(smollm2, smollm2_hf):
    tok = smollm2.tokenizer
    worst = 0.0
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        ours, _, _ = run_prefill(smollm2, ids)
        with torch.inference_mode():
            ref = smollm2_hf(torch.tensor([ids])).logits[0]
        worst = max(worst, (ours - ref).abs().max().item())
    print(f"SmolLM2 max |dlogit| = {worst:.2e}")
    assert worst < 2e-3  # logits of magnitude ~20 through 30 fp32 layers


def _hf_greedy(hf, prompt_ids: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False,
                          attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long), pad_token_id=0,
                          eos_token_id=None)
    return out[0, len(prompt_ids):].tolist()


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3"])
def test_tiny_greedy_streams_match_transformers_batched_and_unbatched(name):
    llm = LLM(name, num_kv_blocks=64, progress=False)
    hf = hf_reference(llm.loaded)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    prompt_ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    batched = llm.generate(prompt_ids, params, use_tqdm=False)
    for ids, out in zip(prompt_ids, batched):
        expected = _hf_greedy(hf, ids, 40)
        assert out.token_ids == expected
        assert llm.generate(ids, params, use_tqdm=False)[0].token_ids == expected
    llm.engine.check_integrity()


def test_smollm2_greedy_streams_match_transformers(smollm2_hf):
    llm = LLM("smollm2-135m", num_kv_blocks=64, progress=False)
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    batched = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, batched):
        ids = llm.tokenizer.encode(prompt)
        assert out.prompt_token_ids == ids
        assert out.token_ids == _hf_greedy(smollm2_hf, ids, 32)
    assert llm.generate(PROMPTS[0], params, use_tqdm=False)[0].token_ids == batched[0].token_ids
    assert "Paris" in batched[0].text
    llm.engine.check_integrity()


def test_smollm2_bfloat16_matches_transformers_in_bfloat16(smollm2_hf):
    """The dtype ``--dtype auto`` picks on CPUs with native bf16: same logits and greedy streams as
    transformers run in bf16 on the same GGUF (prefill and the batched decode path both checked).

    The reference is the transformers attention that rounds as ours does on this CPU: eager (scores rounded
    to bf16, as our chunked and native bf16 attention round them), or, where the CPU has AMX and our bf16
    prefill goes through torch's flash kernel, transformers' SDPA. Short prompts agree to the bit. Over a long prompt two bf16 implementations
    cannot: one sum of squares added in another order flips one rounding, and attention carries the
    flip to every later row (our native RMSNorm sums in another order than torch's). There both are
    held to the float32 model instead, and ours must be as close to it as transformers-bf16 is.
    """
    import copy

    hf32 = smollm2_hf  # transformers' own load of the GGUF, in float32; its bf16 twin rounds the same weights
    hf = copy.deepcopy(hf32)
    for param in hf.parameters():  # the weights only: RoPE's frequencies stay float32, as a bf16 load keeps them
        param.data = param.data.to(torch.bfloat16)
    attention = "sdpa" if "amx_tile" in cpu_features() else "eager"
    hf.set_attn_implementation(attention)
    assert hf.config._attn_implementation == attention
    llm = LLM("smollm2-135m", dtype="bfloat16", num_kv_blocks=64, progress=False)
    for prompt in PROMPTS:
        ids = llm.tokenizer.encode(prompt)
        ours, _, _ = run_prefill(llm.loaded, ids)
        with torch.inference_mode():
            ref = hf(torch.tensor([ids])).logits[0].float()
        row_err = (ours - ref).abs().max(-1).values
        assert row_err.max().item() < 1.0, prompt  # logits of magnitude ~20
        assert row_err.mean().item() < 0.05, prompt
        assert torch.equal(ours.argmax(-1), ref.argmax(-1)), prompt
    # The long prompt spans several chunks of the bf16 prefill attention.
    ids = llm.tokenizer.encode(LONG_PROMPT)
    ours, _, _ = run_prefill(llm.loaded, ids)
    with torch.inference_mode():
        ref16 = hf(torch.tensor([ids])).logits[0].float()
        ref32 = hf32(torch.tensor([ids])).logits[0].float()
    ours_err, hf_err = ((x - ref32).abs().max(-1).values for x in (ours, ref16))
    assert ours_err.mean().item() <= 1.1 * hf_err.mean().item()  # ~0.38 both
    assert ours_err.max().item() <= 1.25 * hf_err.max().item()  # ~1.6 both
    ours_flips, hf_flips = ((x.argmax(-1) != ref32.argmax(-1)).sum().item() for x in (ours, ref16))
    assert ours_flips <= hf_flips + 2, (ours_flips, hf_flips)  # of ~280 rows
    batched = llm.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(PROMPTS, batched):
        assert out.token_ids == _hf_greedy(hf, llm.tokenizer.encode(prompt), 16), prompt
    llm.engine.check_integrity()


def test_auto_dtype_follows_the_cpu(monkeypatch):
    from kvmesh.model import config

    monkeypatch.setattr(config, "cpu_features", lambda: ["avx2", "avx512_bf16", "avx512f"])
    assert config.parse_dtype("auto") == torch.bfloat16
    monkeypatch.setattr(config, "cpu_features", lambda: ["amx_bf16", "amx_tile"])
    assert config.parse_dtype("auto") == torch.bfloat16
    monkeypatch.setattr(config, "cpu_features", lambda: ["avx2", "avx512f"])
    assert config.parse_dtype("auto") == torch.float32
    assert config.parse_dtype("auto", "cuda") == torch.bfloat16
    assert config.parse_dtype("bf16") == torch.bfloat16


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3"])
def test_benchmark_twin_holds_kvmesh_weights_and_computes_what_kvmesh_does(name):
    """bench model's transformers twin: kvmesh's own tensors (no second copy at 8B), the same logits."""
    from kvmesh.bench.model import _hf_twin

    llm = LLM(name, num_kv_blocks=64, progress=False)
    exported = llm.loaded.model.hf_state_dict()  # (on the CPU packed linears export fresh tensors each call)
    llm.loaded.model.hf_state_dict = lambda: exported
    hf = _hf_twin(llm.loaded)
    for name, param in hf.named_parameters():  # taken as they are: no second copy of the weights
        assert param.data_ptr() == exported[name].data_ptr(), name
    tokens = list(range(3, 40))
    want, _, _ = run_prefill(llm.loaded, tokens)
    with torch.inference_mode():
        got = hf(torch.tensor([tokens])).logits[0].float()
    assert (got - want).abs().max().item() < 1e-4
    llm.engine.check_integrity()
