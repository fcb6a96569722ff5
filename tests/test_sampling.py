"""Sampling parameters: validation, greedy, seeds, top-k/top-p, stop conditions."""
from __future__ import annotations

import pytest
import torch

from kvmesh import LLM, SamplingParams
from kvmesh.engine.sampler import sample
from kvmesh.errors import InvalidRequestError


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-llama", num_kv_blocks=128, progress=False)


@pytest.mark.parametrize("kwargs,match", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-3), "max_tokens"),
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=0), "top_k"),
    (dict(stop=[""]), "stop"),
])
def test_invalid_sampling_params_are_refused(kwargs, match):
    with pytest.raises(InvalidRequestError, match=match):
        SamplingParams(**kwargs)


def test_sampler_top_k_and_top_p_restrict_the_support():
    logits = torch.tensor([[3.0, 2.9, 2.8, -5.0, -5.0, 0.0]] * 1)
    gen = torch.Generator().manual_seed(0)
    seen_k = {sample(logits, [SamplingParams(temperature=5.0, top_k=2)], [gen])[0][0] for _ in range(200)}
    assert seen_k == {0, 1}
    probs = torch.softmax(logits[0], -1)  # p(0)+p(1) ~ 0.66 < 0.7 <= p(0)+p(1)+p(2)
    assert probs[:2].sum() < 0.7 <= probs[:3].sum()
    seen_p = {sample(logits, [SamplingParams(top_p=0.7)], [gen])[0][0] for _ in range(300)}
    assert seen_p == {0, 1, 2}
    tok, lp, top = sample(logits, [SamplingParams(temperature=0.0)], [None])
    assert tok == [0] and lp[0] == pytest.approx(torch.log_softmax(logits[0], -1)[0].item()) and len(top[0]) == 0
    _, _, top = sample(logits, [SamplingParams(temperature=0.0, logprobs=3)], [None])
    want = torch.log_softmax(logits[0], -1)
    assert [t for t, _ in top[0]] == want.argsort(descending=True)[:3].tolist()
    assert [v for _, v in top[0]] == pytest.approx(want.sort(descending=True).values[:3].tolist())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_rows_logprob_is_its_chosen_tokens_under_the_model_and_a_broken_row_fails_alone(dtype):
    """A batch of greedy and drawn rows (float32 rows take NumPy's path on the host, others torch's): every row's
    logprob is log_softmax of its logits at the token it got; a row with a NaN or an infinity gets NON_FINITE."""
    from kvmesh.engine.sampler import NON_FINITE

    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(3)).to(dtype)
    logits[2, 7] = float("nan")
    logits[4, 0] = float("-inf")
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=1),
              SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=5),
              SamplingParams(temperature=0.0), SamplingParams(temperature=0.0)]
    gens = [torch.Generator().manual_seed(i) for i in range(6)]
    tokens, logprobs, _ = sample(logits, params, gens)
    assert tokens[2] == NON_FINITE and tokens[4] == NON_FINITE
    want = torch.log_softmax(logits.float(), -1)
    for row in (0, 1, 3, 5):
        assert logprobs[row] == pytest.approx(want[row, tokens[row]].item(), abs=1e-2 if dtype != torch.float32 else 1e-6)
    for row in (0, 5):
        assert tokens[row] == int(logits[row].float().argmax())


def test_seeded_sampling_is_reproducible_and_seed_dependent(llm):
    prompt = "abc"
    a = llm.generate(prompt, SamplingParams(max_tokens=24, temperature=1.0, seed=5, ignore_eos=True), use_tqdm=False)
    b = llm.generate(prompt, SamplingParams(max_tokens=24, temperature=1.0, seed=5, ignore_eos=True), use_tqdm=False)
    c = llm.generate(prompt, SamplingParams(max_tokens=24, temperature=1.0, seed=6, ignore_eos=True), use_tqdm=False)
    assert a[0].token_ids == b[0].token_ids
    assert a[0].token_ids != c[0].token_ids
    greedy = llm.generate(prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True), use_tqdm=False)
    top1 = llm.generate(prompt, SamplingParams(max_tokens=24, temperature=0.8, top_k=1, ignore_eos=True),
                        use_tqdm=False)
    assert greedy[0].token_ids == top1[0].token_ids


def test_stop_token_ids_and_max_tokens(llm):
    free = llm.generate("hello", SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), use_tqdm=False)[0]
    assert len(free.token_ids) == 12 and free.outputs[0].finish_reason == "length"
    stop_at = free.token_ids[5]
    first = free.token_ids.index(stop_at)
    stopped = llm.generate("hello", SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[stop_at]),
                           use_tqdm=False)[0]
    assert stopped.token_ids == free.token_ids[: first + 1]
    assert stopped.outputs[0].finish_reason == "stop"


def test_stop_strings_cut_the_text(llm):
    free = llm.generate("hello", SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True), use_tqdm=False)[0]
    needle = free.text[3:5]
    assert needle
    cut = llm.generate("hello", SamplingParams(max_tokens=16, temperature=0.0, stop=needle), use_tqdm=False)[0]
    assert cut.text == free.text[: free.text.find(needle)]
    assert cut.outputs[0].finish_reason == "stop"


@pytest.mark.parametrize("kwargs", [dict(seed=True), dict(seed="1"), dict(temperature="hot"), dict(top_p=None),
                                    dict(max_tokens=True), dict(top_k=2.5), dict(stop_token_ids=[-1]),
                                    dict(stop=[3]), dict(ignore_eos="yes")])
def test_wrongly_typed_sampling_params_are_refused(kwargs):
    with pytest.raises(InvalidRequestError):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kernels", ["auto", "torch"])  # the native one-pass pick, NumPy's whole arrays
def test_an_all_greedy_batch_on_the_host_matches_the_reference_row_by_row(kernels, monkeypatch):
    """Greedy rows without logprobs asked (a decode step's usual batch) take the native kernel's one pass, or
    whole-array NumPy work without it: each token is its row's argmax, each logprob log_softmax there, no
    alternatives; a NaN row fails alone."""
    from kvmesh.engine.sampler import NON_FINITE

    monkeypatch.setenv("KVMESH_KERNELS", kernels)
    logits = torch.randn(9, 300, generator=torch.Generator().manual_seed(5))
    logits[6, 11] = float("nan")
    tokens, logprobs, tops = sample(logits, [SamplingParams(temperature=0.0)] * 9, [None] * 9)
    want = torch.log_softmax(logits, -1)
    assert tokens[6] == NON_FINITE and all(len(top) == 0 for top in tops) and len(tops) == 9
    for row in (0, 1, 2, 3, 4, 5, 7, 8):
        assert tokens[row] == int(logits[row].argmax())
        assert logprobs[row] == pytest.approx(want[row, tokens[row]].item(), abs=1e-6)

def test_a_row_of_non_finite_logits_fails_that_request_only(monkeypatch):
    """One request's logits turn NaN (a numerics bug, a bad weight row): it ends with an error, the others
    in the same steps go on and match a run without it."""
    import kvmesh.engine.model_runner as runner_module
    from kvmesh.engine.sampler import NON_FINITE, sample

    logits = torch.randn(3, 50)
    logits[1, 7] = float("nan")
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=1), SamplingParams(top_k=5)]
    ids, _, _ = sample(logits, params, [None, torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)])
    assert ids[1] == NON_FINITE and ids[0] == int(logits[0].argmax()) and 0 <= ids[2] < 50
    for bad in ([float("inf")], [float("-inf")], [float("inf"), float("-inf")]):  # an infinity, or both signs
        rows = torch.randn(2, 50)
        rows[1, 3 : 3 + len(bad)] = torch.tensor(bad)
        ids, _, _ = sample(rows, [SamplingParams(temperature=0.0)] * 2, [None, None])
        assert ids == [int(rows[0].argmax()), NON_FINITE], bad

    def poisoned(logits, params, generators):
        logits = logits.clone()
        for row, p in enumerate(params):
            if p.seed == 666:
                logits[row] = float("nan")
        return sample(logits, params, generators)

    llm = LLM("tiny-llama", num_kv_blocks=64, progress=False)
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    expected = llm.generate([[1, 2, 3, 4]], greedy, use_tqdm=False)[0].token_ids
    monkeypatch.setattr(runner_module, "sample", poisoned)
    outs = llm.generate([[1, 2, 3, 4], [5, 6, 7]], [greedy, SamplingParams(max_tokens=8, seed=666)], use_tqdm=False)
    assert outs[0].token_ids == expected and outs[0].outputs[0].finish_reason == "length"
    assert outs[1].outputs[0].finish_reason == "error" and outs[1].token_ids == []
    llm.engine.pool.check_integrity()
    assert llm.engine.pool.num_free_blocks == llm.engine.pool.num_blocks  # the failed request freed its blocks


@pytest.mark.parametrize("field,ok,bad", [
    ("stop", tuple(f"s{i}" for i in range(16)), tuple(f"s{i}" for i in range(17))),
    ("stop", ("x" * 256,), ("x" * 257,)),
    ("stop_token_ids", tuple(range(256)), tuple(range(257))),
    ("logprobs", 20, 21),
    ("priority", 1000, 1001),
    ("priority", -1000, -1001),
    ("cache_salt", "s" * 256, "s" * 257),
    ("seed", 2**63 - 1, 2**63),
    ("seed", -(2**63), -(2**63) - 1),
])
def test_request_caps_hold_at_their_exact_boundaries(field, ok, bad):
    """Each cap admits its limit and refuses one past it, naming the field."""
    assert getattr(SamplingParams(**{field: ok}), field) == ok
    with pytest.raises(InvalidRequestError, match=field.split("_")[0]):
        SamplingParams(**{field: bad})


def test_n_choices_boundaries_and_their_seeds():
    from kvmesh.cluster.openai_protocol import MAX_CHOICES, choice_params

    base = SamplingParams(seed=5)
    assert [p.seed for p in choice_params({"n": MAX_CHOICES}, base)] == list(range(5, 5 + MAX_CHOICES))
    with pytest.raises(InvalidRequestError, match="n must be"):
        choice_params({"n": MAX_CHOICES + 1}, base)
    top = SamplingParams(seed=2**63 - 3)
    assert [p.seed for p in choice_params({"n": 3}, top)] == [2**63 - 3, 2**63 - 2, 2**63 - 1]
    with pytest.raises(InvalidRequestError, match="seed \\+ n - 1"):
        choice_params({"n": 4}, top)
