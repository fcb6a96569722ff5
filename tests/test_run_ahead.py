"""Run-ahead decoding (engine launches decode step N + 1 from step N's tokens before reading them), on the CPU:
decode graphs replay eagerly here (``EagerReplay``) through the same launch / collect path a GPU takes, and
every stream must equal an engine without graphs: requests stopping mid-run (their extra token dropped),
aborted while a step is in flight, joined by a new request, ending at their length limits, sampled rows
(never run ahead)."""
from __future__ import annotations

import pytest

from kvmesh import LLM, SamplingParams
from kvmesh.engine.cuda_graphs import DecodeGraphs
from kvmesh.engine.model_runner import ModelRunner

PROMPTS = [list(range(40, 40 + n)) for n in (30, 9, 21, 50, 17)]


def _llm(graphs: bool, **kw) -> LLM:
    llm = LLM("tiny-llama", max_num_seqs=8, num_kv_blocks=96, progress=False, **kw)
    if graphs:
        runner, engine = llm.engine.runner, llm.engine
        runner.graphs = DecodeGraphs(runner.model, runner.kv_buffer, engine.config.block_size, 8,
                                     engine.max_model_len).capture()
    return llm


def _count_launches(monkeypatch, runner: ModelRunner) -> dict[str, int]:
    counts = {"launched": 0, "ahead": 0}
    launch = runner.launch_decode

    def counting(batch, ahead_of=None):
        counts["launched"] += 1
        counts["ahead"] += ahead_of is not None
        return launch(batch, ahead_of=ahead_of)
    monkeypatch.setattr(runner, "launch_decode", counting)
    return counts


def _params(eager: LLM) -> list[SamplingParams]:
    """Lengths that end rows at different steps, and a stop token each run finds mid-stream (from a plain run)."""
    probe = eager.generate(PROMPTS[:1], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                           use_tqdm=False)[0].token_ids
    stop_at = next(t for t in probe[3:] if t not in probe[:3])  # first seen at the fourth token or later
    return [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_at]),
            SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
            SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
            SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True),
            SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)]


def test_run_ahead_streams_equal_plain_decoding_and_free_every_block(monkeypatch):
    eager = _llm(graphs=False)
    params = _params(eager)
    want = eager.generate(PROMPTS, params, use_tqdm=False)
    llm = _llm(graphs=True)
    counts = _count_launches(monkeypatch, llm.engine.runner)
    got = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.outputs[0].finish_reason for o in got] == [o.outputs[0].finish_reason for o in want]
    assert got[0].outputs[0].finish_reason == "stop" and len(got[0].token_ids) < 12  # stopped while one ran ahead
    assert [round(o.outputs[0].cumulative_logprob, 4) for o in got] == \
        [round(o.outputs[0].cumulative_logprob, 4) for o in want]
    assert counts["ahead"] >= 5 and counts["launched"] > counts["ahead"]
    assert llm.engine.run_ahead.in_flight is None and not llm.engine.has_unfinished()
    llm.engine.check_integrity()
    assert llm.engine.pool.usage() == eager.engine.pool.usage()  # the dropped tokens' blocks all came back


def test_abort_and_arrivals_while_a_step_is_in_flight(monkeypatch):
    eager = _llm(graphs=False)
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    want = eager.generate(PROMPTS[1:4] + PROMPTS[:1], greedy, use_tqdm=False)
    llm = _llm(graphs=True)
    engine = llm.engine
    seqs = [engine.add_request(p, greedy) for p in PROMPTS[1:4]]
    counts = _count_launches(monkeypatch, engine.runner)
    while engine.run_ahead.in_flight is None:
        engine.step()
    victim = seqs[1]
    engine.abort(victim)  # its row is in the step in flight: dropped when read
    for _ in range(2):
        engine.step()
    late = engine.add_request(PROMPTS[0], greedy)  # arrives with a step in flight: that step is read, then admitted
    engine.step()
    assert engine.run_ahead.in_flight is None  # nothing launched ahead while a request waits
    while engine.has_unfinished():
        engine.step()
    assert victim.finish_reason is None and len(victim.output_token_ids) < 10
    assert victim.output_token_ids == want[1].token_ids[: len(victim.output_token_ids)]
    assert [seqs[0].output_token_ids, seqs[2].output_token_ids, late.output_token_ids] == \
        [want[0].token_ids, want[2].token_ids, want[3].token_ids]
    assert counts["ahead"] >= 3
    engine.check_integrity()
    assert engine.pool.usage() == eager.engine.pool.usage()


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=6, temperature=0.8, seed=3),
                                    SamplingParams(max_tokens=6, temperature=0.0, logprobs=2)])
def test_sampled_rows_and_logprobs_are_never_run_ahead(params, monkeypatch):
    eager = _llm(graphs=False)
    want = eager.generate(PROMPTS[:3], params, use_tqdm=False)
    llm = _llm(graphs=True)
    counts = _count_launches(monkeypatch, llm.engine.runner)
    got = llm.generate(PROMPTS[:3], params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert counts["launched"] == 0 and llm.engine.runner.graphs.num_replays > 0  # replayed, read at once


def _in_flight(num_requests: int):
    """An engine with ``num_requests`` greedy requests decoding and a step launched ahead."""
    llm = _llm(graphs=True)
    greedy = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    seqs = [llm.engine.add_request(p, greedy) for p in PROMPTS[:num_requests]]
    while llm.engine.run_ahead.in_flight is None:
        llm.engine.step()
    return llm, llm.engine, seqs


def test_the_block_a_step_in_flight_writes_is_held_until_that_step_is_read():
    """A request aborted (or stopped) while a step launched ahead still writes its next position: that block
    stays referenced, so no other request or transfer gets it before the write; reading the step frees it."""
    _, engine, seqs = _in_flight(2)
    flight = engine.run_ahead.in_flight
    assert len(flight.held_block_ids) == len(flight.batch), "a row of the step in flight holds no block"
    held = flight.held_block_ids[0]
    assert flight.batch[0][0] is seqs[0] and held in seqs[0].block_ids
    engine.abort(seqs[0])
    assert engine.run_ahead.in_flight is flight  # the other row still runs in it
    assert engine.pool.block_state(held).ref_count == 1  # the request's reference is gone, the step's is not
    engine.check_integrity()
    engine.step()  # reads that step
    assert engine.pool.block_state(held).ref_count == 0
    engine.abort(seqs[1])  # every row of the step now ahead has ended: it is waited for and dropped
    assert engine.run_ahead.in_flight is None and not engine.has_unfinished()
    engine.check_integrity()
    assert engine.pool.usage().num_used == 0


@pytest.mark.parametrize("fails", ["launching the step ahead", "reading the step before it"])
def test_a_failed_run_ahead_step_fails_its_requests_once_and_holds_nothing(fails, monkeypatch):
    from kvmesh.engine.engine import StepFailed

    llm, engine, seqs = _in_flight(3)

    def failing(*args, **kw):
        raise RuntimeError("device lost")
    if fails == "launching the step ahead":
        monkeypatch.setattr(engine.runner, "launch_decode", lambda batch, ahead_of=None: failing())
    else:  # the step ahead is launched (the same requests in two steps), then reading the one before fails
        monkeypatch.setattr(ModelRunner, "collect", staticmethod(failing))
    with pytest.raises(StepFailed) as failure:
        engine.step()
    assert sorted(s.request_id for s in failure.value.failed) == sorted(s.request_id for s in seqs)
    assert all(s.finish_reason == "error" for s in seqs) and engine.run_ahead.in_flight is None
    engine.check_integrity()
    assert engine.pool.usage().num_used == 0  # the failed requests' blocks and the held ones all came back
    monkeypatch.undo()
    assert llm.generate(PROMPTS[:1], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                        use_tqdm=False)[0].token_ids  # the engine goes on
