"""Small node mechanisms and policies: the decode-side cost model, publisher bounds, lease renewal."""
from __future__ import annotations

import time

import pytest

from kvmesh.node import planner
from kvmesh.metadata.block_index import BlockIndex, BlockPublisher, read_holdings
from kvmesh.metadata.holdings import block_key
from kvmesh.metadata.keys import KeyLayout
from kvmesh.metadata.memory_store import MemoryStore
from kvmesh.metadata.records import NodeRecord
from kvmesh.metadata.registry import NodeRegistry
from tests.metadata_node import chain


def plan_fetch(num_local: int, held_end: int, end: int, block_size: int, bytes_per_token: int, *,
               local_tokens_per_s: float, remote_tokens_per_s: float, bytes_per_s: float, rtt_s: float = 0.010,
               have_prefill_node: bool, prefill_queue_s: float = 0.0, prefill_bytes_per_s: float | None = None,
               prefill_rtt_s: float | None = None, local_queue_s: float = 0.0,
               prefill_holds_prefix: bool = False) -> planner.FetchPlan:
    """One holder of blocks [0, held_end) and one prefill node, described as the decode node sees them."""
    holders = (planner.HolderOption("holder", held_end, bytes_per_s, rtt_s),) if held_end > num_local else ()
    prefill = planner.PrefillOption(
        "prefill", remote_tokens_per_s, prefill_queue_s, rtt_s if prefill_rtt_s is None else prefill_rtt_s,
        prefill_bytes_per_s or bytes_per_s, held_end if prefill_holds_prefix else 0) if have_prefill_node else None
    return planner.plan_fetch(planner.PlanRequest(num_local, end, block_size, bytes_per_token, local_tokens_per_s,
                                                  local_queue_s, holders=holders, prefill=prefill))


def test_fetch_plan_picks_the_cheapest_source():
    bs, bpt = 16, 46_080  # SmolLM2 fp32: 46 KB of KV per token
    rates = dict(local_tokens_per_s=400.0, remote_tokens_per_s=400.0, rtt_s=0.005, have_prefill_node=True)
    # Nothing held anywhere, prefill nodes as fast as this one: computing here is never slower.
    plan = plan_fetch(0, 0, 32, bs, bpt, bytes_per_s=1.25e9, **rates)
    assert (plan.holders_end, plan.use_prefill) == (0, False) and plan.seconds == plan.local_seconds
    # A peer holds 30 of 32 blocks over a 10 Gbit/s link: fetch them, compute the 2 others here meanwhile.
    plan = plan_fetch(0, 30, 32, bs, bpt, bytes_per_s=1.25e9, **rates)
    assert (plan.holders_end, plan.use_prefill) == (30, False) and plan.seconds < plan.local_seconds / 5
    # The same over 100 Mbit/s: moving 46 KB/token (3.7 ms) loses to computing it (2.5 ms): stay local.
    plan = plan_fetch(0, 30, 32, bs, bpt, bytes_per_s=12.5e6, **rates)
    assert (plan.holders_end, plan.use_prefill) == (0, False)
    # A prefill node 10x faster (a GPU) on a fast link: it computes what nobody holds.
    plan = plan_fetch(2, 10, 32, bs, bpt, bytes_per_s=1.25e9, **{**rates, "remote_tokens_per_s": 4000.0})
    assert (plan.holders_end, plan.use_prefill) == (10, True) and plan.seconds < plan.local_seconds
    # ... but not when no prefill node is registered.
    plan = plan_fetch(2, 10, 32, bs, bpt, bytes_per_s=1.25e9,
                      **{**rates, "remote_tokens_per_s": 4000.0, "have_prefill_node": False})
    assert not plan.use_prefill
    with pytest.raises(ValueError):
        plan_fetch(0, 0, 1, bs, bpt, bytes_per_s=1e9, **{**rates, "local_tokens_per_s": 0.0})


def test_publisher_queue_is_bounded_and_counts_what_it_drops():
    store = MemoryStore()
    publisher = BlockPublisher(store, "c", "ns", "n1", max_pending=5, start=False)  # no lease yet: all waits
    try:
        hashes = chain("bound", 8)
        publisher.publish(hashes)
        assert publisher.num_pending == 5 and publisher.num_dropped == 3  # the chain's head stays queued
        publisher.unpublish(hashes[:1])  # the newest intent for a hash replaces the older one
        assert publisher.num_pending == 5
        publisher.set_lease(store.grant_lease(10))
        assert publisher.flush()
        listed = read_holdings(store, KeyLayout("c"), "ns").table.nodes["n1"].blocks.as_dict()
        # The first record on a lease is a snapshot of everything held: what the full queue dropped is in it.
        assert set(listed) == {block_key(h) for h in hashes[1:]} and publisher.num_pending == 0
        assert publisher.num_dropped == 3
        more = chain("bound-more", 9)
        publisher.publish(more)  # on a lease now: 5 queued, 4 dropped, and a snapshot made due
        assert publisher.num_dropped == 3 + 4 and publisher.flush()
        listed = read_holdings(store, KeyLayout("c"), "ns").table.nodes["n1"].blocks.as_dict()
        assert set(listed) == {block_key(h) for h in hashes[1:] + more}  # nothing the queue dropped is missing
    finally:
        publisher.close()


def test_registry_renews_an_expired_lease_and_republishes():
    store = MemoryStore()
    registry = NodeRegistry(store, "c", ttl_s=1)
    publisher = BlockPublisher(store, "c", "ns", "n1")
    registry.on_new_lease(publisher.set_lease)
    registry.register(NodeRecord("n1", "decode", "h", "t:1", "s:2"))
    index = BlockIndex(store, "c", "ns")
    try:
        assert index.mirror.wait_healthy(10)  # its first listing is in (until then it answers "nothing")
        hashes = chain("renew", 4)
        publisher.publish(hashes)
        assert publisher.flush() and index.lookup(hashes) == {"n1": 4}
        first = registry.lease_id
        store.revoke_lease(first)  # as if etcd had expired it during an outage
        assert index.lookup(hashes) == {}
        deadline = time.monotonic() + 5
        while index.lookup(hashes) != {"n1": 4}:
            assert time.monotonic() < deadline, "the node did not come back"
            time.sleep(0.05)
        assert registry.lease_id != first
    finally:
        publisher.close()
        registry.deregister()
        index.close()


def test_cache_aware_policy_predicts_time_to_first_token_when_rates_are_known():
    import threading

    from kvmesh.cluster.router import _Queued
    from kvmesh.cluster.routing import CacheAware, Candidate

    policy = CacheAware()

    def pick(a_cached: int, a_queued: int, b_queued: int = 0, a_rate: float = 10_000.0) -> str:
        return policy.choose([Candidate("a", a_cached, 1, 600, (a_queued,), a_rate),
                              Candidate("b", 0, 0, 600, (b_queued,), 10_000.0)])

    assert pick(512, 0) == "a"  # 88 tokens there vs 600 here
    assert pick(512, 2_000) == "b"  # 2,088 queued-and-uncached tokens there: computing 600 here is sooner
    assert pick(512, 400, b_queued=400) == "a"  # the same queue on both: the cache decides
    assert pick(512, 0, a_rate=1_000.0) == "b"  # a slow node: 88 ms there vs 60 ms here
    assert pick(0, 0) == "b"  # nothing cached anywhere: the shorter queue, then the lighter load

    # Requests in flight: each delays a new one by about one decode step (SmolLM2 at one thread: ~15 ms,
    # 1,600 prompt tokens/s). A 64-token hit on a node with 4 in flight: 60 ms + 147 ms; an idle node: 188 ms.
    def busy(a_load: int, step_s: float) -> str:
        return policy.choose([Candidate("a", 64, a_load, 300, (), 1_600.0, step_s),
                              Candidate("b", 0, 0, 300, (), 1_600.0, step_s)])

    assert busy(4, 0.015) == "b"
    assert busy(1, 0.015) == "a"  # one in flight: 162 ms there, still sooner
    assert busy(4, 0.0) == "a"  # the decode step unknown (an older node record): the queue and cache alone
    # The router prices each node with that node's planner: a node without the prefix fetches it from the node
    # that holds it (64 blocks of SmolLM2 fp32 KV, 47 MB: ~55 ms at the 1 GiB/s prior) rather than computing
    # 1,056 tokens (~1 s); the holder itself is busy (10 requests of 50 ms in flight).
    from kvmesh.node.planner import HolderOption

    held_by_a = (HolderOption("a", 64, 2**30, 0.010),)
    a = Candidate("a", 1024, 10, 1056, (), 1_000.0, 0.05, (), 16, 16 * 46_080)
    b_blind = Candidate("b", 0, 0, 1056, (), 1_000.0, 0.05, (), 16, 16 * 46_080)
    assert b_blind.predicted_ttft_s() == pytest.approx(1.056)  # no holder known: all of it computed there
    assert policy.choose([a, b_blind]) == "a"
    b = b_blind._replace(holders=held_by_a)
    assert b.predicted_ttft_s() < 0.1 and policy.choose([a, b]) == "b"
    assert policy.choose([a, b._replace(holders=(HolderOption("a", 64, 1e6, 0.010),))]) == "a"  # a 1 MB/s link
    # A node whose rate is unknown: the token score (cached tokens against load) decides.
    assert policy.choose([Candidate("a", 512, 1, 600, (5_000,), 0.0), Candidate("b", 0, 0, 600, (), 1e4)]) == "a"

    queues, lock = {}, threading.Lock()
    share = _Queued(queues, lock)
    share.add("a", 100)
    other = _Queued(queues, lock)
    other.add("a", 50)
    assert {n: sorted(q.values()) for n, q in queues.items()} == {"a": [50, 100]}  # each prompt's share kept
    share.add("b", 70)  # moved (a migration): its tokens leave a's queue
    assert {n: sorted(q.values()) for n, q in queues.items()} == {"a": [50], "b": [70]}
    share.release(), share.release()  # first token, then the end: released once
    other.release()
    _Queued(queues, lock).add("a", 0)  # a prompt fully cached there queues nothing
    assert queues == {}


def test_a_node_that_slices_prompts_is_priced_for_the_slices_computed_beside_a_new_one():
    """A decode node computing a long prompt in slices gives a short prompt its first token within about one
    slice of that prompt, so its cached prefix can win over a fetch elsewhere; a node computing prompts one after
    another (no slice) makes it wait for the whole queue."""
    from kvmesh.cluster.routing import CacheAware, Candidate
    from kvmesh.node.planner import HolderOption, prompt_tokens_ahead

    assert prompt_tokens_ahead([500, 40], 0, 32) == 540  # no slicing: all of them first
    assert prompt_tokens_ahead([500, 40], 32, 32) == 32 + 32  # each computes one slice beside a one-slice prompt
    assert prompt_tokens_ahead([500, 40], 32, 200) == 200 + 40  # ... or what it computes while the new one runs
    assert prompt_tokens_ahead([], 32, 200) == 0
    # 1B-like node: 120 prompt tokens/s, 32-token slices. "a" holds the 512-token prefix and computes another
    # group's 544-token prompt; "b" is idle and would fetch the prefix (17 MiB) with a measured 0.3 s overhead.
    bytes_per_block = 16 * 32_768
    a = Candidate("a", 512, 1, 544, (544,), 120.0, 0.2, (), 16, bytes_per_block, prompt_tokens_per_step=32)
    b = Candidate("b", 0, 0, 544, (), 120.0, 0.2, (HolderOption("a", 32, 2**30, 0.3),), 16, bytes_per_block,
                  prompt_tokens_per_step=32)
    assert a.predicted_ttft_s() == pytest.approx(32 / 120 + 32 / 120)  # its one request in flight is that prompt
    assert a._replace(load=3).predicted_ttft_s() == pytest.approx(2 * 0.2 + 32 / 120 + 32 / 120)  # two decoding
    assert CacheAware().choose([a, b]) == "a"
    assert CacheAware().choose([a._replace(prompt_tokens_per_step=0), b._replace(prompt_tokens_per_step=0)]) == "b"


def test_the_router_learns_what_fetches_into_each_node_cost():
    """The prior until a fetch is seen; then each observed wait beyond the bytes (a weighted mean); requests whose
    KV came from a prefill node or a lower tier, or from nowhere, teach nothing."""
    from kvmesh.cluster.fetch_costs import FetchCosts
    from kvmesh.node.messages import RequestStats

    costs = FetchCosts(prior_rtt_s=0.01, bytes_per_s=1e9, weight=0.5)
    assert costs.rtt_s("d0") == 0.01
    costs.record("d0", RequestStats(tokens_reused_remote=0, kv_wait_ms=0.0), 1000)
    costs.record("d0", RequestStats(tokens_reused_remote=512, tokens_from_prefill_node=16, kv_wait_ms=900.0), 1000)
    costs.record("d0", RequestStats(tokens_reused_remote=512, promote_ms=5.0, kv_wait_ms=900.0), 1000)
    assert costs.rtt_s("d0") == 0.01 and costs.describe() == {}
    costs.record("d0", RequestStats(tokens_reused_remote=1000, kv_wait_ms=301.0), 1000)  # 1 MB: 1 ms of it is bytes
    assert costs.rtt_s("d0") == pytest.approx(0.3) and costs.rtt_s("d1") == 0.01
    costs.record("d0", RequestStats(tokens_reused_remote=1000, kv_wait_ms=101.0), 1000)
    assert costs.rtt_s("d0") == pytest.approx(0.2)
    assert costs.describe() == {"d0": {"rtt_ms": pytest.approx(200.0), "num_samples": 2}}


def test_cache_aware_policy_scores_cache_against_load_and_keeps_sessions():
    from kvmesh.cluster.routing import Candidate, CacheAware, RandomChoice, RoundRobin, make_policy

    policy = CacheAware(tokens_per_request=100, slack=1)
    # Prefer the node holding the prefix...
    assert policy.choose([Candidate("a", 0, 0), Candidate("b", 512, 0)]) == "b"
    # ...unless it is loaded far beyond what the cached tokens are worth.
    assert policy.choose([Candidate("a", 0, 0), Candidate("b", 512, 6)]) == "a"
    # A session sticks to its node while that node is within `slack` of the least loaded...
    assert policy.choose([Candidate("a", 0, 0), Candidate("b", 0, 1)], session_id="s") == "a"
    assert policy.choose([Candidate("a", 0, 1), Candidate("b", 0, 0)], session_id="s") == "a"
    # ...and moves when it is not: misses are not piled onto one overloaded node.
    assert policy.choose([Candidate("a", 0, 3), Candidate("b", 0, 0)], session_id="s") == "b"
    rr = RoundRobin()
    assert [rr.choose([Candidate("x", 0, 0), Candidate("y", 0, 0)]) for _ in range(4)] == ["x", "y", "x", "y"]
    picks = {RandomChoice(seed=i).choose([Candidate("x", 0, 0), Candidate("y", 0, 0)]) for i in range(20)}
    assert picks == {"x", "y"}
    with pytest.raises(ValueError, match="cache-aware"):
        make_policy("smartest")


def test_cost_fit_separates_the_fixed_cost_of_a_step_from_its_rate():
    import random

    from kvmesh.rate_meter import CostFit

    rng = random.Random(0)
    truth = lambda n: 0.0005 + n / 100_000  # noqa: E731  the tiny preset's prefill on one thread, roughly
    # A probe at start-up 30% pessimistic, then steps of varied sizes (noise +-5%): the fit finds the truth.
    fit = CostFit([(64, truth(64) * 1.3), (512, truth(512) * 1.3)])
    assert fit.per_s < 80_000
    for _ in range(200):
        n = rng.choice((33, 34, 40, 800, 96))
        fit.record(n, truth(n) * rng.uniform(0.95, 1.05))
    assert abs(fit.per_s - 100_000) / 100_000 < 0.1 and abs(fit.fixed_s - 0.0005) < 0.0002
    assert abs(fit.seconds(768) - truth(768)) / truth(768) < 0.05
    # What the old meter (tokens / step time, averaged) says after the short steps that dominate a decode
    # node's life: ~44k tokens/s, less than half the marginal rate.
    from kvmesh.rate_meter import RateMeter

    meter = RateMeter(512 / truth(512))
    for _ in range(50):
        meter.record(40, truth(40) * rng.uniform(0.95, 1.05))
    assert meter.per_s < fit.per_s / 2

    # One cold first step (a new shape: twice as slow) hardly moves a fresh fit: 768 tokens priced within 10%.
    fit = CostFit([(64, truth(64)), (512, truth(512))])
    fit.record(800, truth(800) * 2)
    assert abs(fit.seconds(768) - truth(768)) / truth(768) < 0.1

    # Steps all of one size say nothing about the slope: the probe's slope stays, the fixed part moves.
    fit = CostFit([(64, truth(64)), (512, truth(512))])
    for _ in range(300):
        fit.record(40, truth(40) * 1.5)  # the machine got busier
    assert abs(fit.per_s - 100_000) / 100_000 < 0.25
    assert abs(fit.seconds(40) - truth(40) * 1.5) / (truth(40) * 1.5) < 0.1

    # Longer steps taking less time (noise bigger than the size effect): no negative rate, no negative fixed.
    fit = CostFit([(64, 0.002), (512, 0.001)])
    assert fit.per_s > 0 and fit.fixed_s == 0.0
    with pytest.raises(ValueError):
        CostFit([(64, 0.001), (64, 0.002)])  # one amount: no line through it
    with pytest.raises(ValueError):
        CostFit([(64, 0.001)])


def test_transfer_rate_estimator_learns_the_link_and_flips_the_decision():
    from kvmesh.decode_node.cost_model import TransferRateEstimator

    est = TransferRateEstimator(prior_bytes_per_s=2**30)
    rates = dict(local_tokens_per_s=400.0, remote_tokens_per_s=400.0, have_prefill_node=True)

    def plan():  # a peer holds the whole 512-token prefix
        return plan_fetch(0, 32, 32, 16, 46_080, bytes_per_s=est.bytes_per_s, rtt_s=est.rtt_s, **rates)

    assert plan().holders_end == 32  # the prior (1 GiB/s) says fetch
    est.record_transfer(1000, 0.001)  # too small to say anything
    assert est.num_samples == 0
    for _ in range(5):  # a 100 Mbit/s link: 12.5 MB/s, timed inside the writer's transfer engine
        est.record_transfer(12_500_000, 1.0)
    assert abs(est.bytes_per_s - 12_500_000) / 12_500_000 < 0.01
    assert plan().holders_end == 0  # learned: computing here beats moving the bytes


def test_transfer_rates_are_learned_per_peer_and_link():
    """Same-host shared-memory pushes are ~5x a loopback network link: one average of both would make the
    decode node fetch over the slow link when computing here is faster."""
    from kvmesh.decode_node.cost_model import NETWORK, SHARED_MEMORY, TransferRateEstimator

    est = TransferRateEstimator(prior_bytes_per_s=2**30)
    for _ in range(5):
        est.record_transfer(60_000_000, 0.01, "decode-0", SHARED_MEMORY)  # 6 GB/s
    for _ in range(5):
        est.record_transfer(12_500_000, 1.0, "remote-1", NETWORK)  # 12.5 MB/s
    assert est.bytes_per_s_to("decode-0", SHARED_MEMORY) == pytest.approx(6e9)
    assert est.bytes_per_s_to("remote-1", NETWORK) == pytest.approx(12.5e6)
    assert est.bytes_per_s_to("prefill-0", SHARED_MEMORY) == pytest.approx(6e9)  # unmeasured: its link's rate
    assert est.bytes_per_s_to("remote-2", NETWORK) == pytest.approx(12.5e6)
    assert est.bytes_per_s == pytest.approx(12.5e6) and set(est.by_link()) == {NETWORK, SHARED_MEMORY}
    est.record_transfer(25_000_000, 1.0, "remote-2", NETWORK)  # a faster network peer keeps its own rate
    assert est.bytes_per_s_to("remote-2", NETWORK) == pytest.approx(25e6)
    assert est.bytes_per_s_to("remote-1", NETWORK) == pytest.approx(12.5e6)

    def holders_end(peer: str, link: str) -> int:  # a peer holds the whole 512-token prefix
        return plan_fetch(0, 32, 32, 16, 46_080, bytes_per_s=est.bytes_per_s_to(peer, link), rtt_s=est.rtt_s,
                          local_tokens_per_s=400.0, remote_tokens_per_s=400.0, have_prefill_node=True).holders_end

    assert holders_end("decode-0", SHARED_MEMORY) == 32 and holders_end("remote-1", NETWORK) == 0
    assert TransferRateEstimator(2**30).bytes_per_s_to("anyone", SHARED_MEMORY) == 2**30  # nothing measured: prior


def test_prefill_node_link_prices_its_part():
    """The prefill node's part moves at its own link's rate, not the holder's."""
    common = dict(local_tokens_per_s=2000.0, remote_tokens_per_s=1e6, rtt_s=0.001, have_prefill_node=True)
    fast = plan_fetch(0, 0, 64, 16, 46_080, bytes_per_s=6e9, **common)
    slow = plan_fetch(0, 0, 64, 16, 46_080, bytes_per_s=6e9, prefill_bytes_per_s=12.5e6, **common)
    assert fast.use_prefill and not slow.use_prefill


def test_round_trips_are_per_link_and_seeded():
    """A fetch through shared memory pays a few ms of messaging; one over a network link more: each link keeps
    its own round trip, seeded by the start-up probe where there is one."""
    from kvmesh.decode_node.cost_model import NETWORK, SHARED_MEMORY, TransferRateEstimator

    est = TransferRateEstimator(prior_bytes_per_s=2**30, prior_rtt_s=0.010)
    assert est.rtt_s_for(SHARED_MEMORY) == est.rtt_s == est.min_rtt_s == 0.010
    est.seed_round_trip(0.002, SHARED_MEMORY)
    assert est.rtt_s_for(SHARED_MEMORY) == 0.002 and est.rtt_s == 0.010 and est.min_rtt_s == 0.002
    for _ in range(20):
        est.record_round_trip(0.030, NETWORK)
    assert est.rtt_s == pytest.approx(0.030, rel=0.01) and est.rtt_s_for(SHARED_MEMORY) == 0.002
    est.record_round_trip(0.004, SHARED_MEMORY)
    assert 0.002 < est.rtt_s_for(SHARED_MEMORY) < 0.004 and est.rtt_by_link().keys() == {NETWORK, SHARED_MEMORY}

    # 768 tokens at 100k tokens/s: 7.7 ms here. A same-host holder (2 ms + 0.1 ms of bytes) wins; a holder
    # behind a 30 ms round trip does not; a prefill node's part is priced with its own link's round trip.
    common = dict(local_tokens_per_s=100_000.0, remote_tokens_per_s=1e7, bytes_per_s=6e9, have_prefill_node=False)
    assert plan_fetch(0, 48, 48, 16, 1024, rtt_s=est.rtt_s_for(SHARED_MEMORY), **common).holders_end == 48
    assert plan_fetch(0, 48, 48, 16, 1024, rtt_s=est.rtt_s, **common).holders_end == 0
    common["have_prefill_node"] = True
    near = plan_fetch(0, 0, 48, 16, 1024, rtt_s=est.rtt_s, prefill_rtt_s=0.002, **common)
    far = plan_fetch(0, 0, 48, 16, 1024, rtt_s=0.002, prefill_rtt_s=est.rtt_s, **common)
    assert near.use_prefill and not far.use_prefill


def test_a_busy_node_sends_out_what_an_idle_one_computes():
    """The prompt tokens already queued on the decode node delay a prompt computed there; a fetch runs while
    that queue drains, so under load fetching (or a prefill node) wins where an idle node computes."""
    from kvmesh.node.planner import worth_a_lookup

    tiny = dict(local_tokens_per_s=100_000.0, remote_tokens_per_s=100_000.0, bytes_per_s=6e9, rtt_s=0.010,
                have_prefill_node=False)
    assert plan_fetch(0, 48, 50, 16, 1024, **tiny).holders_end == 0  # idle: 8 ms here beats a 10 ms fetch
    busy = plan_fetch(0, 48, 50, 16, 1024, local_queue_s=0.020, **tiny)
    assert busy.holders_end == 48 and busy.seconds < busy.local_seconds  # 20 ms queued: fetch meanwhile
    assert busy.seconds == pytest.approx(0.020 + 32 / 100_000)  # the rest here once both are done

    smol = dict(local_tokens_per_s=640.0, remote_tokens_per_s=640.0, bytes_per_s=1.5e9, rtt_s=0.010,
                have_prefill_node=True, prefill_rtt_s=0.020)
    assert not plan_fetch(0, 0, 34, 16, 46_080, **smol).use_prefill  # an idle node computes its 544 tokens
    assert plan_fetch(0, 0, 34, 16, 46_080, local_queue_s=0.5, **smol).use_prefill  # 800 tokens queued here
    # A prefix held by a peer: a prefill node that must pull it first is dearer than one that caches it.
    pulls = plan_fetch(0, 30, 34, 16, 46_080, local_queue_s=1.0, bytes_per_s=1.5e7,
                       **{k: v for k, v in smol.items() if k != "bytes_per_s"})
    holds = plan_fetch(0, 30, 34, 16, 46_080, local_queue_s=1.0, bytes_per_s=1.5e7, prefill_holds_prefix=True,
                       **{k: v for k, v in smol.items() if k != "bytes_per_s"})
    assert holds.use_prefill and holds.seconds < pulls.seconds

    assert not worth_a_lookup(768, 100_000.0, 0.010)  # 7.7 ms here: no fetch can win
    assert worth_a_lookup(768, 100_000.0, 0.010, local_queue_s=0.005)


def test_a_prefill_node_refuses_what_it_could_not_deliver_within_the_conversations_deadline():
    """A prompt accepted behind a backlog the node cannot clear before the requester's deadline would be computed
    twice (the requester gives up and computes it itself): refused BUSY at once instead, also where the requester
    set no ``wanted_within_ms`` (a forced placement); one it can deliver in time is accepted."""
    from types import SimpleNamespace

    from kvmesh.engine.llm import LLM
    from kvmesh.prefill_node.worker import PrefillRole, _Prefill
    from kvmesh.tracing import Tracer
    from kvmesh.transfer import messages as m
    from kvmesh.transfer.errors import TransferRefused

    llm = LLM("tiny-llama", num_kv_blocks=64, progress=False)
    engine = llm.engine
    began = []
    node = SimpleNamespace(
        cfg=SimpleNamespace(node_id="prefill-0", block_size=16, transfer_gib_per_s=1.0, transfer_rtt_s=0.001,
                            holder_timeout_s=1.0),
        engine=engine, pool=engine.kv.pool, agent=SimpleNamespace(requester=None), tiers=None,
        tracer=Tracer("test"), placement=None, workers=None, call_soon=began.append, membership=None,
        prefill_cost=SimpleNamespace(fixed_s=0.0), prefill_tokens_per_s=1000.0)
    role = PrefillRole(node)
    role._prefills["earlier"] = _Prefill(list(range(3000)), [])  # 3,000 tokens ahead: 3 s at 1,000 tokens/s

    def ask(request_id: str, deadline_ms: int, wanted_within_ms: int = 0):
        prompt = list(range(1, 34))  # two full blocks before its last token's
        return role.admit(m.ComputeAndPush(request_id, "decode-0", "g", prompt, 0, [5, 6], deadline_ms,
                                           wanted_within_ms))

    with pytest.raises(TransferRefused) as refused:
        ask("late", deadline_ms=2_000)  # ready in ~3.03 s, given 2
    assert refused.value.code == m.ErrorCode.BUSY.value and "deadline" in str(refused.value)
    with pytest.raises(TransferRefused):
        ask("slower-than-local", deadline_ms=10_000, wanted_within_ms=1_000)
    assert role.num_refused_busy == 2 and not began and set(role._prefills) == {"earlier"}
    assert len(ask("in-time", deadline_ms=10_000)) == 2  # the granted blocks' hashes; computing starts on the engine
    assert set(role._prefills) == {"earlier", "in-time"} and len(began) == 1
    engine.check_integrity()
