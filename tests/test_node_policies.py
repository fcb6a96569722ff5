"""Small node mechanisms and policies: the decode-side cost model, publisher bounds, lease renewal."""
from __future__ import annotations

import time

import pytest

from kvmesh.decode_node.cost_model import local_prefill_limit
from kvmesh.metadata.block_index import BlockIndex, BlockPublisher
from kvmesh.metadata.memory_store import MemoryStore
from kvmesh.metadata.records import NodeRecord
from kvmesh.metadata.registry import NodeRegistry
from tests.metadata_node import chain


def test_cost_model_break_even():
    # 1,000 tok/s compute (1 ms/token), 1 MB/token over 10 GB/s (0.1 ms/token), 9 ms round trip -> 10 tokens.
    assert local_prefill_limit(1000, 1_000_000, 10e9, 0.009) == 10
    # Moving a token costs more than computing it: always compute.
    assert local_prefill_limit(1e6, 1_000_000, 1e9, 0.005) == 1 << 30
    # A slower network pushes the break-even up; a faster prefill too.
    assert local_prefill_limit(1000, 1_000_000, 2e9, 0.009) > 10
    assert local_prefill_limit(5000, 100, 1e9, 0.005) > local_prefill_limit(1000, 100, 1e9, 0.005)
    with pytest.raises(ValueError):
        local_prefill_limit(0, 1, 1, 1)


def test_publisher_queue_is_bounded_and_counts_what_it_drops():
    store = MemoryStore()
    publisher = BlockPublisher(store, "c", "ns", "n1", max_pending=5)  # no lease yet: everything waits
    try:
        hashes = chain("bound", 8)
        publisher.publish(hashes)
        assert publisher.num_pending == 5 and publisher.num_dropped == 3  # the chain's head stays queued
        publisher.unpublish(hashes[:1])  # the newest intent for a hash replaces the older one
        assert publisher.num_pending == 5
        publisher.set_lease(store.grant_lease(10))
        assert publisher.flush()
        keys = {kv.key for kv in store.get_prefix("/kvmesh/c/blocks/ns/")[0]}
        published = [h for h in hashes if any(h.hex() in k for k in keys)]
        assert published == hashes[1:5]  # the queue kept blocks 1-4 (and the unpublish of 0)
        assert publisher.num_dropped == 3 + 3  # the new lease re-queued 1-7: 5-7 did not fit again
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


def test_transfer_rate_estimator_learns_the_link_and_flips_the_decision():
    from kvmesh.decode_node.cost_model import TransferRateEstimator, local_prefill_limit

    est = TransferRateEstimator(prior_bytes_per_s=2**30)
    bytes_per_token, prefill_rate = 46_080, 400.0  # SmolLM2 fp32 on 2 cores
    fast = local_prefill_limit(prefill_rate, bytes_per_token, est.bytes_per_s, est.rtt_s)
    est.record_transfer(1000, 0.001)  # too small to say anything
    assert est.num_samples == 0
    for _ in range(5):  # a 100 Mbit/s link: 12.5 MB/s, timed inside the writer's transfer engine
        est.record_transfer(12_500_000, 1.0)
    assert abs(est.bytes_per_s - 12_500_000) / 12_500_000 < 0.01
    slow = local_prefill_limit(prefill_rate, bytes_per_token, est.bytes_per_s, est.rtt_s)
    assert fast < 100 and slow >= 1 << 30  # moving 46 KB/token at 12.5 MB/s loses to computing at any length
