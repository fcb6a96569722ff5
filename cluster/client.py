"""NodeClient: send GenerateRequests to a decode node and collect the streamed tokens (tests, benchmarks)."""
from __future__ import annotations

import queue
import time
import uuid
from dataclasses import dataclass, field

from kvmesh.auth import ClusterAuth
from kvmesh.cluster.node_connection import NodeConnection, NodeLost
from kvmesh.engine.sampling_params import SamplingParams, to_wire
from kvmesh.errors import KvmeshError
from kvmesh.node import messages as nm


class RequestFailed(KvmeshError, RuntimeError):
    pass


@dataclass
class Completion:
    request_id: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    error: str = ""
    stats: nm.RequestStats = field(default_factory=nm.RequestStats)  # where the prompt's KV came from (when finished)
    ttft_s: float = 0.0
    latency_s: float = 0.0


class NodeClient:
    """Generate requests to one node, many in flight at once, over a NodeConnection."""

    def __init__(self, endpoint: str, liveness_s: float = 3.0, auth: ClusterAuth | None = None):
        self.endpoint = endpoint
        self._conn = NodeConnection(endpoint, endpoint, liveness_s, auth)

    def generate_many(self, prompts: list[list[int]], params: SamplingParams, timeout_s: float = 120.0,
                      liveness_s: float | None = None) -> list[Completion]:
        """Send every prompt, collect every stream; raises RequestFailed when the node goes quiet.

        After ``liveness_s`` without a message the node is pinged; no answer within another
        ``liveness_s`` means it is gone (requests are not migrated here: the router does that).
        """
        if liveness_s is not None:
            self._conn.liveness_s = liveness_s
        start = time.perf_counter()
        events: queue.Queue = queue.Queue()
        completions = {}
        for prompt in prompts:
            rid = uuid.uuid4().hex
            completions[rid] = Completion(rid)
            self._conn.submit(nm.GenerateRequest(rid, list(prompt), to_wire(params)), events)
        pending = set(completions)
        deadline = time.monotonic() + timeout_s
        while pending:
            try:
                event = events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise RequestFailed(f"{len(pending)} of {len(prompts)} requests unfinished after {timeout_s} s "
                                    f"(decode node {self.endpoint})") from None
            if isinstance(event, NodeLost):
                raise RequestFailed(f"decode node {self.endpoint} stopped answering; {len(pending)} of "
                                    f"{len(prompts)} requests lost with it")
            c = completions[event.request_id]
            if event.token_ids and not c.token_ids:
                c.ttft_s = time.perf_counter() - start
            c.token_ids += event.token_ids
            if event.finished:
                c.finish_reason, c.error = event.finish_reason, event.error
                c.stats = event.stats or nm.RequestStats()
                c.latency_s = time.perf_counter() - start
                pending.discard(event.request_id)
        return list(completions.values())

    def generate(self, prompt: list[int], params: SamplingParams, **kwargs) -> Completion:
        return self.generate_many([prompt], params, **kwargs)[0]

    def stats(self, check: bool = False, timeout_s: float = 10.0, kv_probe: list[int] | None = None) -> dict:
        """The node's counters; ``check``: after its integrity checks (a failed one raises); ``kv_probe``: with
        that prompt's cached-KV fingerprint under "kv_probe" (``kvmesh/engine/kv_probe.py``)."""
        reply = self._conn.stats(check, timeout_s, kv_probe)
        if reply is None:
            raise RequestFailed(f"no stats from {self.endpoint}")
        if reply.error:
            raise RequestFailed(f"{reply.node_id}: {reply.error}")
        return reply.stats

    def load(self, timeout_s: float = 10.0) -> nm.NodeLoadStats:
        """What the router reads of the node (``NodeLoadStats``)."""
        reply = self._conn.stats(False, timeout_s)
        if reply is None or reply.load is None:
            raise RequestFailed(f"no load from {self.endpoint}")
        return reply.load

    def set_role(self, role: str, drain_timeout_s: float = 30.0, timeout_s: float = 10.0) -> nm.RoleReply:
        """Ask the node to take ``role`` (``kvmesh/node/roles.py``); raises RequestFailed when it does not answer
        or refuses (another change in progress)."""
        reply = self._conn.set_role(role, drain_timeout_s, timeout_s)
        if reply is None:
            raise RequestFailed(f"no answer to set_role from {self.endpoint}")
        if reply.error:
            raise RequestFailed(f"{reply.node_id}: {reply.error}")
        return reply

    def submit(self, request: nm.GenerateRequest) -> queue.Queue:
        """Send one request as it is; its TokenEvents (or a NodeLost) arrive on the returned queue."""
        return self._conn.submit(request)

    def close(self) -> None:
        self._conn.close()
