"""NodeRuntime: what every kvmesh node process runs, whatever its role, composed of one part per job.

    request endpoint (authenticated ROUTER) ──> handle() ──call_soon──> EngineLoop (the engine's thread)
    TransferAgent: side channel, holder, requester, grants, transfer engine over the pool and KV buffer
    ClusterMembership: etcd store, registry (lease), publisher, global index, node directory

Only the engine thread touches the engine and scheduler; other threads hand it
work with ``call_soon``. The block pool is shared with the transfer agent (it
has its own lock). What a node does with requests lives in its roles
(``prefill_node``, ``decode_node``), which ``cluster/serving_node.py`` composes over
these parts through the hooks below. Construction loads the model
and binds sockets but starts no thread; ``start`` brings the parts up in order
and registers the node.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from kvmesh import lifecycle
from kvmesh.auth import ClusterAuth, require_secret
from kvmesh.gc_pauses import GCPauses, freeze_start_up
from kvmesh.metadata.keys import DEFAULT_CLUSTER  # noqa: F401 (re-exported: NodeConfig's default)
from kvmesh.engine.engine import EngineConfig, EngineHooks, LLMEngine
from kvmesh.engine.scheduler import SchedulerConfig
from kvmesh.engine.sequence import Sequence
from kvmesh.engine.spec_decode.speculator import SpeculativeConfig
from kvmesh.device import device_name, resolve_device
from kvmesh.errors import KvmeshError
from kvmesh.kv.block_hash import BlockHash, HashNamespace
from kvmesh.engine.kv_probe import prompt_kv_sums
from kvmesh.kv.shared_buffer import SharedKVAllocator
from kvmesh.kv.tiers.tiered_cache import TierConfig, TieredCache, auto_host_bytes
from kvmesh.metadata.records import ComputeProbe, KVLayoutRecord, ModelCard, NodeRecord
from kvmesh.model.loader import load_model
from kvmesh.openmp_pool import release_this_threads_pool, serial_this_thread
from kvmesh.node.placement import make_placement
from kvmesh.node import messages as nm
from kvmesh.node.core_share import CoreShare
from kvmesh.node.engine_loop import EngineLoop
from kvmesh.node.landing_bound import PROMPT_SLICE_S, LandingBound
from kvmesh.netaddr import advertise_address
from kvmesh.node.membership import ClusterMembership
from kvmesh.rate_meter import CostFit
from kvmesh.router_endpoint import RouterEndpoint
from kvmesh.tracing import Tracer
from kvmesh.kv.block_checksums import BlockChecksums
from kvmesh.transfer import messages as tm
from kvmesh.transfer.engine import create_transfer_engine
from kvmesh.transfer.errors import TransferRefused
from kvmesh.transfer.holder import ComputeHook
from kvmesh.transfer.kv_agent import TransferAgent
from kvmesh.transfer.kv_checksummer import KVChecksummer
from kvmesh.transfer.peers import FunctionPeers
from kvmesh.wire import MessageError, decode, encode

log = logging.getLogger("kvmesh.node")
PROBE_SHORT_TOKENS, PROBE_LONG_TOKENS = 64, 512  # the start-up probe's two prefill sizes
PROBE_DECODE_STEPS = 3


class ProbeMeasurement(NamedTuple):
    prefill_points: list[tuple[float, float]]  # (prompt tokens, seconds of the prefill step)
    decode_step_s: float  # one decode step of one sequence: about what each request in flight adds to a step


@dataclass(frozen=True)
class NodeConfig:
    node_id: str
    role: str  # "prefill" | "decode"
    etcd: str  # host:port
    cluster: str = DEFAULT_CLUSTER
    model: str = "tiny-llama"
    load_format: str = "auto"  # auto | dummy (model/dummy_weights.py)
    dtype: str = "float32"
    device: str = "cpu"  # auto | cpu | cuda[:N] (kvmesh/device.py)
    kv_transfer_memory: str = "auto"  # direct | host-staging | auto (transfer/kv_memory.py)
    block_size: int = 16
    num_kv_blocks: int = 1024
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    # A prompt's tokens per engine step, at most (0: the step's whole budget; -1: auto, ``prompt_slice``).
    long_prefill_token_threshold: int = -1
    prompt_slice_s: float = PROMPT_SLICE_S  # ... and with -1, the seconds of prompt a step takes beside streams
    host: str = "127.0.0.1"  # where every listener binds (0.0.0.0: all interfaces)
    advertise_host: str = ""  # what peers are told; "": the bind address, or the route to etcd
    transfer_backend: str = "auto"
    shared_memory_transfers: bool = True  # same-host pushes by one copy into a peer's memfd KV buffer
    lease_ttl_s: int = 10
    prefill_timeout_s: float = 10.0
    holder_timeout_s: float = 5.0  # a holder's push of blocks it already has (a decode node's fetch, a prefill node's pull)
    num_landing_slots: int = -1  # one-sided backends: where pushes land before a checked copy (-1: auto)
    kv_placement: str = "cost"  # where uncached KV comes from (kvmesh.node.placement): cost, cost:request, threshold:N
    transfer_gib_per_s: float = 1.0  # assumed by the cost model until it measures transfers
    transfer_rtt_s: float = 0.010  # ... and its fetch overhead beyond the bytes, until it measures fetches
    enable_prefix_caching: bool = True  # off: every prompt is computed in full (a benchmark baseline)
    use_global_pool: bool = True  # off: no lookups in the global index (local caches only, vLLM-style PD)
    host_kv_bytes: int = 0  # tier 1: host memory below the KV buffer (docs/tiers.md); 0: none; -1: sized here
    disk_kv_bytes: int = 0  # tier 2: a file on a local disk; 0: none
    disk_kv_path: str = ""  # its folder ("": a temporary one, removed at exit; a real folder is re-adopted)
    verify_kv: bool = True  # crc32 of lower-tier blocks (promoted, served) and of every pushed block (received)
    speculative: str = "off"  # decode nodes: "ngram" (prompt lookup), "self-draft" or "off"
    num_speculative_tokens: int = 4
    enforce_eager: bool = False  # on CUDA: no CUDA graphs of decode or prompt steps
    core_share: str = ""  # FD:SLOT:CORES of the launcher's CoreTable: compute threads shared with this machine's nodes
    cluster_token: str = field(default="", repr=False)  # authenticates every frame (kvmesh.auth)
    insecure: bool = False  # may bind beyond loopback without a cluster token
    role_changes: bool = False  # the role may change at run time (``--roles auto``): ready to decode whatever its first
    tensor_parallel_size: int = 1  # ranks of this node (kvmesh/parallel): the model split over N processes
    otlp_endpoint: str = ""  # traces of the requests this node serves (kvmesh/tracing.py); "": none
    trace_sample_ratio: float = 1.0


def index_namespace(namespace: HashNamespace) -> str:
    """The key-safe name of a hash namespace in the global index (nodes and routers must agree)."""
    return "m" + hashlib.blake2b(namespace.encode(), digest_size=8).hexdigest()


class NodeRuntime:
    def __init__(self, cfg: NodeConfig):
        self.cfg = cfg
        self.placement = make_placement(cfg.kv_placement)  # which plan a request's uncached KV follows
        require_secret(f"node {cfg.node_id}", [cfg.host], cfg.cluster_token, cfg.insecure)
        self.auth = ClusterAuth(cfg.cluster_token)
        self.advertise_host = advertise_address(cfg.host, cfg.advertise_host, cfg.etcd)
        if not self.auth.enabled:
            log.warning("%s: no cluster token ($KVMESH_CLUSTER_TOKEN / --cluster-token-file): any process that "
                        "reaches this node can submit work and make it write KV", cfg.node_id)
        self.device = resolve_device(cfg.device)
        self.tracer = Tracer(f"kvmesh-{cfg.role}", cfg.otlp_endpoint, cfg.trace_sample_ratio, instance=cfg.node_id)
        self.broken = ""  # why this node can no longer compute (a tensor-parallel rank died): it leaves
        self.ranks = None
        if cfg.tensor_parallel_size > 1:
            self.ranks = self._start_ranks()
            self.loaded = self.ranks.loaded
        else:
            self.loaded = load_model(cfg.model, dtype=cfg.dtype, device=self.device, progress=False,
                                     load_format=cfg.load_format)
        self.shared_kv = SharedKVAllocator() if cfg.shared_memory_transfers else None
        # Steps kept short while a fetch is about to land, so its blocks wait for no long step (the decode role
        # says when one is due; the rates it reads are the node's, set below).
        self.landings = LandingBound(cfg.block_size, self.prompt_step_s, lambda: self.decode_step_s,
                                     lambda: self.prefill_tokens_per_s)
        self.engine = LLMEngine(self.loaded, EngineConfig(
            block_size=cfg.block_size, num_kv_blocks=cfg.num_kv_blocks, track_pool_changes=True,
            enable_prefix_caching=cfg.enable_prefix_caching,
            enforce_eager=cfg.enforce_eager,
            decode_graphs=self.may_decode,  # a prefill node that never decodes: prompt-step graphs only
            speculative=None if cfg.speculative == "off" or not self.may_decode else SpeculativeConfig(
                method=cfg.speculative, num_speculative_tokens=cfg.num_speculative_tokens),
            scheduler=SchedulerConfig(max_num_seqs=cfg.max_num_seqs,
                                      max_num_batched_tokens=cfg.max_num_batched_tokens,
                                      long_prefill_token_threshold=max(cfg.long_prefill_token_threshold, 0))),
            kv_allocator=self.shared_kv, prompt_budget=self.landings,
            hooks=EngineHooks(on_token=self.on_token, on_prefill_step=self._prefill_step_done))
        self.pool = self.engine.pool
        # Seeded by a start-up measurement, then kept current by every step that computes prompt tokens. Nodes
        # sharing this machine's cores measure one at a time, each on all of them (``CoreShare.alone``).
        cores = CoreShare.from_argument(cfg.core_share) if cfg.core_share else None
        with self.engine.unobserved(), cores.alone() if cores is not None else nullcontext():
            probe = self._probe()
        self.prefill_cost = CostFit(probe.prefill_points)
        self.decode_step_s = probe.decode_step_s
        # Engine thread: the events of this step (or of the commands run between two steps) per client connection,
        # sent as one frame at its end.
        self._outbox: dict[bytes, list[bytes]] = {}
        self.num_events_sent = self.num_event_frames = 0
        self.loop = EngineLoop(self.engine, cfg.node_id, self.on_finish, self.on_failed, self._after_step,
                               cores=cores, on_broken=self._break, after_commands=self._send_events)
        self.call_soon = self.loop.call_soon
        self.membership = ClusterMembership(cfg.etcd, cfg.cluster, cfg.node_id,
                                            index_namespace(self.engine.namespace), cfg.lease_ttl_s,
                                            on_peer_left=self._peer_left, on_pin_change=self._pin_changed,
                                            token=cfg.cluster_token)
        kv_buffer = self.engine.runner.kv_buffer
        self.tiers: TieredCache | None = None
        host_kv_bytes = cfg.host_kv_bytes
        if host_kv_bytes < 0:  # sized here: none without a prefix cache (nothing would ever be reused from it)
            kv_bytes = kv_buffer.numel() * kv_buffer.element_size()
            host_kv_bytes = auto_host_bytes(kv_bytes) if cfg.enable_prefix_caching else 0
        tier_cfg = TierConfig(host_kv_bytes, cfg.disk_kv_bytes, cfg.disk_kv_path, cfg.verify_kv)
        # The stored crc32 of cached blocks: the transfer agent's pushes and landings and the lower tiers share it.
        checksummer = KVChecksummer(kv_buffer, cfg.node_id)
        checksums = BlockChecksums(self.pool, checksummer.kv_blocks)
        if tier_cfg.enabled:
            self.tiers = TieredCache(self.pool, kv_buffer, tier_cfg, self.engine.kv.root_hash, name=cfg.node_id,
                                     checksums=checksums, on_index_change=self.loop.wake)  # publish them, even idle
        self.agent = TransferAgent(cfg.node_id, self.pool, kv_buffer,
                                   create_transfer_engine(cfg.transfer_backend, host=cfg.host, auth=self.auth,
                                                          advertise=self.advertise_host),
                                   FunctionPeers(self._peer), self.auth, host=cfg.host,
                                   advertise=self.advertise_host, verify_kv=cfg.verify_kv,
                                   kv_memory=cfg.kv_transfer_memory,
                                   shared_region=self.shared_kv.region if self.shared_kv is not None else None,
                                   shared_writes=cfg.shared_memory_transfers,
                                   num_landing_slots=cfg.num_landing_slots, tracer=self.tracer,
                                   run_on_owner=self.loop.run_as_owner,  # the pool's owner: the engine thread
                                   checksummer=checksummer, checksums=checksums, tiers=self.tiers,
                                   compute=self)  # ComputeAndPush: this node's prefill work, when it has any
        self.gc_pauses = GCPauses()  # installed when serving starts (stats: every collection's pause)
        # (restores from tiers into leases copy with torch: alone on their thread, no OpenMP team of their own)
        self.workers = ThreadPoolExecutor(16, thread_name_prefix=f"kvmesh-{cfg.node_id}",
                                          initializer=serial_this_thread)
        self.endpoint = RouterEndpoint(cfg.host, self._on_request, f"requests-{cfg.node_id}", self.auth,
                                       advertise=self.advertise_host)

    @property
    def may_decode(self) -> bool:
        """The node may serve streams: a decode node, or any node whose role may change (``role_changes``)."""
        return self.cfg.role == "decode" or self.cfg.role_changes

    @property
    def role_name(self) -> str:
        """The role published in the node's record (a node that changes role says so here)."""
        return self.cfg.role

    def prompt_step_s(self) -> float:
        """A step computing this node's usual prompt slice, estimated at its fitted prompt cost."""
        return self.prefill_cost.fixed_s + self.prompt_tokens_per_step() / self.prefill_tokens_per_s

    def prompt_tokens_per_step(self) -> int:
        """The prompt tokens a step computes beside running decodes, at most."""
        scheduler = self.engine.scheduler
        return self.landings.step_tokens or scheduler.prompt_slice_tokens or scheduler.config.max_num_batched_tokens

    def slice_prompts(self, streams_beside: bool) -> None:
        """Engine thread (or before it starts): with ``streams_beside`` (a decode node) and an automatic
        ``long_prefill_token_threshold``, a step beside running decodes computes at most ``prompt_slice`` prompt
        tokens, all prompts together (``LandingBound.step_tokens``); else prompts are sliced as the flag says
        (prefill nodes, with no streams beside their prompts, take whole steps)."""
        cfg = self.cfg
        automatic = cfg.long_prefill_token_threshold < 0 and streams_beside
        self.landings.slice_tokens = 0 if automatic else max(cfg.long_prefill_token_threshold, 0)
        self.landings.cap_steps(cfg.prompt_slice_s if automatic else 0.0, cfg.max_num_batched_tokens)

    def _start_ranks(self):
        """This node's tensor-parallel ranks (the CPU only: its ranks share one KV buffer of every head, the format
        transfers, tiers and probes read)."""
        from kvmesh.parallel.ranks import TensorParallelRanks

        if self.device.type != "cpu":
            raise ValueError(f"--tensor-parallel-size {self.cfg.tensor_parallel_size} on {self.device}: nodes run "
                             f"tensor-parallel on the CPU only so far (the ranks of one node must map one KV buffer)")
        ranks = TensorParallelRanks(self.cfg.model, self.cfg.tensor_parallel_size, dtype=self.cfg.dtype,
                                    device=str(self.device), load_format=self.cfg.load_format, progress=False,
                                    num_threads=torch.get_num_threads())
        ranks.on_rank_lost = self._break
        return ranks

    def _break(self, why: str) -> None:
        """A rank died or a collective failed (any thread): the node cannot compute any more, so it leaves. In a
        node process (``kvmesh node``: SIGTERM is its clean stop) by SIGTERM to itself: it deregisters, tells its
        clients to go elsewhere and exits with status 1. Elsewhere (a Ray actor, whose restart must see a crash)
        it tells its clients the same and ends the process at once."""
        if self.broken:
            return
        self.broken = why
        log.error("%s: %s; this node leaves the cluster", self.cfg.node_id, why)
        if signal.getsignal(signal.SIGTERM) is lifecycle.sigterm_handler():
            os.kill(os.getpid(), signal.SIGTERM)
            return
        try:  # (a node still starting has neither requests nor an endpoint yet)
            self.abandon_requests(why)
            self.endpoint.close()  # what was handed over is delivered (up to a second)
        finally:
            os._exit(1)

    def start(self) -> NodeRuntime:
        """Start the transfer agent, then (after ``before_serving``) the engine thread, the tiers, the request
        endpoint; sync with etcd; register."""
        self.agent.start()
        self.before_serving()
        freeze_start_up()  # the model, the pool, the stacks: never garbage, no longer walked by full collections
        self.gc_pauses.install()
        release_this_threads_pool()  # the start-up computed here; from now on only the engine thread's team runs
        self.loop.start()
        if self.tiers is not None:
            self.tiers.start()
        self.endpoint.start()
        self.membership.start(self.record())
        return self

    def before_serving(self) -> None:
        """Roles' start-up measurements that need the transfer agent; runs on the starting thread, before the
        engine loop (so the engine may be stepped here) and before the node is registered."""

    # ---- identity ------------------------------------------------------------------------------
    def record(self) -> NodeRecord:
        layout = self.engine.layout
        kv_layout = KVLayoutRecord(
            num_blocks=layout.num_blocks, block_size=layout.block_size, num_layers=layout.num_layers,
            bytes_per_block=self.agent.block_bytes, base_addr=self.agent.base_addr,
            transport=self.agent.engine.transport, dtype=str(self.loaded.dtype).removeprefix("torch."),
            device=device_name(self.device), kv_memory=self.agent.memory.mode,
            shared_memory=self.agent.record.shared_memory, landing_addr=self.agent.record.landing_addr,
            num_landing_slots=self.agent.record.num_landing_slots, tp_size=self.cfg.tensor_parallel_size)
        card = ModelCard(self.cfg.model, self.loaded.fingerprint, self.engine.kv.root_hash.hex(),
                         index_namespace(self.engine.namespace))
        disk = self.tiers.read_rates[2].per_s if self.tiers is not None and self.tiers.disk is not None else 0.0
        probe = ComputeProbe(float(self.prefill_tokens_per_s), float(self.decode_step_s), float(disk),
                             self.engine.scheduler.prompt_slice_tokens)
        return NodeRecord(self.cfg.node_id, self.role_name, self.advertise_host, self.agent.engine.endpoint,
                          self.agent.side_channel, self.endpoint.endpoint, kv_layout, card, probe,
                          layout.num_blocks, {"free_blocks": self.pool.num_free_blocks})

    def lookup_holders(self, block_hashes: list[bytes]) -> dict[str, int]:
        """Other nodes holding a prefix of these blocks (empty when the global pool is off)."""
        if not (self.cfg.use_global_pool and self.cfg.enable_prefix_caching):
            return {}
        return self.membership.lookup_holders(block_hashes)

    # ---- ComputeHook (the holder's worker threads): prompts computed for other nodes go to the prefill work ----
    prefill: ComputeHook | None = None  # a subclass's prefill role (``PrefillRole``); None: none taken here

    def admit(self, msg: tm.ComputeAndPush) -> list[BlockHash]:
        if self.prefill is None:
            raise TransferRefused(f"{self.cfg.node_id} does not compute prompts",
                                  code=tm.ErrorCode.NOT_A_PREFILL_NODE.value, request_id=msg.request_id)
        return self.prefill.admit(msg)

    def release(self, request_id: str) -> None:
        if self.prefill is not None:
            self.prefill.release(request_id)

    def num_reused(self, request_id: str) -> int:
        return self.prefill.num_reused(request_id) if self.prefill is not None else 0

    def tail_block(self, request_id: str) -> int | None:
        return self.prefill.tail_block(request_id) if self.prefill is not None else None

    def first_token(self, request_id: str) -> tuple[int, float] | None:
        return self.prefill.first_token(request_id) if self.prefill is not None else None

    def _peer(self, node_id: str):
        """A peer's transfer record from the directory; our own is known without it."""
        return self.agent.record if node_id == self.cfg.node_id else self.membership.peer(node_id)

    def _peer_left(self, node_id: str) -> None:
        self.agent.peer_gone(node_id)

    @property
    def prefill_tokens_per_s(self) -> float:
        """This node's marginal prefill rate: what each more prompt token costs (start-up probe, then fitted to
        real steps). The fixed cost of a step is apart (``prefill_cost.fixed_s``): a request pays it anyway."""
        return self.prefill_cost.per_s

    def _probe(self) -> ProbeMeasurement:
        """Start-up measurement of this node's compute, after a warm-up: a short and a long prefill (the best
        of two each; the two points that seed ``prefill_cost``) and one decode step of one sequence."""
        from kvmesh.engine.sampling_params import SamplingParams

        # Within the context and half the KV buffer (a node may be given a small one).
        room = min(self.engine.max_model_len, self.pool.num_blocks * self.cfg.block_size) // 2
        short = max(1, min(PROBE_SHORT_TOKENS, room // 2))
        sizes = (short, max(short + 1, min(PROBE_LONG_TOKENS, room)))
        best = dict.fromkeys(sizes, float("inf"))
        decode_step_s = float("inf")
        runs = [(short, 1), (short, PROBE_DECODE_STEPS + 1), *zip(sizes * 2, (1,) * 4)]
        for offset, (num_tokens, max_tokens) in enumerate(runs):  # the first run warms up
            seq = self.engine.add_request([(7 * i + offset) % 250 for i in range(num_tokens)],
                                          SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
            start = time.perf_counter()
            while not seq.output_token_ids:  # the prefill (several steps if the token budget chunks it)
                self.engine.step()
            if offset > 1:
                best[num_tokens] = min(best[num_tokens], time.perf_counter() - start)
            while not seq.is_finished:
                start = time.perf_counter()
                self.engine.step()
                decode_step_s = min(decode_step_s, time.perf_counter() - start)
        self.pool.evict(self.pool.num_blocks)  # the probe's blocks are not worth publishing
        self.pool.take_changes()
        self.engine.kv.reset_stats()  # counters start with the first real request
        return ProbeMeasurement(list(best.items()), decode_step_s)

    # ---- engine-thread hooks ---------------------------------------------------------------------------
    def send_event(self, identity: bytes, event: nm.TokenEvent) -> None:
        """Engine thread: queue ``event`` for its connection; every connection's events of a step leave together,
        in order, when the step ends (one sealed frame: the event alone, or a ``TokenBatch``), and those of the
        commands run between two steps (a first token that came with its KV) before the next step starts."""
        self._outbox.setdefault(identity, []).append(encode(event))

    def _send_events(self) -> None:
        """Engine thread: what ``send_event`` queued, one frame per connection."""
        if not self._outbox:
            return
        outbox, self._outbox = self._outbox, {}
        for identity, events in outbox.items():
            self.endpoint.send(identity, events[0] if len(events) == 1 else encode(nm.TokenBatch(events)))
            self.num_events_sent += len(events)
            self.num_event_frames += 1

    def _after_step(self) -> None:
        self._send_events()
        publisher = self.membership.publisher
        if publisher is None:  # not registered yet: the changes wait for the first publication
            return
        cached, evicted = self.pool.take_changes()
        if cached:  # pushes waiting for these blocks (a prefill node's conversations) move on
            self.agent.holder.blocks_cached()
        if self.tiers is None:
            publisher.publish(cached)
            publisher.unpublish(evicted)
        else:  # a block evicted from tier 0 may live on below it: publish the tier that holds it now
            publisher.update(self.tiers.take_index_changes(cached + evicted))

    def _on_request(self, identity: bytes, payload: bytes) -> None:
        try:
            msg = decode(payload, nm.REQUESTS)
        except MessageError as e:
            log.warning("%s: refused a malformed request: %s", self.cfg.node_id, e)
            self.endpoint.send(identity, encode(nm.TokenEvent("", [], finished=True, error=f"malformed: {e}",
                                                              error_kind=nm.ERROR_INVALID)))
            return
        if isinstance(msg, nm.StatsRequest):
            if msg.check or msg.kv_probe:  # integrity checks and KV reads need the engine between steps
                self.call_soon(lambda: self.endpoint.send(identity, encode(self._stats(msg.check, msg.kv_probe))))
            else:  # answered here, at once: a liveness ping must not wait for a long engine step
                try:
                    reply = self._stats(False)
                except RuntimeError:  # a counter dict grew while we read it: read it between steps instead
                    self.call_soon(lambda: self.endpoint.send(identity, encode(self._stats(False))))
                    return
                self.endpoint.send(identity, encode(reply))
            return
        self.handle(identity, msg)

    def _pin_changed(self, kind: str, prefix_id: str, record) -> None:
        """A pin was put or deleted in etcd (mirror thread): apply it on the engine thread."""
        def apply() -> None:
            if kind == "delete":
                self.engine.unpin_prefix(prefix_id)
                return
            try:
                pin = self.engine.pin_prefix(record.token_ids)
            except KvmeshError as e:
                log.warning("%s: cannot pin %s: %s", self.cfg.node_id, prefix_id, e)
                return
            if pin.prefix_id != prefix_id:  # the router hashed with another namespace: never pin by a wrong id
                self.engine.unpin_prefix(pin.prefix_id)
                log.warning("%s: pin %s does not match its tokens here (%s)", self.cfg.node_id, prefix_id,
                            pin.prefix_id)

        self.call_soon(apply)

    def _stats(self, check: bool, kv_probe: list[int] | None = None) -> nm.StatsReply:
        """Counters (read without stopping the engine: each is a plain int or a short snapshot); ``check``
        runs the integrity checks too and ``kv_probe`` reads that prompt's cached KV: both on the engine thread."""
        error = ""
        if check:
            try:
                self.engine.check_integrity()
                self.agent.grants.check_integrity()
                if self.tiers is not None:
                    self.tiers.check_integrity()
            except AssertionError as e:
                error = f"integrity: {e}"
        usage = self.pool.usage()
        stats = {**self.engine.kv.stats_dict(), "bytes_received": self.agent.bytes_received,
                 "bytes_sent": self.agent.bytes_sent, "bytes_sent_shared_memory": self.agent.bytes_sent_shared_memory,
                 "num_used_blocks": usage.num_used, "num_kv_blocks": self.pool.num_blocks,
                 "max_num_seqs": self.engine.scheduler.config.max_num_seqs,
                 "num_cached_blocks": usage.num_cached, "num_pinned": usage.num_pinned,
                 "num_running": len(self.engine.scheduler.running), "prefill_tokens_per_s": self.prefill_tokens_per_s,
                 "prompt_tokens_per_step": self.landings.step_tokens or self.engine.scheduler.prompt_slice_tokens,
                 "num_unauthenticated": self.endpoint.num_refused + self.agent.num_unauthenticated,
                 "num_transfers_refused": sum(self.agent.holder.num_refused.values()),
                 "num_refused_writes": self.agent.grants.num_refused_writes,
                 "num_quarantined_blocks": self.agent.grants.num_quarantined_blocks,
                 "num_quarantined_total": self.agent.grants.num_quarantined_total,
                 "num_pending_pushes": self.agent.holder.num_pending,
                 "num_checksum_failures": self.agent.requester.num_checksum_failures,
                 "num_blocks_landed_early": self.agent.requester.num_blocks_landed_early,
                 "num_fenced_landing_slots": self.agent.grants.num_fenced_slots,
                 "index_revision": self.membership.index.mirror.revision if self.membership.index else 0,
                 "landing": self.agent.landing.describe() if self.agent.landing is not None else {},
                 "block_checksums": self.agent.checksums.describe(),
                 "device": device_name(self.device), "kv_memory": self.agent.memory.describe(),
                 "num_failed_steps": self.loop.num_failed_steps, "compute_threads": self.loop.compute_threads,
                 "decode_thread_choices": self.loop.decode_thread_choices(),
                 "decode_steps_by_threads": self.loop.decode_steps(),
                 **self.loop.clock.stats(),
                 "num_events_sent": self.num_events_sent, "num_event_frames": self.num_event_frames,
                 **self.gc_pauses.stats(),
                 **self.role_stats(),
                 **(self.tiers.stats() if self.tiers is not None else {}),
                 "pinned_prefixes": {pin_id: list(counts) for pin_id, counts in self.engine.pins.status().items()},
                 **(self.engine.speculator.stats() if self.engine.speculator is not None else {})}
        load = nm.NodeLoadStats.from_stats({"role": self.role_name, **stats})
        if kv_probe:
            stats["kv_probe"] = prompt_kv_sums(self.engine, kv_probe)
        return nm.StatsReply(self.cfg.node_id, stats, error, load)

    # ---- role hooks -----------------------------------------------------------------------------------
    def handle(self, identity: bytes, msg) -> None:
        self.endpoint.send(identity, encode(nm.TokenEvent(getattr(msg, "request_id", ""), [], finished=True,
                                                          error=f"{self.role_name} node does not take {msg.TYPE}",
                                                          error_kind=nm.ERROR_INVALID)))

    def _prefill_step_done(self, num_tokens: int, seconds: float) -> None:
        """Engine thread: a step that computed prompt tokens keeps the fitted prompt cost current (and with it a
        decode node's step cap, ``LandingBound.step_tokens``)."""
        self.prefill_cost.record(num_tokens, seconds)

    def on_token(self, seq: Sequence, token_id: int) -> None:
        pass

    def on_finish(self, seq: Sequence) -> None:
        pass

    def on_failed(self, seq: Sequence, error: str) -> None:
        """Engine thread: ``seq`` failed in a broken step (already FAILED and freed)."""

    def role_stats(self) -> dict:
        return {}

    def abandon_requests(self, why: str) -> None:
        """The node is broken and stopping (its engine loop stopped): tell clients their requests must run
        elsewhere."""

    # ---- life ---------------------------------------------------------------------------------------------
    def announce(self) -> None:
        """One JSON line on stdout for launchers: the node is registered and serving."""
        print(json.dumps({"node_id": self.cfg.node_id, "role": self.role_name, "requests": self.endpoint.endpoint,
                          "side_channel": self.agent.side_channel, "transport": self.agent.engine.transport}),
              flush=True)

    def serve_forever(self) -> None:
        self.announce()
        try:
            for line in sys.stdin:  # a launcher closes stdin (or writes "quit") to stop the node
                if line.strip() == "quit":
                    break
        except KeyboardInterrupt:
            pass
        self.close()

    def close(self) -> None:
        self.gc_pauses.uninstall()
        self.loop.close()
        self.membership.close()
        if self.broken:
            self.abandon_requests(self.broken)
        self.endpoint.close()
        self.agent.close()
        if self.shared_kv is not None:
            self.shared_kv.close()
        if self.tiers is not None:
            self.tiers.close()
        self.workers.shutdown(wait=False, cancel_futures=True)
        if self.ranks is not None:
            self.ranks.close()
        self.tracer.close()
