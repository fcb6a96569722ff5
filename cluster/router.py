"""Router: the mechanism behind the gRPC and HTTP front ends.

Validates and tokenizes a request, hashes the prompt's chain, asks the routing
policy for a decode node (with the index mirror's view of who caches what), and
streams that node's TokenEvents back as ``Chunk``s with text deltas. Bounded:
past ``max_in_flight`` concurrent requests it raises ``Overloaded`` (HTTP 429 /
RESOURCE_EXHAUSTED); bad input raises ``InvalidRequestError`` (400 / INVALID_ARGUMENT).
"""
from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from kvmesh.detokenizer import IncrementalDetokenizer
from kvmesh.cluster.role_balancer import BalancerConfig, RoleBalancer
from kvmesh.cluster.role_controller import NodeSupply, RoleController
from kvmesh.cluster.scale_policy import ScaleConfig, ScalePolicy
from kvmesh.cluster.fetch_costs import FetchCosts
from kvmesh.cluster.metrics import RouterMetrics
from kvmesh.cluster.node_connection import NodeConnection, NodeLost
from kvmesh.cluster.recent_requests import RecentRequests
from kvmesh.cluster.routing import Candidate, make_policy
from kvmesh.engine.sampling_params import SamplingParams, first_stop, stop_prefix_len, to_wire
from kvmesh.errors import InvalidRequestError, KvmeshError
from kvmesh.kv.block_hash import hash_blocks, salted_root
from kvmesh.kv.prefix_hasher import PrefixHasher
from kvmesh.metadata.block_index import BlockIndex
from kvmesh.metadata.pins import PinRegistry
from kvmesh.metadata.records import ModelCard, PinRecord
from kvmesh.metadata.sealed_store import open_store
from kvmesh.metadata.registry import NodeDirectory
from kvmesh.auth import ClusterAuth
from kvmesh.model.card import load_tokenizer
from kvmesh.node import messages as nm
from kvmesh.node.planner import HolderOption
from kvmesh.tracing import NO_SPAN, Tracer


log = logging.getLogger("kvmesh.router")


class Overloaded(KvmeshError, RuntimeError):
    """Too many requests in flight: retry later."""


@dataclass(frozen=True)
class RouterConfig:
    etcd: str
    model: str = "tiny-llama"
    cluster: str = "kvmesh"
    routing: str = "cache-aware"
    block_size: int = 16
    dtype: str = "float32"
    max_in_flight: int = 256
    max_in_flight_per_client: int = 0  # one client (API key, else address) at most this many (0: half the above)
    request_timeout_s: float = 300.0
    liveness_s: float = 3.0  # a decode node silent this long (and deaf to a ping) is lost
    cluster_token: str = field(default="", repr=False)  # seals every frame to the nodes (kvmesh.auth)
    max_migrations: int = 5  # a stream moves to another decode node at most this often
    wait_for_nodes_s: float = 60.0  # the model's fingerprint and hash namespace come from the first node
    migration_wait_s: float = 15.0  # with no decode node left, wait this long for one (a restart) to appear
    otlp_endpoint: str = ""  # traces of requests (kvmesh/tracing.py); "": none
    trace_sample_ratio: float = 1.0
    roles: str = "fixed"  # auto: the router moves nodes between prefill and decode as the load shifts
    min_prefill: int = 0  # --roles auto keeps at least this many prefill nodes
    min_decode: int = 1  # ... and decode nodes
    ttft_slo_ms: float = 2000.0  # the SLOs the role balancer weighs prefill and decode pressure against
    tpot_slo_ms: float = 100.0
    role_interval_s: float = 2.0  # between the balancer's looks at the cluster
    role_cooldown_s: float = 30.0  # after a role change, before the next
    max_nodes: int = 0  # with a node supply (Ray) and --roles auto: grow up to this many nodes, shrink when idle


class RequestTimeout(KvmeshError, TimeoutError):
    """A decode node sent nothing for ``request_timeout_s``: the stream ends with this error."""


class Route(NamedTuple):
    node_id: str
    uncached_tokens: int  # of the prompt, as the index saw the node when it was chosen


class _Queued:
    """One request's share of a node's queued prompt tokens, released once (first token, end or move)."""

    def __init__(self, queues: dict[str, dict[int, int]], lock: threading.Lock):
        self._queues, self._lock = queues, lock
        self._node, self._tokens = "", 0

    def add(self, node_id: str, tokens: int) -> None:
        self.release()
        if tokens <= 0:
            return
        with self._lock:
            self._queues.setdefault(node_id, {})[id(self)] = tokens
        self._node, self._tokens = node_id, tokens

    def release(self) -> None:
        if self._tokens:
            with self._lock:
                shares = self._queues.get(self._node, {})
                shares.pop(id(self), None)
                if not shares:
                    self._queues.pop(self._node, None)
            self._tokens = 0


@dataclass
class _StreamState:
    """What a client has been sent so far (survives a migration to another node)."""

    num_prompt: int
    detokenizer: IncrementalDetokenizer
    tokens: list[int] = field(default_factory=list)
    held: str = ""  # settled text not sent yet: it could begin a stop string (a stop string always starts here)
    first_token_at: float | None = None
    cut_by_stop_string: bool = False  # the router ended the stream; the node must be told


@dataclass
class Chunk:
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str = ""
    node_id: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cache: nm.RequestStats = field(default_factory=nm.RequestStats)  # the last chunk's: where its prompt's KV came from
    logprobs: list[float] = field(default_factory=list)  # per token of token_ids, when asked for
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # alternatives per token


class Router:
    def __init__(self, cfg: RouterConfig, supply: NodeSupply | None = None):
        """``supply``: where nodes come from (``RayCluster``): with ``cfg.max_nodes`` and ``--roles auto`` the
        router adds and removes nodes as well as moving them between roles."""
        self.cfg = cfg
        self._auth = ClusterAuth(cfg.cluster_token)
        card = load_tokenizer(cfg.model)  # config and tokenizer only: a router never loads weights
        self.model_name = cfg.model
        self.tokenizer = card.tokenizer
        self.vocab_size = card.config.vocab_size
        self.max_model_len = card.config.max_position_embeddings
        self.store = open_store(cfg.etcd, cfg.cluster_token)
        self.directory = NodeDirectory(self.store, cfg.cluster)
        self.directory.mirror.wait_healthy(10)
        card_of_nodes = self._learn_model_card(cfg.wait_for_nodes_s)
        self.fingerprint = card_of_nodes.fingerprint
        self.root_hash = bytes.fromhex(card_of_nodes.root_hash)
        self.index = BlockIndex(self.store, cfg.cluster, card_of_nodes.index_namespace)
        self.pin_registry = PinRegistry(self.store, cfg.cluster, card_of_nodes.index_namespace)
        self.refused_nodes: set[str] = set()  # registered, but serving other weights
        self.policy = make_policy(cfg.routing)
        self.hasher = PrefixHasher(cfg.block_size)  # a prompt repeating a recent prefix is compared, not rehashed
        self._connections: dict[str, NodeConnection] = {}
        self._lock = threading.Lock()
        self._in_flight = 0
        self._in_flight_by_client: Counter[str] = Counter()
        self._queued: dict[str, dict[int, int]] = {}  # node -> each request's uncached tokens awaiting a first token
        self.fetch_costs = FetchCosts()  # what fetches into each decode node have cost, end to end
        self.recent = RecentRequests()  # the last minute's finished requests by prompt-token source
        self._ids = itertools.count()
        self.num_migrations = 0
        self.supervision: Callable[[], dict] | None = None  # set by launchers that restart dead processes
        self.closed = threading.Event()  # set by close(): helpers that follow the router stop
        self.roles: RoleController | None = None
        if cfg.roles == "auto":
            balancer = RoleBalancer(BalancerConfig(
                ttft_slo_s=cfg.ttft_slo_ms / 1e3, tpot_slo_s=cfg.tpot_slo_ms / 1e3, cooldown_s=cfg.role_cooldown_s,
                min_prefill=cfg.min_prefill, min_decode=cfg.min_decode))
            scaler = ScalePolicy(ScaleConfig(
                max_nodes=cfg.max_nodes, cooldown_s=cfg.role_cooldown_s, min_prefill=cfg.min_prefill,
                min_decode=cfg.min_decode)) if supply is not None and cfg.max_nodes > 0 else None
            self.roles = RoleController(balancer, self.status, self._set_role, cfg.role_interval_s, scaler=scaler,
                                        supply=supply)
        elif cfg.roles != "fixed":
            raise ValueError(f"roles {cfg.roles!r}: fixed or auto")
        self.metrics = RouterMetrics(self._node_metrics, self.readiness,
                                     role_moves=self.roles.moves if self.roles is not None else None,
                                     scale_actions=self.roles.scaled if self.roles is not None and
                                     self.roles.scaler is not None else None)
        self.tracer = Tracer("kvmesh-router", cfg.otlp_endpoint, cfg.trace_sample_ratio)
        self.index.mirror.wait_healthy(10)
        if self.roles is not None:
            self.roles.start()

    # ---- requests ----------------------------------------------------------------------------------
    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def check_token_ids(self, prompt_ids: list[int]) -> None:
        """InvalidRequestError unless ``prompt_ids`` is a non-empty list of token ids of this model."""
        if not prompt_ids:
            raise InvalidRequestError("the prompt is empty")
        bad = [t for t in prompt_ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(f"token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        self.check_token_ids(prompt_ids)
        if len(prompt_ids) + params.max_tokens > self.max_model_len:
            raise InvalidRequestError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) "
                                      f"exceeds the context of {self.max_model_len}")

    def generate(self, prompt_ids: list[int], params: SamplingParams, session_id: str = "",
                 client: str = "") -> Iterator[Chunk]:
        """Stream a completion. Raises InvalidRequestError / Overloaded before the first chunk.

        If the decode node dies mid-stream, the prompt plus the tokens streamed so far go
        to another decode node and the stream goes on: no token is repeated or skipped
        (identical output for greedy requests). Closing the iterator early aborts the
        request on its node, which frees its blocks.
        """
        arrived = time.perf_counter()
        try:
            self.validate(prompt_ids, params)
        except InvalidRequestError:
            self.metrics.requests.labels("invalid").inc()
            raise
        per_client = self.cfg.max_in_flight_per_client or max(1, self.cfg.max_in_flight // 2)
        with self._lock:
            if self._in_flight >= self.cfg.max_in_flight:
                self.metrics.requests.labels("overloaded").inc()
                raise Overloaded(f"{self._in_flight} requests in flight (limit {self.cfg.max_in_flight})")
            if self._in_flight_by_client[client] >= per_client:
                self.metrics.requests.labels("overloaded").inc()
                raise Overloaded(f"this client has {self._in_flight_by_client[client]} requests in flight "
                                 f"(limit {per_client} per client)")
            self._in_flight += 1
            self._in_flight_by_client[client] += 1
        self.metrics.in_flight.inc()
        state = _StreamState(len(prompt_ids), IncrementalDetokenizer(self.tokenizer))
        lost: set[tuple[str, str]] = set()  # (node id, request endpoint): a restarted node is a new incarnation
        conn, rid = None, ""
        queued = _Queued(self._queued, self._lock)
        span = self.tracer.start("request", None, {"kvmesh.prompt_tokens": len(prompt_ids),
                                                   "kvmesh.max_tokens": params.max_tokens})
        try:
            while True:
                context = list(prompt_ids) + state.tokens
                route = self.tracer.start("route", span)
                node_id, uncached = self._choose_node_waiting(context, session_id, lost, params.cache_salt) \
                    if lost else self._choose_node(context, session_id, cache_salt=params.cache_salt, span=route)
                route.end()
                queued.add(node_id, uncached)
                if not lost:
                    self.metrics.queue.observe(time.perf_counter() - arrived)
                conn = self._connection(node_id)
                rid = f"r{next(self._ids)}-{uuid.uuid4().hex[:8]}"
                remaining = replace(params, max_tokens=params.max_tokens - len(state.tokens))
                events = conn.submit(nm.GenerateRequest(rid, context, to_wire(remaining), trace_context=span.context))
                try:
                    for chunk in self._stream(events, node_id, state, params.stop):
                        if chunk.token_ids:
                            queued.release()
                        if state.first_token_at is None and chunk.token_ids:
                            state.first_token_at = time.perf_counter()
                            self.metrics.ttft.observe(state.first_token_at - arrived)
                            span.add_event("first_token", {"kvmesh.node": node_id})
                        if chunk.finished:
                            self._record_finished(chunk, state, arrived)
                            span.set_attributes({"kvmesh.completion_tokens": len(state.tokens),
                                                 "kvmesh.finish_reason": chunk.finish_reason or ""})
                        yield chunk
                    if not state.cut_by_stop_string:
                        conn = None  # the node finished: nothing to abort
                    return
                except NodeLost as e:
                    lost.add((node_id, conn.endpoint))
                    conn = None  # its node is gone: nothing to abort there
                    span.add_event("migrated", {"kvmesh.node_lost": node_id, "kvmesh.why": str(e)})
                    if len(lost) > self.cfg.max_migrations:
                        raise KvmeshError(f"the stream lost {len(lost)} decode nodes; giving up") from None
                    self.num_migrations += 1
                    self.metrics.migrations.inc()
        except KvmeshError as e:
            self.metrics.requests.labels("error").inc()
            span.record_error(str(e))
            raise
        finally:
            queued.release()
            if conn is not None:
                conn.abort(rid)
            self.metrics.in_flight.dec()
            with self._lock:
                self._in_flight -= 1
                self._in_flight_by_client[client] -= 1
                if self._in_flight_by_client[client] <= 0:
                    del self._in_flight_by_client[client]
            span.end()  # last: the router's own accounting never depends on the tracer

    def _record_finished(self, chunk: Chunk, state: _StreamState, arrived: float) -> None:
        now = time.perf_counter()
        self.metrics.e2e.observe(now - arrived)
        if state.first_token_at is not None and len(state.tokens) > 1:
            self.metrics.tpot.observe((now - state.first_token_at) / (len(state.tokens) - 1))
        self.metrics.record_finished(chunk.cache)
        self.recent.record(chunk.cache)
        record = self.directory.nodes.get(chunk.node_id)
        if record is not None and record.kv_layout.bytes_per_block > 0:
            self.fetch_costs.record(chunk.node_id, chunk.cache, record.kv_layout.bytes_per_block // self.cfg.block_size)

    def _stream(self, events, node_id: str, state: _StreamState, stop: tuple[str, ...] = ()) -> Iterator[Chunk]:
        """TokenEvents -> Chunks with text deltas; a stop string ends the text (and the stream) where it starts.

        Text that could be the start of a stop string is held back until the next tokens rule that out, so no
        part of a stop string is ever sent; a node silent for ``request_timeout_s`` ends the stream with
        ``RequestTimeout`` (the caller aborts the request on the node)."""
        while True:
            try:
                event = events.get(timeout=self.cfg.request_timeout_s)
            except queue.Empty:
                raise RequestTimeout(f"decode node {node_id} sent nothing for {self.cfg.request_timeout_s:g} s; "
                                     f"the request was aborted") from None
            if isinstance(event, NodeLost):
                raise event
            if event.error_kind == nm.ERROR_NODE_LOST:  # the node is leaving: the stream migrates
                raise NodeLost(f"decode node {node_id}: {event.error}")
            if event.error:
                raise (InvalidRequestError if event.error_kind == nm.ERROR_INVALID
                       else KvmeshError)(f"decode node {node_id}: {event.error}")
            state.tokens += event.token_ids
            logprobs = list(event.logprobs)
            k = len(event.top_token_ids) // len(event.token_ids) if event.token_ids else 0
            tops = [list(zip(event.top_token_ids[i * k:(i + 1) * k], event.top_logprobs[i * k:(i + 1) * k]))
                    for i in range(len(event.token_ids))] if logprobs else []
            # Only the text not yet sent is looked at: per token, work bounded by the stop strings, not the output.
            state.held += state.detokenizer.update(state.tokens, final=event.finished)
            cut = first_stop(state.held, stop)
            if cut >= 0:
                state.cut_by_stop_string = True
                yield Chunk(event.token_ids, state.held[:cut], True, "stop", node_id, state.num_prompt,
                            len(state.tokens), event.stats or nm.RequestStats(), logprobs, tops)
                return
            if event.finished:
                sendable = len(state.held)
            else:  # (the detokenizer settles no incomplete UTF-8 sequence before the stream's end)
                sendable = len(state.held) - stop_prefix_len(state.held, stop)
            delta, state.held = state.held[:sendable], state.held[sendable:]
            if event.finished:
                yield Chunk(event.token_ids, delta, True, event.finish_reason, node_id, state.num_prompt,
                            len(state.tokens), event.stats or nm.RequestStats(), logprobs, tops)
                return
            if event.token_ids or delta:
                yield Chunk(event.token_ids, delta, node_id=node_id, logprobs=logprobs, top_logprobs=tops)

    def _learn_model_card(self, timeout_s: float) -> ModelCard:
        """Fingerprint, hash root and index namespace of ``cfg.model`` as its nodes publish them."""
        deadline = time.monotonic() + timeout_s
        while True:
            cards = [r.model for r in self.directory.nodes.values()
                     if r.model.model == self.cfg.model and r.model.root_hash]
            if cards:
                fingerprints = Counter(c.fingerprint for c in cards)
                if len(fingerprints) > 1:
                    log.warning("nodes serving %s disagree on its weights %s: routing to the most common",
                                self.cfg.model, dict(fingerprints))
                chosen = fingerprints.most_common(1)[0][0]
                return next(c for c in cards if c.fingerprint == chosen)
            if time.monotonic() > deadline:
                served = sorted({r.model.model or "?" for r in self.directory.nodes.values()})
                raise KvmeshError(f"no node of cluster {self.cfg.cluster!r} serves {self.cfg.model!r} within "
                                  f"{timeout_s:.0f} s" + (f" (it serves {', '.join(served)})" if served else ""))
            time.sleep(0.1)

    def _serves_our_model(self, node_id: str, record) -> bool:
        """Nodes with other weights (another fingerprint) are refused: their KV and tokens would be wrong."""
        if record.model.fingerprint == self.fingerprint:
            return True
        if node_id not in self.refused_nodes:
            self.refused_nodes.add(node_id)
            log.warning("refusing node %s: it serves %s (fingerprint %s), not %s (%s)", node_id,
                        record.model.model, record.model.fingerprint, self.cfg.model,
                        self.fingerprint)
        return False

    def _choose_node_waiting(self, prompt_ids: list[int], session_id: str, lost: set[tuple[str, str]],
                             cache_salt: str | None = None) -> Route:
        """After a node was lost: a decode node not lost yet, waiting up to ``migration_wait_s`` for one to
        (re)appear; raises KvmeshError naming the lost nodes when none does."""
        deadline = time.monotonic() + self.cfg.migration_wait_s
        while True:
            try:
                return self._choose_node(prompt_ids, session_id, lost, cache_salt)
            except KvmeshError:
                if time.monotonic() >= deadline:
                    raise
            time.sleep(0.1)

    def _choose_node(self, prompt_ids: list[int], session_id: str, exclude: set[tuple[str, str]] = frozenset(),
                     cache_salt: str | None = None, span=NO_SPAN) -> Route:
        """The decode node for this prompt (``span``: the routing span, given the choice and the candidates)."""
        decode_nodes = {n: r for n, r in self.directory.nodes.items()
                        if r.role == "decode" and (n, r.request_endpoint) not in exclude
                        and self._serves_our_model(n, r)}
        if not decode_nodes:
            lost = sorted({n for n, _ in exclude})
            raise KvmeshError("no decode node is available" + (f" ({', '.join(lost)} lost)" if lost else ""))
        hashes = self.hasher.hash(salted_root(self.root_hash, cache_salt), prompt_ids)
        held = self.index.lookup(hashes) if hashes else {}
        with self._lock:
            queued = {n: tuple(q.values()) for n, q in self._queued.items()}
        candidates = [Candidate(n, held.get(n, 0) * self.cfg.block_size,
                                self._connections[n].num_open if n in self._connections else 0, len(prompt_ids),
                                queued.get(n, ()), r.probe.prefill_tokens_per_s, r.probe.decode_step_s,
                                tuple(HolderOption(m, blocks, self.fetch_costs.bytes_per_s, self.fetch_costs.rtt_s(n))
                                      for m, blocks in held.items() if m != n and blocks > held.get(n, 0)),
                                self.cfg.block_size, r.kv_layout.bytes_per_block, r.probe.prompt_tokens_per_step)
                      for n, r in sorted(decode_nodes.items())]
        chosen_id = self.policy.choose(candidates, session_id)
        chosen = next(c for c in candidates if c.node_id == chosen_id)
        if span is not NO_SPAN:
            span.set_attributes({"kvmesh.node": chosen_id, "kvmesh.routing": self.cfg.routing,
                                 "kvmesh.cached_tokens": chosen.cached_tokens,
                                 "kvmesh.candidates": [f"{c.node_id}: {c.cached_tokens} tokens cached, {c.load} in "
                                                       f"flight, {len(c.holders)} holders, predicted TTFT "
                                                       f"{c.predicted_ttft_s() * 1e3:.1f} ms" for c in candidates]})
        return Route(chosen.node_id, max(0, len(prompt_ids) - chosen.cached_tokens))

    def _connection(self, node_id: str) -> NodeConnection:
        """The connection to a node's current endpoint (a restarted node registers a new one)."""
        endpoint = self.directory.nodes[node_id].request_endpoint
        with self._lock:
            conn = self._connections.get(node_id)
            if conn is not None and conn.endpoint != endpoint:
                conn.close()
                conn = None
            if conn is None:
                conn = self._connections[node_id] = NodeConnection(node_id, endpoint, self.cfg.liveness_s,
                                                                             self._auth)
            return conn

    def _set_role(self, node_id: str, role: str, drain_timeout_s: float):
        """The role balancer's move: ``nm.SetRole`` to ``node_id``; its answer (None: none, or not registered)."""
        if node_id not in self.directory.nodes:
            return None
        return self._connection(node_id).set_role(role, drain_timeout_s)

    # ---- status ----------------------------------------------------------------------------------------
    def readiness(self) -> tuple[bool, dict]:
        """Ready while at least one decode node is registered (and, under a supervisor, up)."""
        decode = sorted(n for n, r in self.directory.nodes.items()
                        if r.role == "decode" and self._serves_our_model(n, r))
        detail: dict = {"decode_nodes": decode, "refused_nodes": sorted(self.refused_nodes)}
        up = decode
        if self.supervision is not None:
            status = self.supervision()
            detail["supervisor"] = status
            up = [n for n in decode if status["nodes"].get(n, {}).get("state", "up") == "up"]
            detail["degraded"] = status["degraded"]
        detail["ready"] = bool(up)
        return bool(up), detail

    def status(self) -> list[dict]:
        """Every registered node: ``load`` (its ``NodeLoadStats``, None when it did not answer), ``stats`` (every
        counter, for people) and, under a supervisor, ``process`` (its process state)."""
        processes = self.supervision()["nodes"] if self.supervision is not None else {}
        out = []
        for node_id, record in sorted(self.directory.nodes.items()):
            conn = self._connection(node_id)
            reply = conn.stats(timeout_s=2.0)
            out.append({"node_id": node_id, "role": record.role, "requests": record.request_endpoint,
                        "in_flight": conn.num_open, "stats": dict(reply.stats) if reply else {},
                        "load": reply.load if reply else None,
                        **({"process": processes[node_id]} if node_id in processes else {})})
        return out

    def _node_metrics(self) -> dict[str, tuple[nm.NodeLoadStats, float]]:
        """Each answering node's load with the fetch cost the router measured into it."""
        return {entry["node_id"]: (entry["load"], self.fetch_costs.rtt_s(entry["node_id"]))
                for entry in self.status() if entry["load"] is not None}

    def cluster_view(self) -> dict:
        """What ``kvmesh status`` shows: every node's role, load, KV use, hit rate and links, the router's load,
        and the last minute's requests by prompt-token source."""
        costs = self.fetch_costs.describe()
        nodes = []
        for entry in self.status():
            load, record = entry["load"] or nm.NodeLoadStats(), self.directory.nodes.get(entry["node_id"])
            nodes.append({
                "node_id": entry["node_id"], "role": entry["role"], "answering": entry["load"] is not None,
                "in_flight": entry["in_flight"], "running": load.num_running,
                "kv_blocks_used": load.num_used_blocks, "kv_blocks_cached": load.num_cached_blocks,
                "kv_blocks": record.kv_layout.num_blocks if record is not None else 0,
                "hit_rate": load.hit_rate, "host_tier_blocks": load.tier_host_blocks,
                "transfer_gib_per_s": load.transfer_gib_per_s_measured, "rtt_ms": load.rtt_ms_measured,
                "fetch_rtt_ms": costs.get(entry["node_id"], {}).get("rtt_ms"),
                **({"process": entry["process"]} if "process" in entry else {})})
        with self._lock:
            in_flight = self._in_flight
        return {"model": self.cfg.model, "cluster": self.cfg.cluster, "in_flight": in_flight,
                "max_in_flight": self.cfg.max_in_flight, "recent": self.recent.totals(), "nodes": nodes}

    # ---- pinned prefixes ---------------------------------------------------------------------------
    def pin(self, prompt_ids: list[int], label: str = "") -> dict:
        """Pin a prefix on every node, now and later (etcd-backed); returns its id and size in blocks.

        Raises InvalidRequestError for bad tokens or a prefix shorter than one block."""
        self.check_token_ids(prompt_ids)
        if len(prompt_ids) >= self.max_model_len:
            raise InvalidRequestError(f"the prefix has {len(prompt_ids)} tokens; the context is {self.max_model_len}")
        hashes = hash_blocks(self.root_hash, prompt_ids, self.cfg.block_size)
        if not hashes:
            raise InvalidRequestError(f"a pinned prefix needs at least {self.cfg.block_size} tokens (one full "
                                      f"block), got {len(prompt_ids)}")
        pin_id = hashes[-1].hex()
        num_tokens = len(hashes) * self.cfg.block_size
        # The store itself, not the mirror: a pin made a moment ago counts against the cap.
        pinned = {p: len(r.token_ids) // self.cfg.block_size for p, r in self.pin_registry.read().items()}
        pinned[pin_id] = len(hashes)
        limit = self.max_pinned_blocks()
        if sum(pinned.values()) > limit:
            raise InvalidRequestError(f"pinning {len(hashes)} more blocks would pin {sum(pinned.values())} blocks: "
                                      f"at most {limit} (a quarter of the smallest decode node's KV blocks)")
        self.pin_registry.put(pin_id, PinRecord(list(prompt_ids[:num_tokens]), label, time.time()))
        return {"id": pin_id, "num_blocks": len(hashes), "num_tokens": num_tokens, "label": label}

    def unpin(self, pin_id: str) -> bool:
        """False when no such pin exists (asked of the store: a pin made a moment ago is there)."""
        if pin_id not in self.pin_registry.read():
            return False
        self.pin_registry.delete(pin_id)
        return True

    def max_pinned_blocks(self) -> int:
        """Pins may hold at most a quarter of the smallest decode node's KV blocks (all pins together)."""
        sizes = [r.kv_layout.num_blocks for r in self.directory.nodes.values() if r.role == "decode"]
        return min(sizes, default=0) // 4

    def pins(self) -> list[dict]:
        """Every pin, with how many of its blocks each node holds pinned right now."""
        held = {n["node_id"]: n["load"].pinned_prefixes for n in self.status() if n["load"] is not None}
        out = []
        for pin_id, record in sorted(self.pin_registry.read().items()):
            num_blocks = len(record.token_ids) // self.cfg.block_size
            out.append({"id": pin_id, "label": record.label, "num_blocks": num_blocks,
                        "num_tokens": len(record.token_ids), "pinned_at": record.pinned_at,
                        "nodes": {node: held[node][pin_id][0] for node in held if pin_id in held[node]}})
        return out

    def close(self) -> None:
        self.closed.set()
        if self.roles is not None:
            self.roles.close()
        for conn in self._connections.values():
            conn.close()
        self.pin_registry.close()
        self.index.close()
        self.directory.close()
        self.store.close()
        self.tracer.close()
