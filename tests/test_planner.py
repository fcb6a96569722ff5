"""The KV placement planner (node/planner.py): golden plans, and properties over random situations."""
from __future__ import annotations

import random

import pytest

from kvmesh.node.placement import CostPlacement, ThresholdPlacement, make_placement
from kvmesh.node.planner import FetchPlan, HolderOption, PlanRequest, PrefillOption, plan_fetch, worth_a_lookup

BS, BPT = 16, 4096  # tokens per block, KV bytes per token
GIB = 2**30


def req(**kw) -> PlanRequest:
    """A 64-block prompt, nothing cached, computed here at 1,000 tokens/s (about 1 s for all of it)."""
    base = dict(num_local=0, end=64, block_size=BS, bytes_per_token=BPT, local_tokens_per_s=1000.0)
    return PlanRequest(**{**base, **kw})


def holder(node_id: str, end: int, gib_per_s: float = 1.0, rtt_s: float = 0.005) -> HolderOption:
    return HolderOption(node_id, end, gib_per_s * GIB, rtt_s)


def prefill(node_id: str = "p0", tokens_per_s: float = 20000.0, queue_s: float = 0.0, holds: int = 0,
            gib_per_s: float = 1.0) -> PrefillOption:
    return PrefillOption(node_id, tokens_per_s, queue_s, fixed_s=0.01, bytes_per_s=gib_per_s * GIB, holds=holds)


def shape(plan: FetchPlan) -> tuple[int, str, int, str]:
    return plan.promote_end, plan.holder, plan.holders_end, plan.prefill_node


GOLDEN = [  # (situation, request, (promote_end, holder, holders_end, prefill_node))
    ("nothing anywhere: compute here", req(), (0, "", 0, "")),
    ("a peer holds 48 blocks on a fast link", req(holders=(holder("d1", 48),)), (0, "d1", 48, "")),
    ("the same peer behind a 1 MB/s link", req(holders=(holder("d1", 48, gib_per_s=0.001),)), (0, "", 0, "")),
    ("a prefill node 20x faster", req(prefill=prefill()), (0, "", 0, "p0")),
    ("that prefill node with 5 s of work queued", req(prefill=prefill(queue_s=5.0)), (0, "", 0, "")),
    ("holder for the prefix, prefill node for the rest",
     req(holders=(holder("d1", 40),), prefill=prefill()), (0, "d1", 40, "p0")),
    ("a longer prefix on a slow link loses to a shorter one on a fast link",
     req(holders=(holder("slow", 60, gib_per_s=0.005), holder("fast", 50, gib_per_s=2.0))), (0, "fast", 50, "")),
    ("this node's host tier reads back faster than it computes",
     req(num_local=8, num_lower=16, lower_read_s=0.01), (24, "", 24, "")),
    ("... a disk tier slower than computing is left alone",
     req(num_local=8, num_lower=16, lower_read_s=5.0), (8, "", 8, "")),
    ("a queue here makes a slowish holder worth it",
     req(local_queue_s=2.0, holders=(holder("d1", 60, gib_per_s=0.01, rtt_s=0.5),)), (0, "d1", 60, "")),
    ("everything already cached: nothing to do", req(num_local=64), (64, "", 64, "")),
    ("a prefill node 2x slower, this node idle: compute here",
     req(prefill=prefill(tokens_per_s=500.0)), (0, "", 0, "")),
    ("... with 4 streams decoding here: the prompt goes out rather than hold them up",
     req(prefill=prefill(tokens_per_s=500.0), num_streams=4), (0, "", 0, "p0")),
    ("... a slow holder beats holding 4 streams up too",
     req(holders=(holder("d1", 64, gib_per_s=0.002),), num_streams=4), (0, "d1", 64, "")),
    ("one block, a prefill node 2x faster: its fixed cost outweighs 16 tokens",
     req(end=1, prefill=prefill(tokens_per_s=2000.0)), (0, "", 0, "")),
    ("... not with the 15 tokens of the partial last block, which it sends too",
     req(end=1, tail_tokens=15, prefill=prefill(tokens_per_s=2000.0)), (0, "", 0, "p0")),
]


@pytest.mark.parametrize("situation,request_,expected", GOLDEN, ids=[g[0] for g in GOLDEN])
def test_golden_plans(situation, request_, expected):
    plan = plan_fetch(request_)
    assert shape(plan) == expected, (situation, plan)
    if not request_.num_streams:
        assert plan.seconds <= plan.local_seconds and plan.stall_s == 0.0


def test_streams_decoding_here_are_counted_once_per_stream_unless_the_policy_says_the_request_alone():
    r = req(prefill=prefill(tokens_per_s=500.0), num_streams=4)
    out = plan_fetch(r)
    assert out.prefill_node == "p0" and out.stall_s == 0.0
    assert out.seconds > out.local_seconds  # slower for the request itself ...
    local_cost = out.local_seconds + 4 * out.local_seconds  # ... than the request and four streams held up
    assert out.cost < local_cost and out.local_cost == pytest.approx(local_cost)  # what the prefill node must beat
    alone = make_placement("cost:request").plan(r)
    assert shape(alone) == (0, "", 0, "") and alone.stall_s == 0.0 and alone == plan_fetch(req(prefill=r.prefill))
    assert make_placement("cost").plan(r) == out
    here = plan_fetch(req(num_streams=3))  # nothing else to do: computed here, the wait counted
    assert here.stall_s == pytest.approx(3 * here.seconds)
    assert worth_a_lookup(10, 1000.0, rtt_s=0.02, num_streams=2) and not worth_a_lookup(10, 1000.0, rtt_s=0.02)
    assert not CostPlacement(counts_streams=False).worth_a_lookup(10, 1000.0, 0.02, 0.0, num_streams=2)


def test_a_plan_names_its_parts_and_their_estimates():
    plan = plan_fetch(req(num_local=4, num_lower=4, lower_read_s=0.01, holders=(holder("d1", 40),),
                          prefill=prefill(holds=40)))
    assert shape(plan) == (8, "d1", 40, "p0") and plan.compute_from == 64 and plan.needs_fetch
    moved = (40 - 8) * BS * BPT / GIB
    assert plan.holders_s == pytest.approx(0.005 + moved)
    # The prefill node caches the prefix itself: it starts at once, in parallel with the holder.
    assert plan.prefill_s == pytest.approx(0.01 + max(24 * BS / 20000.0, 24 * BS * BPT / GIB))
    assert plan.ready_s == pytest.approx(max(plan.holders_s, plan.prefill_s))
    assert plan.seconds == pytest.approx(plan.promote_s + plan.ready_s)
    assert plan.local_seconds == pytest.approx(0.01 + 56 * BS / 1000.0)


def test_a_prefill_node_without_the_prefix_waits_for_it():
    alone = plan_fetch(req(holders=(holder("d1", 40, gib_per_s=0.05),), prefill=prefill(holds=40)))
    fetching = plan_fetch(req(holders=(holder("d1", 40, gib_per_s=0.05),), prefill=prefill(holds=0)))
    assert alone.prefill_s < fetching.prefill_s


def test_threshold_placement_fetches_above_the_limit_only():
    r = req(num_local=2, num_lower=3, holders=(holder("a", 20), holder("b", 30)), prefill=prefill())
    assert shape(make_placement("threshold:0").plan(r)) == (5, "b", 30, "p0")
    assert shape(ThresholdPlacement(10_000).plan(r)) == (5, "", 5, "")
    assert shape(ThresholdPlacement(0).plan(req())) == (0, "", 0, "")
    assert ThresholdPlacement(100).worth_a_lookup(101, 1e9, 1.0, 0.0)
    assert not ThresholdPlacement(100).worth_a_lookup(100, 1.0, 0.0, 0.0)


def test_cost_placement_is_the_planner_and_bad_specs_are_refused():
    r = req(num_local=2, num_lower=3, holders=(holder("a", 20), holder("b", 30)), prefill=prefill())
    assert make_placement("cost") == CostPlacement() and CostPlacement().plan(r) == plan_fetch(r)
    for bad in ("threshold", "threshold:-1", "threshold:x", "fixed:3", ""):
        with pytest.raises(ValueError, match="expected 'cost', 'cost:request' or 'threshold:N'"):
            make_placement(bad)


def test_lookups_are_skipped_only_when_computing_beats_any_round_trip():
    assert not worth_a_lookup(10, 1000.0, rtt_s=0.02)
    assert worth_a_lookup(30, 1000.0, rtt_s=0.02)
    assert worth_a_lookup(10, 1000.0, rtt_s=0.02, local_queue_s=0.02)


def _random_request(rng: random.Random) -> PlanRequest:
    end = rng.randrange(1, 200)
    num_local = rng.randrange(0, end + 1)
    num_lower = rng.randrange(0, end - num_local + 1)
    holders = tuple(HolderOption(f"h{i}", rng.randrange(0, end + 20), rng.choice([0.0, 10 ** rng.uniform(5, 10)]),
                                 rng.uniform(0, 0.2)) for i in range(rng.randrange(0, 4)))
    pf = None if rng.random() < 0.3 else PrefillOption(
        "p", rng.choice([0.0, 10 ** rng.uniform(2, 5)]), rng.uniform(0, 3), rng.uniform(0, 0.1),
        rng.choice([0.0, 10 ** rng.uniform(5, 10)]), rng.randrange(0, end + 1))
    return PlanRequest(num_local, end, rng.choice([1, 16]), rng.randrange(1, 8192), 10 ** rng.uniform(1, 5),
                       rng.uniform(0, 2) * (rng.random() < 0.5), num_lower, rng.uniform(0, 1), holders, pf,
                       rng.choice([0, 0, 1, 7]), tail_tokens=rng.choice([0, rng.randrange(0, 16)]))


def test_no_plan_costs_more_than_computing_here():
    """Cost = the request's estimate + the wait on the streams decoding here; with none, the estimate alone."""
    rng = random.Random(7)
    for _ in range(5000):
        r = _random_request(rng)
        plan = plan_fetch(r)
        compute_s = ((r.end - r.num_local) * r.block_size + r.tail_tokens) / r.local_tokens_per_s
        compute_all_here = r.local_queue_s + compute_s + r.num_streams * compute_s
        assert plan.cost <= compute_all_here + 1e-12, (r, plan)
        here = (plan.end - plan.compute_from) * r.block_size + (0 if plan.prefill_node else r.tail_tokens)
        assert plan.stall_s == pytest.approx(r.num_streams * here / r.local_tokens_per_s)
        if not r.num_streams:
            assert plan.seconds <= plan.local_seconds <= compute_all_here + 1e-12, (r, plan)
        assert r.num_local <= plan.promote_end <= plan.holders_end <= plan.end == r.end, (r, plan)
        assert bool(plan.holder) == (plan.holders_end > plan.promote_end), (r, plan)
        assert plan.seconds == pytest.approx(plan.promote_s + plan.ready_s)
        if plan.holder:  # it really holds what the plan asks of it
            assert next(h for h in r.holders if h.node_id == plan.holder).end >= plan.holders_end


def test_a_local_rate_that_is_not_positive_is_an_error():
    with pytest.raises(ValueError):
        plan_fetch(req(local_tokens_per_s=0.0))


def test_prefill_candidates_put_the_named_nodes_first_whatever_their_load():
    from kvmesh.decode_node.prefill_nodes import PrefillNodes

    class Membership:
        def nodes(self, role):
            return {"p0": None, "p1": None, "p2": None}

    nodes = PrefillNodes("d0", Membership(), requester=None, links=None, block_size=16, prior_rtt_s=0.01,
                         timeout_s=1.0)
    nodes.reserve("p0", 512)  # a conversation planned on p0 is in flight
    assert nodes.candidates({}, "p0")[0] == "p0"  # the plan's choice
    assert nodes.candidates({}, "p2")[0] == "p2"
    assert nodes.candidates({"p1": 3})[0] == "p1"  # none named: the longest cached prefix
    assert nodes.candidates({})[-1] == "p0"  # ... then the least loaded
    nodes.release("p0", 512)
    assert len({nodes.candidates({})[0] for _ in range(3)}) == 1  # asking alone does not move the rotation
    firsts = []
    for _ in range(3):  # each planned conversation does: equal nodes take turns
        firsts.append(nodes.any_option({}).node_id)
        nodes.reserve(firsts[-1], 64)
        nodes.release(firsts[-1], 64)
    assert sorted(firsts) == ["p0", "p1", "p2"]


def test_a_prefill_node_late_but_within_its_promise_is_waited_for():
    """A prefill node that accepts a prompt promises to beat the requester's own estimate of computing it
    (``wanted_within``); the prefill timeout is the grace past that promise. Giving up on a node that is late
    but still computing would start the whole prompt again here, after the wait. A node that never answers is
    still given up on (and the rest computed here); a forced conversation (no estimate) waits the timeout."""
    from kvmesh.decode_node.prefill_nodes import PrefillNodes
    from kvmesh.engine.kv_connector import KVLease
    from kvmesh.transfer.errors import TransferTimeout
    from kvmesh.transfer.requester import PushOutcome

    class Requester:
        """Each prefill node needs ``work_s`` to deliver; a conversation that allows less times out."""
        def __init__(self, work_s):
            self.work_s, self.timeouts = work_s, []

        def compute_and_push(self, node_id, block_ids, prompt, first_block, *, timeout_s, wanted_within_s, **_):
            self.timeouts.append(timeout_s)
            if self.work_s[node_id] > timeout_s:
                return PushOutcome(0, [], TransferTimeout("no final result", peer=node_id))
            return PushOutcome(len(block_ids), [], None)

    class Links:
        def record_transfer(self, *args):
            pass

    class Membership:
        def nodes(self, role):
            return {"p0": None}

    lease = KVLease("r", tuple(range(8)), (b"h" * 16,) * 8, tuple(range(130)), 0, 8)
    late = Requester({"p0": 5.0})  # twice the timeout, within the promise of 8 s
    nodes = PrefillNodes("d0", Membership(), late, Links(), block_size=16, prior_rtt_s=0.01, timeout_s=2.5)
    assert nodes.compute_and_push(lease, 0, 8, ["p0"], local_s=8.0).got == 8
    assert nodes.num_fallbacks == 0 and 10.0 <= late.timeouts[0] <= 10.5
    hung = Requester({"p0": float("inf")})
    nodes = PrefillNodes("d0", Membership(), hung, Links(), block_size=16, prior_rtt_s=0.01, timeout_s=2.5)
    assert nodes.compute_and_push(lease, 0, 8, ["p0"], local_s=8.0).got == 0
    assert nodes.num_fallbacks == 1
    forced = Requester({"p0": 5.0})
    nodes = PrefillNodes("d0", Membership(), forced, Links(), block_size=16, prior_rtt_s=0.01, timeout_s=2.5)
    assert nodes.compute_and_push(lease, 0, 8, ["p0"], local_s=0.0).got == 0 and forced.timeouts == [2.5]


def test_a_forced_conversation_is_given_the_prefill_nodes_expected_time():
    """A forced conversation (no estimate of computing here to beat) waits for what the prefill node is expected
    to take, this node's earlier conversations there included, plus the timeout: giving up on a node that is
    computing the prompt as fast as it measured would compute it here a second time."""
    from types import SimpleNamespace

    from kvmesh.decode_node.prefill_nodes import PrefillNodes
    from kvmesh.engine.kv_connector import KVLease
    from kvmesh.transfer.requester import PushOutcome

    class Requester:
        def __init__(self):
            self.timeouts = []

        def compute_and_push(self, node_id, block_ids, prompt, first_block, *, timeout_s, wanted_within_s, **_):
            self.timeouts.append(timeout_s)
            return PushOutcome(len(block_ids), [], None)

    class Links:
        def record_transfer(self, *args):
            pass

    record = SimpleNamespace(probe=SimpleNamespace(prefill_tokens_per_s=32.0, decode_step_s=0.05))

    class Membership:
        def nodes(self, role):
            return {"p0": record}

    lease = KVLease("r", tuple(range(8)), (b"h" * 16,) * 8, tuple(range(130)), 0, 8)
    requester = Requester()
    nodes = PrefillNodes("d0", Membership(), requester, Links(), block_size=16, prior_rtt_s=0.01, timeout_s=2.5)
    alone_s = 0.01 + 0.05 + 128 / 32.0  # the fixed part (round trip, one step there), then 8 blocks at 32 tokens/s
    assert nodes.expected_s("p0", 128) == pytest.approx(alone_s)
    nodes.reserve("p0", 256)  # another of this node's prompts, planned there before this one
    assert nodes.compute_and_push(lease, 0, 8, ["p0"], local_s=0.0).got == 8
    assert requester.timeouts == [pytest.approx(2.5 + alone_s + 256 / 32.0)]
    assert nodes.compute_and_push(lease, 0, 8, ["p0"], local_s=3.0).got == 8  # a priced one: its promise
    assert requester.timeouts[-1] == pytest.approx(2.5 + 3.0, abs=0.1)
    assert nodes.expected_s("p9", 128) == 0.0  # not registered: the bare timeout


def test_a_prompt_spread_over_steps_capped_beside_streams_pays_for_their_decodes():
    """A decode node with streams caps the prompt tokens of each step (``LandingBound.step_tokens``), so a prompt
    computed there spreads over steps that also decode the streams: its own time counts a decode step for every
    step after its first (``local_step_tokens``, ``local_decode_step_s``), while the streams' wait stays the
    compute alone. A prompt that fits one step pays nothing more (its step is the one a fetch would wait for)."""
    slow_prefill = prefill(tokens_per_s=400.0)  # 1,024 tokens in 2.56 s there, 1.02 s here at 1,000 tokens/s
    plain = plan_fetch(req(prefill=slow_prefill, num_streams=1))
    assert shape(plain) == (0, "", 0, "") and plain.stall_s == pytest.approx(1.024)  # 2.05 s against 2.57 s
    capped = plan_fetch(req(prefill=slow_prefill, num_streams=1, local_step_tokens=32, local_decode_step_s=0.1))
    assert shape(capped) == (0, "", 0, "p0")  # 1.02 s + 31 decode steps here (+1.02 s of stall) against 2.57 s
    assert capped.local_seconds == pytest.approx(1.024 + 31 * 0.1)
    here = plan_fetch(req(num_streams=2, local_step_tokens=32, local_decode_step_s=0.1))  # nowhere else to go
    assert here.seconds == pytest.approx(1.024 + 31 * 0.1)
    assert here.stall_s == pytest.approx(2 * 1.024)  # the streams decode in those steps: they wait the compute
    one_step = plan_fetch(req(num_local=62, num_streams=2, local_step_tokens=32, local_decode_step_s=0.1))
    assert one_step.seconds == pytest.approx(32 / 1000.0)
    alone = plan_fetch(req(local_step_tokens=32, local_decode_step_s=0.1))  # no streams: no cap, no spread
    assert alone.seconds == pytest.approx(1.024)


def test_a_prefill_node_is_asked_to_beat_the_cost_of_computing_here_the_streams_wait_included():
    """A decode node that sends a prompt out to spare its streams asks the prefill node to beat what computing it
    here would cost (``FetchPlan.local_cost``), not the request's time alone: a prefill node somewhat slower than
    this node but sparing its streams is the plan, and must not refuse it as too slow (``wanted_within_ms``)."""
    from concurrent.futures import ThreadPoolExecutor

    from kvmesh.decode_node.fetcher import Fetcher
    from kvmesh.decode_node.prefill_nodes import PrefillResult
    from kvmesh.engine.kv_connector import KVLease
    from kvmesh.node.connectors import HolderLoad

    plan = plan_fetch(req(prefill=prefill(tokens_per_s=500.0), num_streams=4))
    assert plan.prefill_node == "p0" and plan.prefill_s > plan.local_seconds
    asked = []

    class PrefillNodes:
        def candidates(self, hits, *first):
            return list(first)

        def compute_and_push(self, lease, start, end, order, local_s, reserved, trace_context):
            asked.append(local_s)
            return PrefillResult(end, [], 0, [], 1)

    class Holders:
        def load(self, lease, start, end, hits, planned, trace_context=""):
            return HolderLoad(start, "", [], [], 0)

    lease = KVLease("r", tuple(range(64)), (b"h" * 16,) * 64, tuple(range(1025)), 0, 64)
    with ThreadPoolExecutor(1) as conversations:
        outcome = Fetcher(None, Holders(), PrefillNodes(), conversations, BS).fetch(lease, plan, {})
    assert outcome.got == 64 and asked == [pytest.approx(plan.local_cost)]
    assert plan.local_cost == pytest.approx(5 * plan.local_seconds)  # the request and its four streams' wait
