"""Speculative decoding: output identical to plain decoding (greedy), exact distribution (sampling)."""
from __future__ import annotations

import pytest
import torch

from kvmesh import LLM, SamplingParams
from kvmesh.engine.sequence import Sequence
from kvmesh.engine.spec_decode.proposers import AdaptiveSpeculation, NgramProposer, Proposal
from kvmesh.engine.spec_decode.rejection import verify_drafts
from kvmesh.engine.spec_decode.speculator import SpeculativeConfig

# Copy-heavy prompts (prompt lookup finds its guesses) and one without repeats.
PROMPTS = ["one two three four one two three four one two three four one two",
           "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a",
           "A quiet morning; nothing repeats here, not a single word!"]
GREEDY = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
CONFIGS = [SpeculativeConfig(method="ngram"), SpeculativeConfig(method="self-draft", draft_layers=1)]


def _plain(model: str) -> dict:
    llm = LLM(model, num_kv_blocks=256, progress=False)
    return {p: out.outputs[0] for p, out in zip(PROMPTS, llm.generate(PROMPTS, GREEDY, use_tqdm=False))}


@pytest.fixture(scope="module")
def plain():
    return _plain("tiny-llama")


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen3", "tiny-mixtral"])
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.method)
def test_greedy_output_is_identical_with_speculation(config, model, plain):
    want = plain if model == "tiny-llama" else _plain(model)
    llm = LLM(model, num_kv_blocks=256, progress=False, speculative=config)
    batched = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    for prompt, out in zip(PROMPTS, batched):
        assert out.outputs[0].token_ids == want[prompt].token_ids, prompt
    alone = llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)[0]
    assert alone.outputs[0].token_ids == want[PROMPTS[0]].token_ids
    stats = llm.engine.speculator.stats()
    assert stats["spec_draft_tokens"] > 0  # guesses were really verified
    if config.method == "ngram":
        assert stats["spec_accepted_tokens"] > 0 and llm.engine.num_steps < 3 * 48  # fewer steps than tokens
    llm.engine.check_integrity()


def test_logprobs_and_stop_tokens_match_plain_decoding(plain):
    """A stop token in the middle of a verified run ends the request exactly where plain decoding does."""
    want = plain[PROMPTS[0]].token_ids
    stop_at = want[20]
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_at], logprobs=2)
    base = LLM("tiny-llama", num_kv_blocks=256, progress=False).generate(PROMPTS[0], params, use_tqdm=False)[0]
    spec = LLM("tiny-llama", num_kv_blocks=256, progress=False, speculative=CONFIGS[0])
    out = spec.generate(PROMPTS[0], params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == base.outputs[0].token_ids == want[: want.index(stop_at) + 1]
    assert out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].cumulative_logprob == pytest.approx(base.outputs[0].cumulative_logprob, abs=1e-3)
    spec.engine.check_integrity()


def test_smollm2_greedy_identical_with_both_proposers():
    prompt = "List: apples, pears, plums. Again: apples, pears, plums. Again: apples, pears,"
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    want = LLM("smollm2-135m", num_kv_blocks=64, progress=False).generate(prompt, params, use_tqdm=False)[0]
    for config in (SpeculativeConfig(method="ngram"), SpeculativeConfig(method="self-draft")):
        llm = LLM("smollm2-135m", num_kv_blocks=64, progress=False, speculative=config)
        got = llm.generate(prompt, params, use_tqdm=False)[0]
        assert got.outputs[0].token_ids == want.outputs[0].token_ids, config.method
        assert llm.engine.speculator.stats()["spec_draft_tokens"] > 0
        llm.engine.check_integrity()


# ---- the rejection sampler against the target distribution ----------------------------------------------

V = 6
TARGET = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 1.5])  # logits of every row
DRAFT_Q = torch.tensor([0.05, 0.5, 0.05, 0.3, 0.05, 0.05])  # the draft prefers tokens the target does not


def _first_tokens(draft_of, trials: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=1.0, max_tokens=8)
    counts = torch.zeros(V)
    logits = TARGET.repeat(3, 1)
    for _ in range(trials):
        ids, probs = draft_of(gen)
        counts[verify_drafts(logits, ids, params, gen, probs).token_ids[0]] += 1
    return counts


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def _sampled_draft(gen):
    ids = torch.multinomial(DRAFT_Q, 2, replacement=True, generator=gen).tolist()
    return ids, DRAFT_Q.repeat(2, 1)


def _point_draft(gen):
    return [1, 3], None  # prompt lookup: fixed guesses


CHI2_CRITICAL_5DOF_P001 = 20.5  # chi-square, 5 degrees of freedom, p = 0.001


@pytest.mark.parametrize("draft_of", [_sampled_draft, _point_draft], ids=["sampled-draft", "point-mass-draft"])
def test_rejection_sampler_reproduces_the_target_distribution(draft_of):
    p = torch.softmax(TARGET, dim=-1)
    counts = _first_tokens(draft_of, 6000)
    assert _chi_square(counts, p) < CHI2_CRITICAL_5DOF_P001, counts


def test_a_sampler_that_trusts_the_draft_fails_the_same_check():
    """The check has power: always accepting the draft yields the draft's distribution, which it rejects."""
    gen = torch.Generator().manual_seed(1)
    counts = torch.zeros(V)
    for _ in range(6000):
        counts[torch.multinomial(DRAFT_Q, 1, generator=gen).item()] += 1
    assert _chi_square(counts, torch.softmax(TARGET, dim=-1)) > CHI2_CRITICAL_5DOF_P001


def test_greedy_verification_keeps_the_matching_prefix_and_adds_the_targets_token():
    logits = torch.full((4, V), -5.0)
    for row, best in enumerate([3, 1, 4, 2]):
        logits[row, best] = 5.0
    params = SamplingParams(temperature=0.0)
    assert verify_drafts(logits, [3, 1, 4], params, None).token_ids == [3, 1, 4, 2]
    assert verify_drafts(logits, [3, 0, 4], params, None) == ([3, 1], 1)
    assert verify_drafts(logits[:1], [], params, None) == ([3], 0)


# ---- proposers ------------------------------------------------------------------------------------------

def _seq(tokens: list[int]) -> Sequence:
    return Sequence("r", None, tokens, SamplingParams())


def test_ngram_proposer_continues_the_latest_earlier_occurrence():
    proposer = NgramProposer(max_ngram=3, min_ngram=2)
    assert proposer.propose(_seq([1, 2, 3, 4, 5, 9, 1, 2, 3]), 3).token_ids == [4, 5, 9]
    assert proposer.propose(_seq([1, 2, 7, 1, 2, 8, 1, 2]), 2).token_ids == [8, 1]  # the latest occurrence
    assert proposer.propose(_seq([5, 6, 7, 8]), 3).token_ids == []
    assert proposer.propose(_seq([256, 1, 2, 256, 1]), 3).token_ids == [2, 256, 1]  # token-aligned matches only


def test_adaptive_speculation_pauses_a_request_whose_guesses_fail():
    class Always:
        def propose(self, seq, max_tokens):
            return Proposal([0] * max_tokens)

    adaptive = AdaptiveSpeculation(Always(), min_acceptance=0.5, window=8, pause_tokens=10)
    seq = _seq([1, 2, 3])
    assert adaptive.propose(seq, 4).token_ids == [0] * 4
    adaptive.record(seq, 8, 1)  # 1 of 8 kept: pause
    assert adaptive.propose(seq, 4).token_ids == []
    seq.output_token_ids.extend([7] * 10)
    assert adaptive.propose(seq, 4).token_ids == [0] * 4  # tries again after the pause


def test_a_decode_node_speculates_and_reports_acceptance():
    """--speculative ngram on a real decode node: same tokens as plain decoding, acceptance in the final
    event, the node's stats and the router's /metrics counters."""
    from kvmesh.cluster.local_launcher import LocalCluster
    from kvmesh.cluster.metrics import RouterMetrics

    llm = LLM("tiny-llama", num_kv_blocks=256, progress=False)
    ids = llm.tokenizer.encode(PROMPTS[0])
    want = llm.generate(ids, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    with LocalCluster(0, 1, node_args=["--speculative", "ngram"], cluster="spec") as cluster:
        out = cluster.client("decode-0").generate(ids, GREEDY)
        stats = cluster.client("decode-0").stats(check=True)
    assert out.error == "" and out.token_ids == want
    assert 0 < out.stats.spec_accepted_tokens <= out.stats.spec_draft_tokens
    assert stats["spec_draft_tokens"] == out.stats.spec_draft_tokens
    metrics = RouterMetrics()
    metrics.record_finished(out.stats)
    text = metrics.exposition().decode()
    assert f'kvmesh_spec_tokens_total{{outcome="accepted"}} {float(out.stats.spec_accepted_tokens)}' in text
