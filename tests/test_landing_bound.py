"""LandingBound, the policy that keeps steps short while a fetch is about to land, and the scheduler's prompt
budget it sets: decodes go on, prompt tokens wait for the landing's step boundary."""
from __future__ import annotations

from kvmesh import LLM, SamplingParams
from kvmesh.node.landing_bound import LandingBound


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def bound(clock: Clock) -> LandingBound:
    # A usual prompt step 0.25 s, a decode step 0.05 s, 640 prompt tokens a second, blocks of 16.
    return LandingBound(16, lambda: 0.25, lambda: 0.05, lambda: 640.0, clock=clock)


def test_steps_are_bounded_only_while_a_landing_is_due_within_a_usual_step():
    clock = Clock()
    policy = bound(clock)
    assert policy.prompt_tokens(num_decodes=3) is None  # no fetch: no cap
    policy.expect("far", 1.0)
    assert policy.prompt_tokens(3) is None  # lands after a usual step anyway
    policy.expect("near", 0.1)
    assert policy.prompt_tokens(3) == 0  # decodes only: the landing waits for one decode step at most
    assert policy.prompt_tokens(0) == 32  # nothing decoding: a decode step's worth of prompt, whole blocks
    clock.now += 0.1 + 0.05 + 0.01  # "near" is late by more than its estimate and a decode step
    assert policy.prompt_tokens(3) == 0  # still within twice its estimate
    clock.now += 0.1
    assert policy.prompt_tokens(3) is None  # a stalled fetch no longer holds this node's prompts back
    policy.landed("near")
    policy.landed("far")
    assert policy.num_expected == 0 and policy.prompt_tokens(3) is None
    assert policy.num_bounded_steps == 3


def test_at_least_one_block_of_prompt_when_nothing_decodes():
    slow = LandingBound(16, lambda: 0.25, lambda: 0.001, lambda: 100.0, clock=Clock())
    slow.expect("r", 0.0)
    assert slow.prompt_tokens(0) == 16


class Fixed:
    def __init__(self, tokens):
        self.tokens, self.asked = tokens, []

    def prompt_tokens(self, num_decodes):
        self.asked.append(num_decodes)
        return self.tokens

    def prompt_slice(self):
        return None


def test_the_scheduler_computes_no_prompt_tokens_past_the_cap_and_decodes_go_on():
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [list(range(1, 40)), list(range(50, 120))]
    expected = [out.outputs[0].token_ids for out in LLM("tiny-llama", progress=False).generate(prompts, params)]
    engine = LLM("tiny-llama", progress=False).engine
    first = engine.add_request(prompts[0], params)
    engine.step()  # its prompt
    engine.scheduler.prompt_budget = cap = Fixed(0)
    second = engine.add_request(prompts[1], params)
    for num_decoded in (2, 3):
        engine.step()
        assert len(first.output_token_ids) == num_decoded and second.num_computed_tokens == 0  # decodes only
    assert cap.asked == [1, 1]  # asked with the step's one decode
    engine.scheduler.prompt_budget = Fixed(16)
    engine.step()
    assert second.num_computed_tokens == 16  # one capped slice of its 70 tokens
    engine.scheduler.prompt_budget = None
    while not (first.is_finished and second.is_finished):
        engine.step()
    assert [first.output_token_ids, second.output_token_ids] == expected  # the same tokens as uncapped
    engine.check_integrity()


def test_the_nodes_prompt_slice_comes_through_its_budget_without_touching_the_scheduler_config():
    """A node slices prompts as its role says (``slice_tokens``, set on the engine thread); unset, the scheduler's
    configured threshold holds. Outputs equal the unsliced engine's."""
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prompt = list(range(3, 83))  # 80 tokens
    expected = LLM("tiny-llama", progress=False).generate([prompt], params)[0].outputs[0].token_ids
    engine = LLM("tiny-llama", progress=False, long_prefill_token_threshold=48).engine
    budget = LandingBound(16, lambda: 1.0, lambda: 0.01, lambda: 1000.0)
    engine.scheduler.prompt_budget = budget
    config = engine.scheduler.config
    seq = engine.add_request(prompt, params)
    engine.step()
    assert seq.num_computed_tokens == 48 == engine.scheduler.prompt_slice_tokens  # unset: the config's
    budget.slice_tokens = 16
    engine.step()
    assert seq.num_computed_tokens == 64 and engine.scheduler.prompt_slice_tokens == 16
    budget.slice_tokens = 0  # the step's whole budget
    engine.step()
    assert seq.num_computed_tokens == 80 and engine.scheduler.config is config
    while not seq.is_finished:
        engine.step()
    assert seq.output_token_ids == expected


def test_the_automatic_slice_bounds_a_whole_step_beside_running_decodes():
    """``step_tokens`` (a decode node's automatic slice): beside running decodes a step computes that many prompt
    tokens at most, every prompt together, oldest first; with nothing decoding, no cap. Three prompts arriving
    at once beside a stream used to compute a slice each in every step. Outputs equal the uncapped engine's."""
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [list(range(3 + i, 83 + i)) for i in range(4)]  # 80 tokens each
    expected = [o.outputs[0].token_ids for o in LLM("tiny-llama", progress=False).generate(prompts, params)]
    rate = [640.0]  # the node's fitted prompt rate, tokens a second
    policy = LandingBound(16, lambda: 1.0, lambda: 0.01, lambda: rate[0])
    assert policy.prompt_tokens(num_decodes=2) is None and policy.step_tokens == 0  # no step cap set: none
    policy.slice_tokens = 0  # a decode node's automatic slice: no cap per prompt, 50 ms of prompt per step
    policy.cap_steps(0.05, 2048)
    assert policy.prompt_tokens(num_decodes=0) is None and policy.prompt_tokens(num_decodes=2) == 32
    rate[0] = 320.0  # prompt steps measured slower: the cap follows the rate
    assert policy.step_tokens == 16 and policy.prompt_tokens(num_decodes=2) == 16
    rate[0] = 64_000.0  # a step's whole budget in 50 ms (a GPU): no cap
    assert policy.step_tokens == 0 and policy.prompt_tokens(num_decodes=2) is None
    rate[0] = 640.0
    engine = LLM("tiny-llama", progress=False).engine
    engine.scheduler.prompt_budget = policy
    first = engine.add_request(prompts[0], params)
    engine.step()  # alone: its whole prompt in one step, however long the slice
    assert first.num_computed_tokens == 80
    others = [engine.add_request(p, params) for p in prompts[1:]]
    order = []
    while not all(s.is_finished for s in [first, *others]):
        before = [s.num_computed_tokens for s in others]
        out_step = engine.scheduler.schedule()
        prompt_tokens = sum(n for s, n in out_step.batch if s is not first and s.is_prefilling)
        decoding = sum(1 for s, n in out_step.batch if n == 1 and not s.is_prefilling)
        results = engine.runner.execute(out_step.batch, {})
        engine.finish_step(out_step.batch, {}, results)
        if decoding:
            assert prompt_tokens <= 32, f"a step beside {decoding} decodes computed {prompt_tokens} prompt tokens"
        grew = [i for i, (s, b) in enumerate(zip(others, before)) if s.num_computed_tokens > b and b < 80]
        order.extend(i for i in grew if i not in order)
    assert order == [0, 1, 2], "prompts went side by side, not oldest first"
    assert [s.output_token_ids for s in [first, *others]] == expected
    engine.pool.check_integrity()
