"""FetchCosts: what a fetch of KV from peers costs each decode node, as the router sees it happen.

The router prices sending a request to a node that lacks its prefix with that node's planner: the
prefix fetched from the peers that hold it. A decode node measures its own fetches (link rates, round
trips) but keeps them to itself; the router learns the same from the requests it routed: each finished
request reports how long its node waited for KV from peers (``kv_wait_ms``) and how many tokens came
(``tokens_reused_remote``). What that wait cost beyond moving the bytes at the link rate the router
assumes is the node's fetch overhead: the conversation with the holder, its writes, the landing checks,
and the wait for the node's next step boundary. It starts at the planner's prior and follows every
observation (an exponentially weighted mean), per destination node.

Thread-safe: streams record as they finish, the router reads when it chooses.
"""
from __future__ import annotations

import threading

from kvmesh.node.planner import PRIOR_BYTES_PER_S, PRIOR_RTT_S


class FetchCosts:
    def __init__(self, prior_rtt_s: float = PRIOR_RTT_S, bytes_per_s: float = PRIOR_BYTES_PER_S,
                 weight: float = 0.3):
        """``bytes_per_s``: the link rate the router prices fetches at; ``weight``: a new observation's share."""
        self.prior_rtt_s, self.bytes_per_s, self.weight = prior_rtt_s, bytes_per_s, weight
        self._rtt_s: dict[str, float] = {}
        self._num_samples: dict[str, int] = {}
        self._lock = threading.Lock()

    def record(self, node_id: str, stats, bytes_per_token: int) -> None:
        """A request finished on ``node_id`` with these ``RequestStats`` (its decode node's final account). Only
        fetches from peers alone count: a prefill node's compute or a tier's reads are not a fetch's."""
        tokens = stats.tokens_reused_remote
        if tokens <= 0 or stats.tokens_from_prefill_node > 0 or stats.promote_ms > 0:
            return
        overhead = stats.kv_wait_ms / 1e3 - tokens * bytes_per_token / self.bytes_per_s
        overhead = max(0.0, overhead)
        with self._lock:
            seen = self._num_samples.get(node_id, 0)
            before = self._rtt_s.get(node_id, overhead)  # the first observation replaces the prior
            self._rtt_s[node_id] = before + (overhead - before) * (self.weight if seen else 1.0)
            self._num_samples[node_id] = seen + 1

    def rtt_s(self, node_id: str) -> float:
        """A fetch into ``node_id``'s cost beyond its bytes: the prior until the router has seen one."""
        with self._lock:
            return self._rtt_s.get(node_id, self.prior_rtt_s)

    def describe(self) -> dict[str, dict]:
        with self._lock:
            return {n: {"rtt_ms": self._rtt_s[n] * 1e3, "num_samples": self._num_samples[n]} for n in self._rtt_s}
