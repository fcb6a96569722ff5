"""Priority scheduling: admission by (priority, arrival), preemption of the least urgent, ageing."""
from __future__ import annotations

from kvmesh import LLM, SamplingParams
from kvmesh.engine.kv_cache_manager import KVCacheManager
from kvmesh.engine.request_state import RequestStatus
from kvmesh.engine.scheduler import Scheduler, SchedulerConfig
from kvmesh.engine.sequence import Sequence
from kvmesh.kv.block_hash import root_hash
from kvmesh.kv.block_pool import BlockPool


def _scheduler(num_blocks: int, **config) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_batched_tokens=256, **config),
                     KVCacheManager(BlockPool(num_blocks), 16, root_hash(b"prio")))


def _seq(name: str, priority: int, num_tokens: int = 40) -> Sequence:
    return Sequence(name, None, [hash(name) % 200 + i for i in range(num_tokens)],
                    SamplingParams(max_tokens=50, priority=priority))


def _step(s: Scheduler):
    """Schedule and pretend the forward ran: every scheduled chunk gets its K/V."""
    out = s.schedule()
    for seq, n in out.batch:
        s.advance(seq, n)
        if not seq.is_prefilling:
            seq.output_token_ids.append(1)
    return out


def test_admission_follows_priority_then_arrival():
    llm = LLM("tiny-llama", num_kv_blocks=64, max_num_seqs=1, progress=False)
    engine = llm.engine
    params = {p: SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, priority=p) for p in (-1, 0, 5)}
    seqs = {name: engine.add_request(list(range(3, 20)), params[p], request_id=name)
            for name, p in (("a", 0), ("b", 5), ("c", 0), ("d", -1))}
    admitted: list[str] = []
    while engine.has_unfinished():
        engine.step()
        for name, seq in seqs.items():
            if seq.was_admitted and name not in admitted:
                admitted.append(name)
    assert admitted == ["d", "a", "c", "b"]
    engine.check_integrity()


def test_a_more_urgent_arrival_preempts_the_least_urgent_not_the_newest():
    s = _scheduler(6)  # room for two 40-token requests (3 blocks each)
    low, mid = _seq("low", 5), _seq("mid", 0)
    s.add(low)
    _step(s)
    s.add(mid)
    _step(s)
    assert s.running == [low, mid]
    urgent = _seq("urgent", -1)
    s.add(urgent)
    out = _step(s)
    assert out.preempted == [low]  # priority before recency: the older, less urgent request goes
    assert urgent in s.running and mid in s.running and s.waiting == [low]
    assert low.status is RequestStatus.WAITING
    s.kv.pool.check_integrity()


def test_an_equally_urgent_arrival_waits_instead_of_preempting():
    s = _scheduler(6)
    first, second = _seq("first", 0), _seq("second", 0)
    for seq in (first, second):
        s.add(seq)
        _step(s)
    s.add(_seq("third", 0))
    out = _step(s)
    assert out.preempted == [] and [q.request_id for q in s.waiting] == ["third"]


def _admissions_until(s: Scheduler, victim: Sequence, max_steps: int) -> int | None:
    """Each step a fresh priority-0 request arrives and the running one finishes; when is ``victim`` admitted?"""
    for step in range(max_steps):
        s.add(_seq(f"fresh{step}", 0, 20))
        _step(s)
        if victim.was_admitted:
            return step
        for seq in list(s.running):
            s.finish(seq, RequestStatus.FINISHED)
    return None


def test_ageing_bounds_how_long_a_low_priority_request_waits():
    aged = _scheduler(64, max_num_seqs=1, aging_steps=2)
    victim = _seq("patient", 3, 20)
    aged.add(victim)
    assert _admissions_until(aged, victim, 30) is not None
    starving = _scheduler(64, max_num_seqs=1, aging_steps=10_000)
    victim = _seq("patient", 3, 20)
    starving.add(victim)
    assert _admissions_until(starving, victim, 30) is None  # without ageing it would wait forever


def test_every_front_end_carries_the_priority():
    import pytest

    from kvmesh.cluster.grpc_server import pb, sampling_from_proto
    from kvmesh.cluster.openai_protocol import refuse_unsupported, sampling_params
    from kvmesh.engine.sampling_params import from_wire, to_wire
    from kvmesh.errors import InvalidRequestError

    body = {"model": "m", "prompt": "x", "priority": -3}
    refuse_unsupported(body, chat=False)  # a known field, not a 400
    assert sampling_params(body, chat=False).priority == -3
    assert sampling_from_proto(pb.SamplingParams(priority=7))[0].priority == 7
    assert from_wire(to_wire(SamplingParams(priority=2))).priority == 2
    for bad in ("high", 1.5, True, 10**6):
        with pytest.raises(InvalidRequestError, match="priority"):
            SamplingParams(priority=bad)


def test_prompts_that_fit_the_step_are_admitted_together_and_partial_prefills_stay_bounded():
    """``max_num_partial_prefills`` bounds requests left mid-prompt, not prompts completed in the step."""
    s = _scheduler(200, max_num_partial_prefills=2, max_num_seqs=32)
    for i in range(16):
        s.add(_seq(f"short{i}", 0, num_tokens=10))
    out = _step(s)
    assert len(out.batch) == 16 and all(n == 10 for _, n in out.batch)  # 160 tokens: one step, not eight
    s = _scheduler(200, max_num_partial_prefills=2, max_num_seqs=32)
    for i in range(4):
        s.add(_seq(f"long{i}", 0, num_tokens=200))  # 800 tokens: 256 per step
    for _ in range(3):
        out = _step(s)
        assert sum(seq.is_prefilling for seq in s.running) <= 2
        assert out.num_batched_tokens <= 256
    s.kv.pool.check_integrity()


def test_a_long_prompt_is_computed_a_threshold_at_a_time_beside_a_decoding_stream():
    """long_prefill_token_threshold caps a prompt's tokens per step; the stream decoding beside it gets its token
    every step; 0 lets the prompt take the step's whole budget; a negative cap is refused."""
    import pytest

    for threshold, chunks in ((64, [64, 64, 64, 8]), (0, [200])):
        s = _scheduler(64, long_prefill_token_threshold=threshold)
        stream = _seq("stream", 0, num_tokens=20)
        s.add(stream)
        _step(s)  # its prompt, then it decodes
        prompt = _seq("prompt", 0, num_tokens=200)
        s.add(prompt)
        seen = []
        while prompt.is_prefilling or prompt.num_computed_tokens == 0:
            out = _step(s)
            sizes = dict((seq.request_id, n) for seq, n in out.batch)
            assert sizes.get("stream") == 1, (threshold, sizes)  # the stream's token every step
            seen.append(sizes["prompt"])
        assert seen == chunks, threshold
        s.kv.pool.check_integrity()
    with pytest.raises(ValueError):
        SchedulerConfig(long_prefill_token_threshold=-1)


def test_a_decode_node_slices_prompts_to_a_tenth_of_a_second_at_its_rate():
    """The automatic threshold: what the node computes in PROMPT_SLICE_S, in whole blocks; no cap where that
    reaches the step's budget (a fast device); one block at least."""
    from kvmesh.node.landing_bound import PROMPT_SLICE_S, prompt_slice

    assert prompt_slice(640.0, 16, 2048) == int(640 * PROMPT_SLICE_S) // 16 * 16 == 64
    assert prompt_slice(50_000.0, 16, 2048) == 0
    assert prompt_slice(10.0, 16, 2048) == 16
    assert prompt_slice(640.0, 16, 2048, slice_s=0.25) == 160  # --prompt-slice-ms 250


def test_serve_passes_the_prompt_slice_to_its_nodes_and_refuses_a_slice_of_nothing():
    """``--prompt-slice-ms`` reaches every node ``kvmesh serve`` starts (their NodeConfig's ``prompt_slice_s``);
    0 or less is refused before anything starts."""
    from kvmesh.cli import build_parser
    from kvmesh.cluster.node_main import scheduling_argument_error
    from kvmesh.cluster.serve import node_share_args

    args = build_parser().parse_args(["serve", "--prompt-slice-ms", "120"])
    passed = node_share_args(args)
    assert "--prompt-slice-ms" in passed and passed[passed.index("--prompt-slice-ms") + 1] == "120.0"
    assert scheduling_argument_error(args) is None
    node = build_parser().parse_args(["decode-node", "--node-id", "d", "--etcd", "x:1", *passed])
    assert node.prompt_slice_ms == 120.0 and scheduling_argument_error(node) is None
    for bad in ("0", "-5", "nan", "inf"):
        args = build_parser().parse_args(["serve", "--prompt-slice-ms", bad])
        assert "--prompt-slice-ms must be more than 0 and finite" in scheduling_argument_error(args), bad


def test_every_scheduled_token_has_a_block_as_decodes_cross_block_ends():
    """Decodes take their next token's block only when it starts one (most steps need none): after every
    schedule each scheduled chunk's tokens fit its blocks, and the pool holds exactly the blocks the running
    requests cover."""
    s = _scheduler(64)
    seqs = [_seq(f"r{i}", 0, num_tokens=13 + 7 * i) for i in range(4)]  # prompts ending at different offsets
    for seq in seqs:
        s.add(seq)
    for _ in range(40):  # every request crosses two block ends or more
        out = s.schedule()
        for seq, n in out.batch:
            assert len(seq.block_ids) * 16 >= seq.num_computed_tokens + n, seq.request_id
            assert len(seq.block_ids) == -(-(seq.num_computed_tokens + n) // 16), seq.request_id  # none ahead
        for seq, n in out.batch:
            s.advance(seq, n)
            if not seq.is_prefilling:
                seq.output_token_ids.append(1)
        s.kv.pool.check_integrity()
    assert sum(len(seq.block_ids) for seq in seqs) == s.kv.pool.usage().num_used
