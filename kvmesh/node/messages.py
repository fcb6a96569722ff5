"""Node request messages (client/router <-> decode nodes), via ``kvmesh.wire``; sealed by ``kvmesh.auth``."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import ClassVar

from kvmesh.engine.sampling_params import SamplingParams, from_wire
from kvmesh.tracing import check_trace_context
from kvmesh.wire import MessageError, decode, register, register_record


@dataclass(frozen=True)
class GenerateRequest:
    """Client -> decode node: generate for these prompt tokens, stream the tokens back."""

    TYPE: ClassVar[str] = "generate"
    request_id: str
    prompt_token_ids: list[int]
    sampling: dict = field(default_factory=dict)  # SamplingParams fields
    trace_context: str = ""  # the caller's span (W3C traceparent: kvmesh/tracing.py); "": not traced

    def validate(self) -> None:
        if not self.request_id:
            raise MessageError("generate: empty request_id")
        check_trace_context("generate", self.trace_context)

    def sampling_params(self) -> SamplingParams:
        return from_wire(self.sampling)


ERROR_INVALID = "invalid"  # the request cannot be served as asked (the client's fault)
ERROR_INTERNAL = "internal"  # the node failed it
ERROR_NODE_LOST = "node-lost"  # the node is leaving (it cannot compute any more): run the request elsewhere
ERROR_KINDS = ("", ERROR_INVALID, ERROR_INTERNAL, ERROR_NODE_LOST)


PROMPT_TOKEN_SOURCES = ("tokens_reused_local", "tokens_reused_host", "tokens_reused_disk", "tokens_reused_remote",
                        "tokens_reused_prefill_node", "tokens_from_prefill_node", "tokens_computed")
REUSED_SOURCES = PROMPT_TOKEN_SOURCES[:5]  # KV reused from a cache (any tier, any node) rather than computed


@dataclass(frozen=True)
class RequestStats:
    """A finished request's account, in its decode node's final ``TokenEvent``: where each prompt token's KV came
    from (each token counted once: this node's KV buffer, host or disk tier, a peer's cache, a prefill node's cache,
    a prefill node's compute, computed here), the fetch's times, speculative decoding."""

    tokens_reused_local: int = 0
    tokens_reused_host: int = 0
    tokens_reused_disk: int = 0
    tokens_reused_remote: int = 0
    tokens_reused_prefill_node: int = 0
    tokens_from_prefill_node: int = 0
    tokens_computed: int = 0
    kv_wait_ms: float = 0.0  # from the fetch's start to its blocks joining the engine (a step boundary)
    fetch_ms: float = 0.0  # ... of which the fetch thread's own time
    promote_ms: float = 0.0  # reads from this node's lower tiers
    spec_draft_tokens: int = 0  # speculative decoding: guesses verified ...
    spec_accepted_tokens: int = 0  # ... and kept

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens whose KV was reused from any cache (OpenAI's ``cached_tokens``)."""
        return sum(getattr(self, key) for key in REUSED_SOURCES)

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class TokenEvent:
    """Decode node -> client: new tokens; the last event has ``finished`` (and stats, or an error).
    ``error_kind`` says whose fault an error is: ``ERROR_INVALID`` the request's (a client error), else the
    node's (``ERROR_INTERNAL``; ``ERROR_NODE_LOST``: the node is leaving, the request may run elsewhere)."""

    TYPE: ClassVar[str] = "tokens"
    request_id: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str = ""
    error: str = ""
    error_kind: str = ""
    stats: RequestStats | None = None  # the last event's (a finished request's account)
    logprobs: list[float] = field(default_factory=list)  # per token of token_ids, when asked for
    top_token_ids: list[int] = field(default_factory=list)  # k alternatives per token, flattened
    top_logprobs: list[float] = field(default_factory=list)

    def validate(self) -> None:
        if self.logprobs and len(self.logprobs) != len(self.token_ids):
            raise MessageError("tokens: one logprob per token")
        if self.error_kind not in ERROR_KINDS or bool(self.error_kind) != bool(self.error):
            raise MessageError(f"tokens: error kind {self.error_kind!r} with error {self.error!r}")
        if len(self.top_token_ids) != len(self.top_logprobs):
            raise MessageError("tokens: top_token_ids and top_logprobs differ in length")


@dataclass(frozen=True)
class AbortRequest:
    """Client/router -> decode node: the caller went away; stop the request and free its blocks."""

    TYPE: ClassVar[str] = "abort_request"
    request_id: str

    def validate(self) -> None:
        pass


@dataclass(frozen=True)
class StatsRequest:
    """Anyone -> node: counters; with ``check``, also run every integrity check; with ``kv_probe``, also the
    fingerprint of that prompt's cached KV (a debug call: tests and benchmarks compare it with a reference)."""

    TYPE: ClassVar[str] = "stats"
    check: bool = False
    kv_probe: list[int] = field(default_factory=list)  # a prompt: its cached KV's fingerprint (engine/kv_probe.py)

    def validate(self) -> None:
        pass


@dataclass(frozen=True)
class NodeLoadStats:
    """What the router's machinery reads of a node (routing status, the role balancer, /metrics), typed; the
    reply's ``stats`` dict holds every counter for people and tests. Counters since the node started."""

    role: str = ""  # prefill | decode | draining
    num_running: int = 0
    max_num_seqs: int = 0
    num_used_blocks: int = 0  # KV blocks held by running requests
    num_cached_blocks: int = 0  # cached and free
    num_kv_blocks: int = 0
    hit_rate: float = 0.0  # its local prefix cache's
    prefill_queue_s: float = 0.0  # its prefill role's accepted prompt tokens still to compute, at its rate
    prompt_queue_s: float = 0.0  # its engine's admitted prompt tokens still to compute, at its rate
    engine_decode_step_s: float = 0.0  # decode-only steps: their time ...
    engine_decode_steps: int = 0  # ... and number
    prompt_tokens_computed: int = 0  # its finished streams' prompt tokens it computed itself ...
    prompt_tokens_total: int = 0  # ... of all of theirs
    prompt_tokens_always_here: int = 0  # ... and each prompt's tail, which no other node could compute
    tier_host_blocks: int = 0
    bytes_received: int = 0
    bytes_sent: int = 0
    bytes_sent_shared_memory: int = 0
    num_steps_bounded_for_landings: int = 0
    transfer_gib_per_s_measured: float = 0.0
    rtt_ms_measured: float = 0.0
    engine_on_cpu_share: float = 0.0  # of its engine thread's step time
    engine_runnable_share: float = 0.0
    engine_asleep_share: float = 0.0
    gc_max_pause_ms: list[float] = field(default_factory=list)  # per collector generation
    pinned_prefixes: dict = field(default_factory=dict)  # pin id -> [blocks pinned here, blocks of the pin]
    # compute threads (str) -> [decode-only steps on them, their wall seconds]
    decode_steps_by_threads: dict = field(default_factory=dict)

    OPTIONAL = ("tier_host_blocks", "engine_on_cpu_share", "engine_runnable_share", "engine_asleep_share")

    @classmethod
    def from_stats(cls, stats: dict) -> NodeLoadStats:
        """The record from a node's counters (``OPTIONAL`` ones absent where the node has no such part: no host
        tier, no step timed yet)."""
        return cls(**{f.name: stats[f.name] for f in fields(cls) if f.name in stats})


@dataclass(frozen=True)
class StatsReply:
    TYPE: ClassVar[str] = "stats_reply"
    node_id: str
    stats: dict = field(default_factory=dict)
    error: str = ""
    load: NodeLoadStats | None = None  # what the router reads (None from a reply that failed)

    def validate(self) -> None:
        pass


@dataclass(frozen=True)
class TokenBatch:
    """Decode node -> client: one step's TokenEvents for the requests of one connection, in order, each encoded
    as it would be sent alone (one frame and one seal per step, not one per token per request)."""

    TYPE: ClassVar[str] = "token_batch"
    events: list[bytes]

    def validate(self) -> None:
        if not self.events:
            raise MessageError("token_batch: no events")

    def unpack(self) -> list[TokenEvent]:
        """The events, each decoded and validated (a MessageError for any malformed one)."""
        return [decode(event, (TokenEvent,)) for event in self.events]


@dataclass(frozen=True)
class SetRole:
    """Router (its role balancer) or an operator -> node: take ``role`` ("prefill" or "decode"). A decode node
    that becomes a prefill node first stops taking streams; those still running after ``drain_timeout_s`` are
    handed back to the router (ERROR_NODE_LOST: they continue on another decode node)."""

    TYPE: ClassVar[str] = "set_role"
    request_id: str
    role: str
    drain_timeout_s: float = 30.0

    def validate(self) -> None:
        if not self.request_id:
            raise MessageError("set_role: empty request_id")
        if self.role not in ("prefill", "decode"):
            raise MessageError(f"set_role: role {self.role!r} is not prefill or decode")
        if not self.drain_timeout_s >= 0:
            raise MessageError("set_role: drain_timeout_s must be >= 0")


@dataclass(frozen=True)
class RoleReply:
    """Node -> caller of SetRole: the role it has or is moving to (``state``: prefill, decode, or draining: on
    its way from decode to prefill); ``error`` when the change was refused (another one in progress)."""

    TYPE: ClassVar[str] = "role_reply"
    finished: ClassVar[bool] = True  # one answer per SetRole
    request_id: str
    node_id: str
    state: str
    error: str = ""

    def validate(self) -> None:
        if self.state not in ("prefill", "decode", "draining"):
            raise MessageError(f"role_reply: unknown state {self.state!r}")


register_record(RequestStats, NodeLoadStats)
register(GenerateRequest, TokenEvent, TokenBatch, AbortRequest, StatsRequest, StatsReply, SetRole, RoleReply)
REQUESTS = (GenerateRequest, AbortRequest, StatsRequest, SetRole)
