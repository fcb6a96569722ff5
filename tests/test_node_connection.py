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
