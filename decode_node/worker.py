"""DecodeRole: a node's streams (``kvmesh decode-node``, or any node while it takes the decode role). A request
walks admit -> plan -> execute -> arrived:

1. **admit** (engine thread): validate, allocate, find this node's own prefix hits;
2. **plan** (engine thread, ``planner.py``): unless the rest is cheaper to compute than any round trip,
   read the in-memory index mirror for holders and price every source: this node's lower tiers,
   each holder over its measured link, the best prefill node (``prefill_nodes.py``), computing here;
3. **execute**: a local plan joins the scheduler at once; one that only promotes from this node's
   lower tiers does so on the engine thread; one that needs peers gets a ``KVLease`` of its blocks
   (``KVLoads``, ``kvmesh/engine/kv_connector.py``) and runs on a worker thread (``fetcher.py``): the
   connectors (``connectors.py``, ``prefill_nodes.py``) write into the lease's block ids, a holder's push
   and a prefill node's conversation at the same time;
4. **arrived** (engine thread, between two steps): ``KVLoads`` swaps blocks a stalled writer may still
   write for fresh ones and hands the request to the scheduler, which computes what is missing (the
   prompt's last block unless a prefill node sent it, and then at least the last token, unless the
   request is greedy and the prefill node's pick after the prompt came with it: streamed at once as its
   first token) and decodes with continuous batching, streaming tokens back; the outcome says where each
   block came from (the request's accounting). A failed or timed-out transfer only means more local work.

An abort from the caller propagates to every writer of the request; the request's blocks are freed
once its fetch has returned.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from kvmesh.node.connectors import HolderConnector, TierConnector
from kvmesh.decode_node.cost_model import SHARED_MEMORY, PeerLinks, TransferRateEstimator
from kvmesh.decode_node.fetcher import Fetcher, FetchOutcome
from kvmesh.decode_node.link_probe import probe_shared_memory_round_trip
from kvmesh.node.planner import FetchPlan, PlanRequest, prompt_tokens_ahead
from kvmesh.decode_node.prefill_nodes import PrefillNodes
from kvmesh.engine.kv_connector import KVLoads
from kvmesh.engine.sequence import Sequence
from kvmesh.errors import InvalidRequestError, KvmeshError
from kvmesh.kv.block_pool import NO_BLOCK
from kvmesh.node import messages as nm
from kvmesh.tracing import NO_SPAN
from kvmesh.wire import encode

log = logging.getLogger("kvmesh.decode")

@dataclass(slots=True)
class _ClientRequest:
    """What the decode node keeps about one caller's request until it ends."""

    identity: bytes  # the caller's ZMQ identity, for streaming
    seq: Sequence
    fetch_started: float = 0.0  # when peers were asked for its KV
    abort_after_fetch: bool = False  # the caller went away while peers were writing its blocks
    tokens_from_peers: int = 0  # reused from other nodes' caches
    tokens_from_prefill: int = 0  # pushed by a prefill node, which computed them
    tokens_reused_prefill: int = 0  # pushed by a prefill node from its cache (reused, not computed)
    tokens_from_host: int = 0  # promoted from this node's host-memory tier
    tokens_from_disk: int = 0  # ... and from its disk tier
    promote_s: float = 0.0
    promoted_in_place: bool = False  # promoted at admission: the scheduler counts those tokens as prefix hits
    tier0_hit_tokens: int = 0  # ... beyond these, which were in tier 0 already
    kv_wait_s: float = 0.0  # from the fetch's start to its blocks joining the engine (a step boundary)
    fetch_s: float = 0.0  # ... of which the fetch thread's own time
    span: object = NO_SPAN  # the request's trace span here (kvmesh/tracing.py), and its fetch's
    fetch_span: object = NO_SPAN


class DecodeRole:
    name = "decode"

    def __init__(self, node):
        """``node``: the ``NodeRuntime`` whose engine, pool, tiers, membership and transfer agent this role uses."""
        self.node = node
        cfg = self.cfg = node.cfg
        self.engine, self.pool, self.agent, self.tiers = node.engine, node.pool, node.agent, node.tiers
        self.membership, self.tracer, self.placement = node.membership, node.tracer, node.placement
        self.workers, self.call_soon = node.workers, node.call_soon
        self.accepting = True  # takes new streams (off while the node is not a decode node)
        self._requests: dict[str, _ClientRequest] = {}  # engine thread only
        self._lock = threading.Lock()
        self.num_remote = 0
        self.num_local = 0
        self.num_aborted = 0
        self.num_handed_back = 0  # streams ended here for the router to continue elsewhere (a role change)
        self.num_prompt_tokens_always_here = 0  # of finished prompts, the tails only this node could compute
        # Where every finished request's prompt tokens came from, each token counted once (engine thread only).
        # Keys fixed up front, so the stats thread can read it while the engine thread adds.
        self.prompt_token_sources: Counter[str] = Counter(dict.fromkeys(nm.PROMPT_TOKEN_SOURCES, 0))
        self.rates = TransferRateEstimator(self.cfg.transfer_gib_per_s * 2**30, self.cfg.transfer_rtt_s)
        self.links = PeerLinks(self.rates, self.membership, self.agent.shared_region, self.agent.block_bytes)
        self.prefill_nodes = PrefillNodes(cfg.node_id, self.membership, self.agent.requester, self.links,
                                          cfg.block_size, cfg.transfer_rtt_s, cfg.prefill_timeout_s)
        # Prefill conversations run beside the fetch that waits for them (never in its pool: no deadlock).
        self._conversations = ThreadPoolExecutor(16, thread_name_prefix=f"kvmesh-{cfg.node_id}-prefill")
        # The connectors: this node's lower tiers, peers holding a prefix, prefill nodes (``prefill_nodes``).
        self.tier_connector = TierConnector(self.tiers)
        self.holders = HolderConnector(self.agent.requester, self.links, self.membership, cfg.holder_timeout_s)
        self.fetcher = Fetcher(self.tier_connector, self.holders, self.prefill_nodes, self._conversations,
                               cfg.block_size)
        self.loads = KVLoads(self.engine, self.call_soon, self._kv_arrived)
        self.landings = node.landings  # the scheduler's steps kept short while a fetch is about to land

    def before_serving(self) -> None:
        """Seed the shared-memory link's round trip (``link_probe.py``); network links keep ``--transfer-rtt-ms``."""
        if self.agent.shared_region is None or self.agent.shared_writer is None or not self.cfg.enable_prefix_caching:
            return
        with self.engine.unobserved():  # its prompt is no client's, its step no measure of serving
            probe_s = probe_shared_memory_round_trip(self.cfg.node_id, self.engine, self.agent)
        if probe_s is not None:
            self.rates.seed_round_trip(probe_s + self.node.decode_step_s / 2, SHARED_MEMORY)
            log.info("%s: shared-memory fetch round trip %.2f ms (probe %.2f ms + half a decode step)",
                     self.cfg.node_id, self.rates.rtt_s_for(SHARED_MEMORY) * 1e3, probe_s * 1e3)

    # ---- admission (engine thread) ------------------------------------------------------------------
    def handle(self, identity: bytes, msg) -> bool:
        """A caller's request or abort (request endpoint's thread); False: not this role's message."""
        if isinstance(msg, nm.GenerateRequest):
            self.call_soon(lambda: self._admit(identity, msg))
        elif isinstance(msg, nm.AbortRequest):
            self.call_soon(lambda: self._abort(msg.request_id))
        else:
            return False
        return True

    def _plan(self, seq: Sequence, num_local: int, end: int, local_queue_s: float, num_streams: int,
              lookup: bool) -> tuple[FetchPlan, dict[str, int]]:
        """Where blocks [num_local, end) come from, and the index hits it was planned with (engine thread).

        ``num_streams``: sequences running here, each held up while this node computes the prompt's blocks.
        ``lookup``: read the index mirror for holders (else only this node's lower tiers are considered)."""
        bs, hashes = self.cfg.block_size, seq.block_hashes[:end]
        lower = self.tier_connector.offer(hashes, num_local)
        hits = self.node.lookup_holders(hashes) if lookup else {}
        holders = self.holders.offers(hashes, hits, num_local + lower.num_blocks)
        start = num_local + lower.num_blocks
        held_end = max([start, *(min(h.end, end) for h in holders)])
        prefill = None
        if lookup:
            prefill = (self.prefill_nodes.best((end - held_end) * bs, hits) if self.placement.prices_prefill_nodes
                       else self.prefill_nodes.any_option(hits))
        request = PlanRequest(num_local, end, bs, self.engine.layout.bytes_per_token, self.node.prefill_tokens_per_s,
                              local_queue_s, lower.num_blocks, lower.seconds, holders, prefill, num_streams,
                              self.node.landings.step_tokens, self._decode_step_s(),
                              tail_tokens=max(0, seq.num_prompt_tokens - 1 - end * bs))
        return self.placement.plan(request), hits

    def _decode_step_s(self) -> float:
        """A decode-only step here: the measured mean, the start-up probe's until one was measured."""
        clock = self.node.loop.clock
        return clock.decode_wall_s / clock.num_decode_steps if clock.num_decode_steps else self.node.decode_step_s

    def _spread_s_per_token(self, num_streams: int) -> float:
        """With streams here and this node's steps beside them capped (``LandingBound.step_tokens``), the prompts
        queued here spread over steps that each also decode those streams: per prompt token, a decode step over
        the cap."""
        cap = self.node.landings.step_tokens
        return self._decode_step_s() / cap if num_streams and cap > 0 else 0.0

    def _streams_here(self) -> int:
        """Sequences running here (engine thread): each one's steps wait for the prompt tokens computed here, a
        decoding stream's next token and a prompt's first alike (prompts queued behind go after it anyway)."""
        return len(self.engine.scheduler.running)

    def _prompt_tokens_ahead(self, own_tokens: int) -> int:
        """Prompt tokens computed here before a new prompt of ``own_tokens`` is (engine thread): those admitted
        and not yet computed, each prompt's share bounded where this node slices prompts (``prompt_tokens_ahead``)."""
        slice_tokens = self.engine.scheduler.prompt_slice_tokens
        return prompt_tokens_ahead(self._queued_prompt_tokens(), slice_tokens, own_tokens)

    def _queued_prompt_tokens(self) -> list[int]:
        """Each admitted request's prompt tokens not computed yet (over copies of the scheduler's lists: the stats
        thread reads it too, a gauge that may miss a request moving meanwhile)."""
        scheduler = self.engine.scheduler
        return [seq.num_prompt_tokens - seq.num_computed_tokens
                for seq in (*tuple(scheduler.waiting), *tuple(scheduler.kv_landed), *tuple(scheduler.running))
                if seq.num_prompt_tokens > seq.num_computed_tokens]

    def _admit(self, identity: bytes, msg: nm.GenerateRequest) -> None:
        rid = msg.request_id
        if not self.accepting:  # the node changed role: the router sends the request elsewhere
            self._send_error(identity, rid, f"{self.cfg.node_id} no longer takes streams (it is a prefill node now)",
                             nm.ERROR_NODE_LOST)
            return
        if rid in self._requests:
            self._send_error(identity, rid, f"request id {rid!r} is already in use", nm.ERROR_INTERNAL)
            return
        try:
            seq = self.engine.prepare_request(msg.prompt_token_ids, msg.sampling_params(), request_id=rid)
        except Exception as e:  # any refusal must reach the caller, never leave it waiting
            invalid = isinstance(e, (InvalidRequestError, ValueError, TypeError))
            error = str(e) if invalid or isinstance(e, KvmeshError) else f"{type(e).__name__}: {e}"
            self._send_error(identity, rid, error, nm.ERROR_INVALID if invalid else nm.ERROR_INTERNAL)
            return
        request = self._requests[rid] = _ClientRequest(identity, seq)
        request.span = self.tracer.start("decode.request", msg.trace_context, {
            "kvmesh.node": self.cfg.node_id, "kvmesh.prompt_tokens": seq.num_prompt_tokens})
        num_local = len(self.engine.kv.find_cached_prefix(seq))
        bs = self.cfg.block_size
        end = (seq.num_prompt_tokens - 1) // bs  # the last token is always computed here
        uncached = seq.num_prompt_tokens - num_local * bs
        num_streams = self._streams_here()
        local_queue_s = self._prompt_tokens_ahead(uncached) * (1.0 / self.node.prefill_tokens_per_s +
                                                              self._spread_s_per_token(num_streams))
        lookup = self.placement.worth_a_lookup(uncached, self.node.prefill_tokens_per_s, self.links.rates.min_rtt_s,
                                               local_queue_s, num_streams)
        plan = None
        if end > num_local:
            # Planned here, on the engine thread (the index lookup reads the in-memory mirror): a request that
            # is cheapest computed here joins the scheduler at once, without a detour through a fetch thread.
            plan, hits = self._plan(seq, num_local, end, local_queue_s, num_streams, lookup)
        if plan is not None and plan.promote_end > num_local and not plan.needs_fetch:
            self._promote_now(request, num_local, plan.promote_end)  # our own tiers only: no fetch thread
        if request.span is not NO_SPAN:  # (no attributes built for a request that is not traced)
            request.span.add_event("admitted", {
                "kvmesh.tokens_cached_here": num_local * bs, "kvmesh.fetch": bool(plan and plan.needs_fetch),
                "kvmesh.holder": plan.holder if plan else "", "kvmesh.prefill_node": plan.prefill_node if plan else "",
                "kvmesh.index_lookup": lookup})
        if plan is None or not plan.needs_fetch:
            self._add_local(seq)
            return
        lease = self.loads.start(seq, plan.end)
        if lease is None:  # no room for its blocks now: computed here, as blocks free up
            self._add_local(seq)
            return
        with self._lock:
            self.num_remote += 1
        if plan.prefill_node:  # the next admission prices that node with this conversation in its queue
            self.prefill_nodes.reserve(plan.prefill_node, (plan.end - plan.holders_end) * bs)
        request.fetch_started = time.perf_counter()
        self.landings.expect(rid, plan.promote_s + max(plan.holders_s, plan.prefill_s))
        request.fetch_span = self.tracer.start("fetch", request.span, {
            "kvmesh.holder": plan.holder, "kvmesh.prefill_node": plan.prefill_node,
            "kvmesh.blocks": plan.end - num_local, "kvmesh.transfer_backend": self.agent.engine.name})
        plan, trace_context = plan._replace(num_local=lease.start), request.fetch_span.context
        self.workers.submit(self.loads.run, lease, lambda: self.fetcher.fetch(lease, plan, hits, trace_context),
                            FetchOutcome.nothing(lease.start))

    def _add_local(self, seq: Sequence) -> None:
        with self._lock:
            self.num_local += 1
        self.engine.scheduler.add(seq)

    def _promote_now(self, request: _ClientRequest, num_local: int, end: int) -> None:
        """Engine thread: restore blocks [num_local, end) from this node's lower tiers into tier 0 (cached, free),
        where the scheduler's prefix match finds them; cheaper than computing them, by the plan."""
        seq = request.seq
        held = self.pool.match(seq.block_hashes[:num_local], hold="ref")  # the parent must outlive the allocation
        if len(held) == num_local:
            promotion = self.tiers.promote(seq.block_hashes[num_local:end], held[-1] if held else NO_BLOCK)
            self.pool.free(promotion.block_ids)
            restored, bs = promotion.restored, self.cfg.block_size
            request.tokens_from_host, request.tokens_from_disk = restored.num_host * bs, restored.num_disk * bs
            request.promote_s, request.promoted_in_place = restored.seconds, True
            request.tier0_hit_tokens = num_local * bs
        self.pool.free(held)

    # ---- back on the engine thread --------------------------------------------------------------------------
    def _kv_arrived(self, seq: Sequence, result: FetchOutcome) -> None:
        """``KVLoads``' report of the request's fetch, its blocks ready for the scheduler: the accounting."""
        bs = self.cfg.block_size
        request = self._requests[seq.request_id]
        self.landings.landed(seq.request_id)
        request.kv_wait_s = time.perf_counter() - request.fetch_started
        request.fetch_s = result.load_s
        num_moved = result.from_holders - result.promoted
        if num_moved > 0 and not result.asked_prefill and not result.tainted and result.promoted == result.num_local:
            # A fetch from holders alone, end to end (thread hops and the wait for a step boundary included):
            # what it cost beyond moving the bytes is the round trip the next decision should price.
            moved_s = num_moved * self.agent.block_bytes / self.links.bytes_per_s(result.holder)
            self.rates.record_round_trip(max(0.0, request.kv_wait_s - moved_s), self.links.link(result.holder))
        request.tokens_from_peers = (result.from_holders - result.promoted) * bs
        request.tokens_from_host, request.tokens_from_disk = result.num_host * bs, result.num_disk * bs
        request.promote_s = result.promote_s
        request.tokens_reused_prefill = result.prefill_reused * bs
        # As the landing left it: a tail that arrived, all but the last token, or all of them with the first token.
        landed = seq.num_computed_tokens
        request.tokens_from_prefill = landed - (result.from_holders + result.prefill_reused) * bs
        if request.fetch_span is not NO_SPAN:
            request.fetch_span.set_attributes({
                "kvmesh.kv_wait_ms": request.kv_wait_s * 1e3, "kvmesh.fetch_ms": result.load_s * 1e3,
                "kvmesh.step_boundary_wait_ms": max(0.0, request.kv_wait_s - result.load_s) * 1e3,
                "kvmesh.blocks_from_holder": result.from_holders - result.promoted, "kvmesh.holder_used": result.holder,
                "kvmesh.blocks_from_prefill_node": result.got - result.from_holders,
                "kvmesh.blocks_from_lower_tiers": result.promoted - result.num_local,
                "kvmesh.bytes_received": (result.got - result.promoted) * self.agent.block_bytes,
                "kvmesh.blocks_tainted": len(result.tainted), "kvmesh.fences": list(result.fences),
                "kvmesh.transfer_rounds": result.num_rounds})
            request.fetch_span.end()
        if request.abort_after_fetch:
            self._abort(seq.request_id)
        elif seq.is_finished:  # the first token, which came with the KV, ended it
            self.on_finish(seq)

    def _abort(self, request_id: str) -> None:
        """Stop a request whose caller went away; its blocks are freed (after any transfer into them)."""
        request = self._requests.get(request_id)
        if request is None:
            return
        if self.loads.cancel(request_id):  # writers may still write its blocks: stop them, free the blocks after
            request.abort_after_fetch = True
            self.agent.requester.abort(request_id, "the client aborted the request")
            return
        del self._requests[request_id]
        request.span.add_event("aborted")
        request.span.end()
        if not request.seq.is_finished:
            self.engine.abort(request.seq)
            self.num_aborted += 1

    def _send_error(self, identity: bytes, request_id: str, error: str, kind: str) -> None:
        self.node.endpoint.send(identity, encode(nm.TokenEvent(request_id, [], finished=True, error=error,
                                                               error_kind=kind)))

    def on_token(self, seq: Sequence, token_id: int) -> None:
        request = self._requests.get(seq.request_id)
        if request is None or seq.is_finished:
            return
        event = nm.TokenEvent(seq.request_id, [token_id])
        if len(seq.output_token_ids) == 1:
            request.span.add_event("first_token")
        if seq.params.logprobs is not None:
            top = seq.output_top_logprobs[-1]
            event = nm.TokenEvent(seq.request_id, [token_id], logprobs=[seq.output_logprobs[-1]],
                                  top_token_ids=[t for t, _ in top], top_logprobs=[v for _, v in top])
        self.node.send_event(request.identity, event)

    def on_failed(self, seq: Sequence, error: str) -> None:
        request = self._requests.pop(seq.request_id, None)
        if request is not None:  # a broken node (a dead rank) fails every step: the request may run elsewhere
            request.span.record_error(error)
            request.span.end()
            self.node.send_event(request.identity, nm.TokenEvent(
                seq.request_id, [], finished=True, finish_reason="error", error=error,
                error_kind=nm.ERROR_NODE_LOST if self.node.broken else nm.ERROR_INTERNAL))

    def abandon_requests(self, why: str) -> None:
        requests, self._requests = self._requests, {}  # the engine loop has stopped: this thread owns them now
        self.loads.cancel_all()
        for rid, request in requests.items():
            self.node.endpoint.send(request.identity, encode(nm.TokenEvent(
                rid, [], finished=True, finish_reason="error", error=f"the node is leaving: {why}",
                error_kind=nm.ERROR_NODE_LOST)))

    def hand_back(self, why: str, unstarted_only: bool = False) -> None:
        """Engine thread: end every stream here (``unstarted_only``: those without a token yet and no KV on its way,
        waiting for a place in a step; one whose fetch is in flight starts here as soon as its KV lands, sooner than
        anywhere else) with ERROR_NODE_LOST (the router continues each on another decode node from the tokens it
        has) and free its blocks (after any fetch into them)."""
        for rid, request in list(self._requests.items()):
            if unstarted_only and (request.seq.output_token_ids or self.loads.loading(rid)):
                continue
            self.num_handed_back += 1
            self.node.send_event(request.identity, nm.TokenEvent(rid, [], finished=True, finish_reason="error",
                                                                 error=f"{self.cfg.node_id}: {why}",
                                                                 error_kind=nm.ERROR_NODE_LOST))
            self._abort(rid)

    def on_finish(self, seq: Sequence) -> None:
        request = self._requests.pop(seq.request_id, None)
        if request is None:
            return
        remote, from_prefill = request.tokens_from_peers, request.tokens_from_prefill
        prefill_cached = request.tokens_reused_prefill
        host, disk, tier0 = request.tokens_from_host, request.tokens_from_disk, seq.num_prefix_hit_tokens
        if request.promoted_in_place:  # the prefix hit includes what was promoted (unless it was evicted again)
            used = max(0, tier0 - request.tier0_hit_tokens)
            host = min(host, used)
            disk = min(disk, used - host)
            tier0 -= host + disk
        sources = {"tokens_reused_local": tier0, "tokens_reused_host": host,
                   "tokens_reused_disk": disk, "tokens_reused_remote": remote,
                   "tokens_reused_prefill_node": prefill_cached, "tokens_from_prefill_node": from_prefill,
                   "tokens_computed": seq.num_prompt_tokens - tier0 - host - disk - remote - prefill_cached
                   - from_prefill}
        self.prompt_token_sources.update(sources)
        # What no holder can supply (the block holding the prompt's last token; of it only that token where a
        # prefill node sent the rest): what the role balancer leaves out of "decode nodes computed prompts
        # themselves".
        bs = self.cfg.block_size
        tail = seq.num_prompt_tokens - (seq.num_prompt_tokens - 1) // bs * bs
        self.num_prompt_tokens_always_here += min(tail, sources["tokens_computed"])
        stats = nm.RequestStats(**sources, kv_wait_ms=request.kv_wait_s * 1e3, fetch_ms=request.fetch_s * 1e3,
                                promote_ms=request.promote_s * 1e3, spec_draft_tokens=seq.num_draft_tokens,
                                spec_accepted_tokens=seq.num_accepted_tokens)
        if request.span is not NO_SPAN:
            request.span.set_attributes({f"kvmesh.{key}": value for key, value in stats.as_dict().items()})
            request.span.set_attribute("kvmesh.completion_tokens", len(seq.output_token_ids))
            request.span.end()
        self.node.send_event(request.identity, nm.TokenEvent(seq.request_id, [], finished=True,
                                                        finish_reason=seq.finish_reason or "", stats=stats))

    @property
    def num_streams(self) -> int:
        """Requests admitted here and not yet ended (engine thread's dict, read as it is)."""
        return len(self._requests)

    def close(self) -> None:
        self._conversations.shutdown(wait=False, cancel_futures=True)

    def prompt_queue_s(self) -> float:
        """Seconds of prompt tokens admitted here and not computed yet, at this node's rate (any thread)."""
        return sum(self._queued_prompt_tokens()) / max(self.node.prefill_tokens_per_s, 1e-9)

    def stats(self) -> dict:
        return {"num_remote": self.num_remote, "num_local": self.num_local, "num_aborted": self.num_aborted,
                "prompt_queue_s": self.prompt_queue_s(),
                "num_steps_bounded_for_landings": self.landings.num_bounded_steps,
                "num_streams_handed_back": self.num_handed_back,
                "num_tainted_swapped": self.loads.num_tainted_swapped,
                **{f"prompt_{key}": value for key, value in self.prompt_token_sources.items()},
                "prompt_tokens_total": sum(self.prompt_token_sources.values()),
                "prompt_tokens_always_here": self.num_prompt_tokens_always_here,
                "transfer_gib_per_s_measured": self.rates.bytes_per_s / 2**30,
                "transfer_gib_per_s_by_link": {k: v / 2**30 for k, v in self.rates.by_link().items()},
                "rtt_ms_measured": self.rates.rtt_s * 1e3, "num_rtt_samples": self.rates.num_rtt_samples,
                "rtt_ms_by_link": {k: v * 1e3 for k, v in self.rates.rtt_by_link().items()},
                **self.prefill_nodes.stats(), "num_transfer_samples": self.rates.num_samples}
