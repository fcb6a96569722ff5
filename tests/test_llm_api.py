"""The offline API and the CLI: inputs, batching, chunking, clear errors."""
from __future__ import annotations

import subprocess
import sys

import pytest

from kvmesh import LLM, SamplingParams
from kvmesh.errors import InvalidRequestError, UnknownModelError


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-qwen3", num_kv_blocks=64, max_model_len=200, progress=False)


def test_text_and_token_prompts_agree(llm):
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    by_text = llm.generate("kvmesh", params, use_tqdm=False)[0]
    by_ids = llm.generate(list(b"kvmesh"), params, use_tqdm=False)[0]
    assert by_text.token_ids == by_ids.token_ids and by_text.prompt == "kvmesh" and by_ids.prompt is None
    assert by_text.text == llm.tokenizer.decode(by_text.token_ids)


def test_chunked_prefill_and_small_budgets_give_identical_outputs():
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    prompts = ["a" * 70, "The quick brown fox jumps over the lazy dog " * 3, "x"]
    wide = LLM("tiny-llama", num_kv_blocks=64, progress=False).generate(prompts, params, use_tqdm=False)
    narrow_llm = LLM("tiny-llama", num_kv_blocks=64, max_num_batched_tokens=24, max_num_seqs=2, progress=False)
    narrow = narrow_llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in narrow] == [o.token_ids for o in wide]
    narrow_llm.engine.check_integrity()
    assert narrow_llm.engine.pool.num_free_blocks == 64


def test_prompt_past_the_context_is_refused(llm):
    with pytest.raises(InvalidRequestError, match="context is 200"):
        llm.generate("y" * 200, SamplingParams(max_tokens=1), use_tqdm=False)
    out = llm.generate("y" * 190, SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.token_ids) == 10 and out.outputs[0].finish_reason == "length"


def test_bad_prompts_are_refused_and_nothing_runs(llm):
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.generate("", SamplingParams(), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        llm.generate([[1, 2, 999]], SamplingParams(), use_tqdm=False)
    with pytest.raises(InvalidRequestError):  # one bad prompt in a batch: none is queued
        llm.generate(["fine", ""], SamplingParams(), use_tqdm=False)
    assert not llm.engine.has_unfinished()
    llm.engine.check_integrity()


def test_unknown_model_is_a_clear_error():
    with pytest.raises(UnknownModelError, match="unknown model 'llama-9000'"):
        LLM("llama-9000")


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvmesh.cli", *args], capture_output=True, text=True, timeout=300)


def test_cli_generate_smollm2_is_sensible_offline():
    res = _cli("generate", "--model", "smollm2-135m", "--prompt", "The capital of France is", "--max-tokens", "8")
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("The capital of France is")
    assert "Paris" in res.stdout


def test_cli_reports_errors_without_a_traceback():
    res = _cli("generate", "--model", "nope", "--prompt", "x")
    assert res.returncode == 2 and "unknown model 'nope'" in res.stderr and "Traceback" not in res.stderr
    res = _cli("generate", "--model", "tiny-llama", "--prompt", "x", "--top-p", "2")
    assert res.returncode == 2 and "top_p" in res.stderr


def test_cli_generate_takes_stop_strings_ignore_eos_and_refuses_what_cannot_fit():
    """``generate`` refuses a max_tokens past the context as the HTTP API does, and takes ``--stop`` and
    ``--ignore-eos``: the text ends right before the first stop string."""
    res = _cli("generate", "--model", "tiny-llama", "--prompt", "x", "--max-tokens", "100000")
    assert res.returncode == 2 and "exceeds the context" in res.stderr and "Traceback" not in res.stderr
    full = _cli("generate", "--model", "tiny-llama", "--prompt", "abc", "--max-tokens", "40", "--ignore-eos")
    assert full.returncode == 0, full.stderr
    text = full.stdout.removeprefix("abc").removesuffix("\n")
    # The stop string: the first printable pair (else character) of the text after its first character that
    # first occurs there (random weights: what they write differs between CPUs' kernels, its alphabet too).
    start, stop = next((i, text[i:i + n]) for n in (2, 1) for i in range(1, len(text) - n)
                       if all(c.isprintable() and c != "\ufffd" for c in text[i:i + n])
                       and text.find(text[i:i + n]) == i)
    cut = _cli("generate", "--model", "tiny-llama", "--prompt", "abc", "--max-tokens", "40", "--ignore-eos",
               "--stop", stop)
    assert cut.returncode == 0 and cut.stdout == "abc" + text[:start] + "\n", (cut.stdout, text, start)
