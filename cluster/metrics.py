"""Prometheus metrics of the router: latencies, outcomes, cache reuse, per-node load and transfers."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from kvmesh.gc_pauses import num_frozen
from kvmesh.node.messages import PROMPT_TOKEN_SOURCES

# A request's prompt tokens by where their KV came from: the decode node's stats key -> the source label.
PROMPT_SOURCES = tuple(zip(PROMPT_TOKEN_SOURCES, ("local", "host", "disk", "remote", "prefill_node_cache",
                                                  "prefill_node", "computed"), strict=True))
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class RouterMetrics:
    def __init__(self, node_stats=None, readiness=None, role_moves=None, scale_actions=None):
        """``node_stats()`` -> {node_id: (``NodeLoadStats``, fetch round trip s)}, read at scrape time (per-node load,
        hit rates, bytes);
        ``readiness()`` -> (ready, detail) as ``Router.readiness`` (process states under a supervisor);
        ``role_moves``: the role balancer's moves by the role moved to (``--roles auto``), read at scrape time;
        ``scale_actions``: nodes added and removed (``--max-nodes`` on Ray), likewise."""
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvmesh_requests", "Requests by outcome", ["outcome"], registry=r)
        self.ttft = Histogram("kvmesh_ttft_seconds", "Time to first token", buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("kvmesh_tpot_seconds", "Time per output token after the first",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("kvmesh_queue_seconds", "Time from arrival to a node being chosen",
                               buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("kvmesh_e2e_seconds", "End-to-end request latency", buckets=_LATENCY_BUCKETS,
                             registry=r)
        self.prompt_tokens = Counter("kvmesh_prompt_tokens", "Prompt tokens by where their KV came from",
                                     ["source"], registry=r)
        self.spec_tokens = Counter("kvmesh_spec_tokens", "Speculative decoding: guessed tokens verified, and kept",
                                   ["outcome"], registry=r)
        self.migrations = Counter("kvmesh_migrations", "Streams moved to another decode node", registry=r)
        self.in_flight = Gauge("kvmesh_in_flight", "Requests in flight through this router", registry=r)
        Gauge("kvmesh_router_gc_frozen_objects", "Objects this router process froze out of the garbage collector's "
              "full walks at start-up (kvmesh/gc_pauses.py)", registry=r).set_function(num_frozen)
        if node_stats is not None:
            r.register(_NodeCollector(node_stats))
        if role_moves is not None:
            moves = Gauge("kvmesh_role_changes", "Nodes the role balancer moved, by the role they took", ["to"],
                          registry=r)
            for role in ("prefill", "decode"):
                moves.labels(role).set_function(lambda role=role: role_moves[role])
        if scale_actions is not None:
            scaled = Gauge("kvmesh_nodes_scaled", "Nodes the role balancer added or removed (--max-nodes)",
                           ["action"], registry=r)
            for action in ("add", "remove"):
                scaled.labels(action).set_function(lambda action=action: scale_actions[action])
        if readiness is not None:
            r.register(_ReadinessCollector(readiness))

    def record_finished(self, stats) -> None:
        """A request finished with these ``RequestStats`` (its decode node's account)."""
        self.requests.labels("ok").inc()
        for key, source in PROMPT_SOURCES:
            self.prompt_tokens.labels(source).inc(getattr(stats, key))
        if stats.spec_draft_tokens:
            self.spec_tokens.labels("drafted").inc(stats.spec_draft_tokens)
            self.spec_tokens.labels("accepted").inc(stats.spec_accepted_tokens)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _NodeCollector:
    def __init__(self, node_stats):
        self._node_stats = node_stats

    def collect(self):
        gauges = {
            "num_running": GaugeMetricFamily("kvmesh_node_running", "Requests running on the node", labels=["node"]),
            "hit_rate": GaugeMetricFamily("kvmesh_node_hit_rate", "Local prefix-cache hit rate", labels=["node"]),
            "bytes_received": GaugeMetricFamily("kvmesh_node_bytes_received", "KV bytes received from peers",
                                                labels=["node"]),
            "bytes_sent": GaugeMetricFamily("kvmesh_node_bytes_sent", "KV bytes pushed to peers", labels=["node"]),
            "num_cached_blocks": GaugeMetricFamily("kvmesh_node_cached_blocks", "Cached free blocks",
                                                   labels=["node"]),
            "num_used_blocks": GaugeMetricFamily("kvmesh_node_used_blocks", "KV blocks held by running requests",
                                                 labels=["node"]),
            "num_kv_blocks": GaugeMetricFamily("kvmesh_node_kv_blocks", "KV blocks of the node's buffer",
                                               labels=["node"]),
            "bytes_sent_shared_memory": GaugeMetricFamily(
                "kvmesh_node_bytes_sent_shared_memory", "KV bytes pushed to peers on the same host through shared "
                "memory (the rest of kvmesh_node_bytes_sent went through the transfer engine)", labels=["node"]),
            "tier_host_blocks": GaugeMetricFamily("kvmesh_node_host_tier_blocks", "KV blocks in the host tier",
                                                  labels=["node"]),
            "num_steps_bounded_for_landings": GaugeMetricFamily(
                "kvmesh_node_steps_bounded_for_landings", "Engine steps kept short because a fetch was about to land "
                "(kvmesh/node/landing_bound.py)", labels=["node"]),
            "fetch_rtt_s": GaugeMetricFamily("kvmesh_node_fetch_rtt_seconds", "What a fetch into the node costs beyond "
                                             "its bytes, as the router measured it", labels=["node"]),
        }
        gc_pause = GaugeMetricFamily("kvmesh_node_gc_max_pause_seconds", "Longest garbage-collector pause of the "
                                     "node's process since it began serving, per generation (2: full collections)",
                                     labels=["node", "generation"])
        engine_share = GaugeMetricFamily("kvmesh_node_engine_step_share", "Share of the engine thread's step time "
                                         "on a core, runnable but waiting for one, or asleep (the GIL, compute "
                                         "threads' ends) since the node started", labels=["node", "part"])
        decode_steps = GaugeMetricFamily("kvmesh_node_decode_steps", "Decode-only steps since the node started, by "
                                         "the compute threads they ran on (kvmesh/node/decode_threads.py)",
                                         labels=["node", "threads"])
        decode_seconds = GaugeMetricFamily("kvmesh_node_decode_step_seconds", "Wall seconds of the decode-only steps "
                                           "in kvmesh_node_decode_steps", labels=["node", "threads"])
        role = GaugeMetricFamily("kvmesh_node_role", "1 for the role the node takes now (prefill, decode, draining: on "
                                 "its way from decode to prefill)", labels=["node", "role"])
        for node_id, (load, fetch_rtt_s) in self._node_stats().items():
            if load.role:
                role.add_metric([node_id, load.role], 1.0)
            for key, family in gauges.items():
                family.add_metric([node_id], fetch_rtt_s if key == "fetch_rtt_s" else float(getattr(load, key)))
            if load.engine_on_cpu_share + load.engine_runnable_share + load.engine_asleep_share > 0:
                for part in ("on_cpu", "runnable", "asleep"):
                    engine_share.add_metric([node_id, part], getattr(load, f"engine_{part}_share"))
            for generation, pause_ms in enumerate(load.gc_max_pause_ms):
                gc_pause.add_metric([node_id, str(generation)], float(pause_ms) / 1e3)
            for threads, (num_steps, seconds) in load.decode_steps_by_threads.items():
                decode_steps.add_metric([node_id, threads], float(num_steps))
                decode_seconds.add_metric([node_id, threads], float(seconds))
        yield from gauges.values()
        yield gc_pause
        yield decode_steps
        yield decode_seconds
        yield engine_share
        yield role


class _ReadinessCollector:
    """kvmesh_ready, kvmesh_degraded, and per supervised process kvmesh_process_up / _restarts."""

    def __init__(self, readiness):
        self._readiness = readiness

    def collect(self):
        ready, detail = self._readiness()
        yield GaugeMetricFamily("kvmesh_ready", "1 while a decode node can take requests", value=float(ready))
        supervisor = detail.get("supervisor")
        if supervisor is None:
            return
        yield GaugeMetricFamily("kvmesh_degraded", "1 while a supervised process is not up",
                                value=float(supervisor["degraded"]))
        up = GaugeMetricFamily("kvmesh_process_up", "Supervised process is up", labels=["process", "role"])
        restarts = GaugeMetricFamily("kvmesh_process_restarts", "Restarts of a supervised process",
                                     labels=["process", "role"])
        for name, p in supervisor["nodes"].items():
            up.add_metric([name, p["role"]], float(p["state"] == "up"))
            restarts.add_metric([name, p["role"]], float(p["restarts"]))
        yield up
        yield restarts
