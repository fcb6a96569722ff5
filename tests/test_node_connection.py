"""NodeConnection against a real ZMQ node endpoint that answers every request at once."""
from __future__ import annotations

import pytest

from cluster import node_connection
from cluster.node_connection import NodeConnection
from kvmesh.auth import ClusterAuth
from kvmesh.node import messages as nm
from kvmesh.router_endpoint import RouterEndpoint
from kvmesh.wire import decode, encode


@pytest.fixture
def echo_node():
    """A node endpoint that finishes every GenerateRequest with one token (its prompt's first)."""
    auth = ClusterAuth("test-token")
    endpoint: RouterEndpoint

    def on_message(identity: bytes, payload: bytes) -> None:
        msg = decode(payload, (nm.GenerateRequest, nm.StatsRequest))
        if isinstance(msg, nm.GenerateRequest):
            endpoint.send(identity, encode(nm.TokenEvent(msg.request_id, msg.prompt_token_ids[:1], finished=True)))

    endpoint = RouterEndpoint("127.0.0.1", on_message, name="echo-node", auth=auth).start()
    yield endpoint, auth
    endpoint.close()


def test_a_request_to_an_idle_connection_is_sent_at_once(monkeypatch, echo_node):
    """The socket thread waits in a poll between messages; ``submit`` wakes it. With a poll that never
    times out here, a request that waited for the timeout instead would never arrive."""
    monkeypatch.setattr(node_connection, "IDLE_POLL_MS", 600_000)
    endpoint, auth = echo_node
    conn = NodeConnection("echo", endpoint.endpoint, auth=auth)
    try:
        for i in range(20):  # after the first answer the thread is back in its poll when the next one comes
            events = conn.submit(nm.GenerateRequest(f"r{i}", [i + 1, 7]))
            event = events.get(timeout=60)
            assert isinstance(event, nm.TokenEvent) and event.finished and event.token_ids == [i + 1]
        assert conn.num_open == 0
    finally:
        conn.close()


def test_a_batched_frame_reaches_each_stream_in_order_and_a_malformed_one_nothing():
    """A node sends one frame per step (``TokenBatch``) holding several requests' events: each lands on its own
    request's queue in the order sent; a batch holding a malformed event is dropped whole."""
    auth = ClusterAuth("test-token")
    endpoint: RouterEndpoint
    pending: list[tuple[bytes, str]] = []

    def on_message(identity: bytes, payload: bytes) -> None:
        msg = decode(payload, (nm.GenerateRequest, nm.StatsRequest))
        if not isinstance(msg, nm.GenerateRequest):
            return
        pending.append((identity, msg.request_id))
        if len(pending) == 2:  # both requests' tokens and ends in one frame, interleaved as a step emits them
            (ident, a), (_, b) = pending
            bad = encode(nm.TokenEvent("ghost", [1])).replace(b"ghost", b"ghos\xff")
            endpoint.send(ident, encode(nm.TokenBatch([encode(nm.TokenEvent(a, [5])), bad])))
            events = [nm.TokenEvent(a, [1]), nm.TokenEvent(b, [2]), nm.TokenEvent(a, [3]),
                      nm.TokenEvent(b, [], finished=True, finish_reason="length"),
                      nm.TokenEvent(a, [], finished=True, finish_reason="stop")]
            endpoint.send(ident, encode(nm.TokenBatch([encode(e) for e in events])))

    endpoint = RouterEndpoint("127.0.0.1", on_message, name="batch-node", auth=auth).start()
    conn = NodeConnection("batch", endpoint.endpoint, auth=auth)
    try:
        qa, qb = conn.submit(nm.GenerateRequest("a", [1])), conn.submit(nm.GenerateRequest("b", [1]))
        got_a = [qa.get(timeout=30) for _ in range(3)]
        got_b = [qb.get(timeout=30) for _ in range(2)]
        assert [(e.token_ids, e.finished) for e in got_a] == [([1], False), ([3], False), ([], True)]
        assert [(e.token_ids, e.finished) for e in got_b] == [([2], False), ([], True)]
        assert qa.empty() and conn.num_open == 0  # the malformed batch's [5] never arrived
    finally:
        conn.close()
        endpoint.close()
    with pytest.raises(nm.MessageError):
        nm.TokenBatch([b"\x00"]).unpack()


def test_a_finished_requests_account_travels_as_a_typed_record():
    """``TokenEvent.stats`` is a ``RequestStats`` on both ends; a malformed one is refused, naming the field."""
    import msgpack

    from kvmesh.wire import MessageError

    stats = nm.RequestStats(tokens_reused_remote=64, tokens_computed=5, kv_wait_ms=12.5, spec_draft_tokens=3)
    event = decode(encode(nm.TokenEvent("r", [], finished=True, stats=stats)))
    assert event.stats == stats and event.stats.cached_tokens == 64
    assert decode(encode(nm.TokenEvent("r", [7]))).stats is None  # tokens in flight carry no account
    good = msgpack.unpackb(encode(nm.TokenEvent("r", [], finished=True, stats=stats)))
    for bad, match in (({"tokens_computed": "5"}, r"tokens\.stats\.tokens_computed: expected int"),
                       ({"made_up": 1}, r"tokens\.stats: unknown fields \['made_up'\]"),
                       ([1, 2], "expected a RequestStats map")):
        with pytest.raises(MessageError, match=match):
            decode(msgpack.packb({**good, "stats": bad}))
