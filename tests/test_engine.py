"""The single-node engine: prefix cache, chunked prefill and preemption never change greedy outputs."""
from __future__ import annotations

import pytest
import torch

from kvmesh import LLM, SamplingParams
from kvmesh.engine.request_state import IllegalTransitionError, RequestStatus, transition
from kvmesh.engine.sequence import Sequence
from tests.conftest import hf_reference

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
SYSTEM = "You are a terse assistant. Answer in one word. " * 2  # 94 bytes: 5 full blocks
PROMPTS = [SYSTEM + q for q in ("Sky colour?", "Grass colour?", "Snow colour?", "Night colour?")]


def hf_greedy(hf, prompt_ids: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                          attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long), pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


@pytest.fixture(scope="module")
def reference():
    llm = LLM("tiny-llama", num_kv_blocks=64, progress=False)
    hf = hf_reference(llm.loaded)
    return {p: hf_greedy(hf, llm.tokenizer.encode(p), GREEDY.max_tokens) for p in PROMPTS}


def run(llm: LLM, prompts: list[str], one_by_one: bool = False) -> list[list[int]]:
    if one_by_one:
        outs = [llm.generate(p, GREEDY, use_tqdm=False)[0] for p in prompts]
    else:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    llm.engine.check_integrity()
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("chunked", [True, False])
def test_outputs_match_transformers_with_cache_and_chunking_on_and_off(reference, caching, chunked):
    llm = LLM("tiny-llama", num_kv_blocks=64, enable_prefix_caching=caching, progress=False,
              max_num_batched_tokens=40 if chunked else 2048, max_num_partial_prefills=2)
    assert run(llm, PROMPTS, one_by_one=True) == [reference[p] for p in PROMPTS]
    assert run(llm, PROMPTS) == [reference[p] for p in PROMPTS]  # again, batched, on a warm cache
    stats = llm.engine.kv.stats
    if caching:
        assert stats.tokens_reused >= 7 * 5 * 16  # every later prompt reuses the 5 system blocks
    else:
        assert stats.tokens_reused == 0 and stats.hits == 0


def test_forced_preemption_gives_identical_outputs(reference):
    # 13 blocks cannot hold four ~8-block requests at once: the scheduler must preempt.
    llm = LLM("tiny-llama", num_kv_blocks=13, progress=False)
    assert run(llm, PROMPTS) == [reference[p] for p in PROMPTS]
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.pool.num_free_blocks == 13


def test_full_prompt_hit_still_computes_the_last_token(reference):
    llm = LLM("tiny-llama", num_kv_blocks=64, progress=False)
    prompt = PROMPTS[0][:96]  # exactly 6 blocks
    first = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    second = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 80  # 5 blocks; the 6th is recomputed
    assert first.token_ids == second.token_ids
    llm.engine.check_integrity()


def test_multi_turn_conversation_reuses_turn_one():
    llm = LLM("tiny-qwen3", num_kv_blocks=64, progress=False)
    hf = hf_reference(llm.loaded)
    turn1 = llm.tokenizer.encode("User: name three colours.\nAssistant:")
    out1 = llm.generate(turn1, GREEDY, use_tqdm=False)[0]
    turn2 = turn1 + out1.token_ids + llm.tokenizer.encode("\nUser: and three more?\nAssistant:")
    out2 = llm.generate(turn2, GREEDY, use_tqdm=False)[0]
    assert out2.num_cached_tokens == (len(turn1) + len(out1.token_ids)) // 16 * 16 > 0
    assert out2.token_ids == hf_greedy(hf, turn2, GREEDY.max_tokens)
    llm.engine.check_integrity()


def test_shared_system_prompt_workload_cuts_prefill_compute():
    llm = LLM("tiny-llama", num_kv_blocks=256, progress=False)
    cold = LLM("tiny-llama", num_kv_blocks=256, enable_prefix_caching=False, progress=False)
    system = "System: you are kvmesh's test assistant; keep every answer short and exact. " * 4
    prompts = [system + f"Question {i}: what is {i} + {i}?" for i in range(12)]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for p in prompts:  # arrivals one after another, as in serving
        llm.generate(p, params, use_tqdm=False)
        cold.generate(p, params, use_tqdm=False)
    warm_stats, cold_stats = llm.engine.kv.stats, cold.engine.kv.stats
    assert warm_stats.tokens_computed <= 0.7 * cold_stats.tokens_computed
    assert warm_stats.hit_rate >= 0.6
    warm_stats.check_integrity()


def test_remote_kv_hooks_ready_and_failed(reference):
    """A request whose prompt KV is written by a 'peer' engine, and one whose transfer fails."""
    peer = LLM("tiny-llama", num_kv_blocks=64, progress=False)
    node = LLM("tiny-llama", num_kv_blocks=64, progress=False)
    prompt = PROMPTS[1]
    ids = node.tokenizer.encode(prompt)
    peer_out = peer.generate(ids, SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)[0]
    engine = node.engine
    seq = engine.prepare_request(ids, GREEDY, request_id="remote-1")
    to_fill = engine.scheduler.add_awaiting_remote_kv(seq)
    assert seq.status is RequestStatus.WAITING_FOR_REMOTE_KV and to_fill == list(range(len(seq.block_ids)))
    # The "transfer": copy the peer's full prompt blocks into ours, block for block.
    num_full = len(ids) // 16
    engine.kv.update_hashes(seq)
    src = [peer.engine.pool.cached_block(h) for h in seq.block_hashes[:num_full]]
    assert None not in src and len(src) == num_full
    node.engine.runner.kv_buffer[seq.block_ids[:num_full]] = peer.engine.runner.kv_buffer[src]
    engine.scheduler.remote_kv_ready("remote-1", num_full * 16)
    while engine.has_unfinished():
        engine.step()
    assert seq.output_token_ids == reference[prompt] and seq.output_token_ids[0] == peer_out.token_ids[0]
    # A failed transfer whose blocks a stalled writer may still touch: they are swapped for fresh
    # ones (the fence keeps its own reference), nothing arrived, the request is computed here.
    seq2 = engine.prepare_request(node.tokenizer.encode(PROMPTS[2]), GREEDY, request_id="remote-2")
    engine.scheduler.add_awaiting_remote_kv(seq2)
    tainted = list(seq2.block_ids[:2])
    engine.pool.touch(tainted)  # the grant table's reference
    engine.kv.replace_blocks(seq2, tainted)
    assert not set(tainted) & set(seq2.block_ids) and [engine.pool.block_state(b).ref_count for b in tainted] == [1, 1]
    engine.scheduler.remote_kv_ready("remote-2", 0)
    while engine.has_unfinished():
        engine.step()
    assert seq2.output_token_ids == reference[PROMPTS[2]]
    engine.pool.free(tainted)  # the writer stopped: the quarantine lifts
    engine.check_integrity()


def test_illegal_transitions_raise():
    seq = Sequence("r1", None, [1, 2], GREEDY)
    with pytest.raises(IllegalTransitionError, match="WAITING -> FINISHED"):
        transition(seq, RequestStatus.FINISHED)
    transition(seq, RequestStatus.RUNNING)
    transition(seq, RequestStatus.ABORTED)
    with pytest.raises(IllegalTransitionError):
        transition(seq, RequestStatus.RUNNING)


def test_abort_frees_blocks():
    llm = LLM("tiny-llama", num_kv_blocks=32, progress=False)
    engine = llm.engine
    seq = engine.add_request("abort me " * 5, GREEDY)
    engine.step()
    assert seq.block_ids and engine.pool.num_free_blocks < 32
    engine.abort(seq)
    assert seq.status is RequestStatus.ABORTED and not engine.has_unfinished()
    assert engine.pool.num_free_blocks == 32
    engine.check_integrity()


def test_a_failed_step_fails_exactly_its_batch_and_the_engine_goes_on():
    from kvmesh.engine.engine import StepFailed

    llm = LLM("tiny-llama", num_kv_blocks=64, progress=False)
    engine = llm.engine
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    first = [engine.add_request(list(range(1, 40)), params), engine.add_request(list(range(5, 30)), params)]
    real_execute = engine.runner.execute

    def broken(batch, drafts=None):
        raise RuntimeError("injected kernel failure")

    engine.runner.execute = broken
    with pytest.raises(StepFailed, match="injected") as failure:
        engine.step()
    assert {s.request_id for s in failure.value.failed} == {s.request_id for s in first}
    assert all(s.status is RequestStatus.FAILED and s.block_ids == [] for s in first)
    engine.check_integrity()
    engine.runner.execute = real_execute
    later = engine.add_request(list(range(1, 40)), params)
    while not later.is_finished:
        engine.step()
    assert later.status is RequestStatus.FINISHED and len(later.output_token_ids) == 4
    engine.check_integrity()


def test_the_kv_oracle_sees_blocks_in_the_wrong_slots():
    """Two cached blocks of a prompt swapped in their slots: the KV fingerprint names exactly their positions."""
    from kvmesh.engine.kv_probe import mismatched_positions, prompt_kv_sums

    llm = LLM("tiny-llama", num_kv_blocks=256, progress=False)
    prompt = list(range(40, 140))  # 100 tokens: 6 full blocks
    llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)
    want = prompt_kv_sums(llm.engine, prompt)
    assert want["num_blocks"] == 6 and mismatched_positions(want, want, 2, 2) == []
    ids = llm.engine.pool.match(llm.engine.kv.hash_prompt(prompt))
    kv = llm.engine.runner.kv_buffer
    kv[[ids[1], ids[2]]] = kv[[ids[2], ids[1]]].clone()
    assert mismatched_positions(prompt_kv_sums(llm.engine, prompt), want, 2, 2) == list(range(16, 48))
    kv[ids[4]] = kv[ids[4]].flip(-2).clone()  # the two KV heads of block 4 trade places (their sum unchanged)
    assert mismatched_positions(prompt_kv_sums(llm.engine, prompt), want, 2, 2) == \
        list(range(16, 48)) + list(range(64, 80))


def test_remote_kv_never_runs_more_than_max_num_seqs(reference):
    """Two requests fill ``max_num_seqs`` = 2; a third whose KV a peer wrote waits (``kv_landed``) until one of
    them finishes instead of joining a batch past the limit, then runs to the reference's tokens."""
    llm = LLM("tiny-llama", num_kv_blocks=64, max_num_seqs=2, progress=False)
    engine = llm.engine
    short = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    firsts = [engine.prepare_request(llm.tokenizer.encode(p), short) for p in PROMPTS[:2]]
    for seq in firsts:
        engine.scheduler.add(seq)
    engine.step()
    third = engine.prepare_request(llm.tokenizer.encode(PROMPTS[3]), GREEDY, request_id="remote-3")
    engine.scheduler.add_awaiting_remote_kv(third)
    engine.scheduler.remote_kv_ready("remote-3", 0)  # nothing arrived: computed here, when there is room
    most = 0
    while engine.has_unfinished():
        engine.step()
        most = max(most, len(engine.scheduler.running))
        if all(not s.is_finished for s in firsts):
            assert third.status is RequestStatus.WAITING_FOR_REMOTE_KV and third in engine.scheduler.kv_landed
    assert most <= 2 and third.output_token_ids == reference[PROMPTS[3]]
    engine.check_integrity()


def test_hooks_given_at_construction_hear_every_token_and_prompt_step_except_unobserved_ones():
    """A node passes its accounting as ``EngineHooks`` when it builds the engine; its start-up probes step inside
    ``unobserved`` (their tokens are no client's, their steps no measure of serving)."""
    from kvmesh.engine.engine import EngineHooks, LLMEngine

    tokens, prompt_steps = [], []
    base = LLM("tiny-llama", progress=False).engine
    engine = LLMEngine(base.loaded, base.config, hooks=EngineHooks(
        on_token=lambda seq, token_id: tokens.append((seq.request_id, token_id)),
        on_prefill_step=lambda num_tokens, seconds: prompt_steps.append(num_tokens)))
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    with engine.unobserved():
        probe = engine.add_request(list(range(5, 45)), params)
        while not probe.is_finished:
            engine.step()
    assert tokens == [] and prompt_steps == []
    seq = engine.add_request(list(range(7, 47)), params)
    while not seq.is_finished:
        engine.step()
    assert tokens == [(seq.request_id, t) for t in seq.output_token_ids] and len(tokens) == 3
    assert prompt_steps == [40]
    engine.check_integrity()
