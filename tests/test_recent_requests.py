"""RecentRequests: the last window's finished requests by prompt-token source, older ones forgotten."""
from __future__ import annotations

from kvmesh.cluster.recent_requests import RecentRequests
from kvmesh.node.messages import RequestStats


def test_only_the_window_is_counted():
    now = [0.0]
    recent = RecentRequests(window_s=60.0, clock=lambda: now[0])
    recent.record(RequestStats(tokens_computed=30, tokens_reused_local=16))
    now[0] = 30.0
    recent.record(RequestStats(tokens_from_prefill_node=48, tokens_reused_remote=32, kv_wait_ms=5.0))
    totals = recent.totals()
    assert totals["num_requests"] == 2 and totals["window_s"] == 60.0
    assert totals["prompt_tokens"] == {"local": 16, "host": 0, "disk": 0, "remote": 32, "prefill_node_cache": 0,
                                       "prefill_node": 48, "computed": 30}
    now[0] = 61.0  # the first request is past the window
    assert recent.totals()["num_requests"] == 1 and recent.totals()["prompt_tokens"]["computed"] == 0
    now[0] = 200.0
    assert recent.totals() == {"window_s": 60.0, "num_requests": 0, "prompt_tokens": dict.fromkeys(
        ("local", "host", "disk", "remote", "prefill_node_cache", "prefill_node", "computed"), 0)}
