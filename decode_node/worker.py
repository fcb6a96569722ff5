"""DecodeWorker: ``kvmesh decode-node``.

For each GenerateRequest (docs/design.md §2):
1. allocate the request's blocks; its own prefix hits need no transfer;
2. the uncached part: if it is short (cost model: compute time vs transfer time),
   compute it here; otherwise, in a worker thread, a peer that holds a longer
   prefix pushes it into a grant on our blocks while one prefill node, chosen
   from the index hits, computes the rest and pushes it into a second grant
   (one ComputeAndPush conversation: accepted or refused at once, chunks, final;
   a refusal or failure moves on to the next prefill node);
3. whatever arrived, the request runs: the scheduler computes what is missing
   (at least the prompt's last partial block) and decodes with continuous
   batching, streaming tokens back. A failed or timed-out transfer only means
   more local work; blocks a stalled writer may still write into (tainted) are
   swapped for fresh ones before the request touches them.

An abort from the caller propagates to every writer of the request; the
request's blocks are freed once its fetch has returned.
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import NamedTuple

from kvmesh.decode_node.cost_model import (NETWORK, SHARED_MEMORY, FetchPlan, TransferRateEstimator, plan_fetch,
                                           worth_a_lookup)
from kvmesh.engine.request_state import RequestStatus
from kvmesh.engine.sequence import Sequence
from kvmesh.errors import KvmeshError, OutOfBlocksError
from kvmesh.kv.block_pool import NO_BLOCK
from kvmesh.kv.cache_stats import PrefixCacheStats
from kvmesh.node import messages as nm
from kvmesh.rate_meter import CostFit
from kvmesh.node.runtime import NodeRuntime
from kvmesh.transfer.errors import TransferRefused
from kvmesh.transfer.shared_memory import same_host_region
from kvmesh.wire import encode

log = logging.getLogger("kvmesh.decode")

PROBE_FETCH_BLOCKS = 4  # the start-up fetch from ourselves that seeds the shared-memory link's round trip
PROBE_FETCH_TRIES = 3


@dataclass(slots=True)
class _ClientRequest:
    """What the decode node keeps about one caller's request until it ends."""

    identity: bytes  # the caller's ZMQ identity, for streaming
    seq: Sequence
    fetch_started: float = 0.0  # when peers were asked for its KV
    fetching: bool = False  # peers may still be writing its blocks
    abort_after_fetch: bool = False
    tokens_from_peers: int = 0  # reused from other nodes' caches
    tokens_from_prefill: int = 0  # pushed by a prefill node
    tokens_from_host: int = 0  # promoted from this node's host-memory tier
    tokens_from_disk: int = 0  # ... and from its disk tier
    promote_s: float = 0.0
    promoted_in_place: bool = False  # promoted at admission: the scheduler counts those tokens as prefix hits
    tier0_hit_tokens: int = 0  # ... beyond these, which were in tier 0 already
    kv_wait_s: float = 0.0


@dataclass(slots=True)
class _FetchResult:
    num_local: int  # blocks we had in tier 0
    from_holders: int  # blocks [promoted, from_holders) came from peers' caches
    got: int  # blocks [from_holders, got) from a prefill node
    tainted: list[int] = field(default_factory=list)  # block ids a stalled writer may still write
    promoted: int = -1  # blocks [num_local, promoted) restored from our own lower tiers (-1: num_local)
    num_host: int = 0
    num_disk: int = 0
    promote_s: float = 0.0
    asked_prefill: bool = False  # a prefill node was asked for blocks [from_holders, end)
    holder: str = ""  # the peer that sent blocks [promoted, from_holders)


class _PrefillChoice(NamedTuple):
    node_id: str  # "" when no prefill node can be priced
    tokens_per_s: float
    queue_s: float  # its work already sent by this node, at that rate
    fixed_s: float  # a conversation's cost beyond its tokens


PROMPT_TOKEN_SOURCES = ("tokens_reused_local", "tokens_reused_host", "tokens_reused_disk", "tokens_reused_remote",
                        "tokens_from_prefill_node", "tokens_computed")


class DecodeWorker(NodeRuntime):
    def __init__(self, cfg):
        super().__init__(cfg)
        self._requests: dict[str, _ClientRequest] = {}  # engine thread only
        self._round_robin = itertools.count()
        self._prefills_in_flight: Counter[str] = Counter()  # ComputeAndPush conversations per prefill node
        self._prefill_tokens_in_flight: Counter[str] = Counter()  # ... and the prompt tokens they ask for
        # Each prefill node's rate as this node sees it (whole conversations, its queueing included).
        self._prefill_costs: dict[str, CostFit] = {}
        # Prefill conversations run beside the fetch that waits for them (never in its pool: no deadlock).
        self._prefill_workers = ThreadPoolExecutor(16, thread_name_prefix=f"kvmesh-{cfg.node_id}-prefill")
        self._lock = threading.Lock()
        self.num_remote = 0
        self.num_local = 0
        self.num_fallbacks = 0
        self.num_refusals = 0
        self.num_aborted = 0
        self.num_tainted_swapped = 0
        # Where every finished request's prompt tokens came from, each token counted once (engine thread only).
        # Keys fixed up front, so the stats thread can read it while the engine thread adds.
        self.prompt_token_sources: Counter[str] = Counter(dict.fromkeys(PROMPT_TOKEN_SOURCES, 0))
        self.rates = TransferRateEstimator(self.cfg.transfer_gib_per_s * 2**30, self.cfg.transfer_rtt_s)

    def before_serving(self) -> None:
        """Seed the shared-memory link's round trip (docs/design.md §2) by fetching a few blocks from ourselves
        through the whole holder path (side channel, holder, the shared-memory write, the final answer), the
        best of a few tries, plus half a decode step (a fetch's KV waits for the step in progress to end).
        Network links keep ``--transfer-rtt-ms``: talking to ourselves says nothing about another host."""
        if self.agent.shared_region is None or self.agent.shared_writer is None or not self.cfg.enable_prefix_caching:
            return
        from kvmesh.engine.sampling_params import SamplingParams

        bs = self.cfg.block_size
        num_blocks = max(1, min(PROBE_FETCH_BLOCKS, self.pool.num_blocks // 4))
        seq = self.engine.add_request([(11 * i + 3) % 250 for i in range(num_blocks * bs + 1)],
                                      SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        while not seq.is_finished:
            self.engine.step()
        best = float("inf")
        for attempt in range(PROBE_FETCH_TRIES):
            block_ids = self.pool.allocate(num_blocks)
            started = time.perf_counter()
            outcome = self.agent.requester.push(self.cfg.node_id, block_ids, seq.block_hashes[:num_blocks],
                                                request_id=f"{self.cfg.node_id}/rtt-probe-{attempt}", timeout_s=5.0)
            took = time.perf_counter() - started
            self.pool.free(block_ids)
            if outcome.error is not None or outcome.num_written != num_blocks or outcome.tainted_block_ids:
                log.warning("%s: round-trip probe failed (%s): the shared-memory link keeps --transfer-rtt-ms",
                            self.cfg.node_id, outcome.error)
                best = float("inf")
                break
            best = min(best, took)
        self.pool.evict(self.pool.num_blocks)  # as after the compute probe: nothing of this is published
        self.pool.take_cached(), self.pool.take_evicted()
        self.engine.kv.stats = PrefixCacheStats()
        self.agent.reset_counters()
        if best < float("inf"):
            self.rates.seed_round_trip(best + self.decode_step_s / 2, SHARED_MEMORY)
            log.info("%s: shared-memory fetch round trip %.2f ms (probe %.2f ms + half a decode step)",
                     self.cfg.node_id, self.rates.rtt_s_for(SHARED_MEMORY) * 1e3, best * 1e3)

    # ---- admission (engine thread) ------------------------------------------------------------------
    def handle(self, identity: bytes, msg) -> None:
        if isinstance(msg, nm.GenerateRequest):
            self.call_soon(lambda: self._admit(identity, msg))
        elif isinstance(msg, nm.AbortRequest):
            self.call_soon(lambda: self._abort(msg.request_id))
        else:
            super().handle(identity, msg)

    def _plan(self, seq: Sequence, num_local: int, end: int, hits: dict[str, int], lower: list[int],
              local_queue_s: float) -> FetchPlan:
        """Where blocks [num_local, end) come from (docs/design.md §2): the cost model, or the forced limit.

        ``lower``: tiers of the blocks from ``num_local`` on that this node holds below its KV buffer;
        they are promoted when reading them back beats computing them (docs/tiers.md). ``local_queue_s``:
        how long the prompt tokens already queued here take.
        """
        bs = self.cfg.block_size
        promote_end, promote_s = num_local, 0.0
        if lower and (self.cfg.local_prefill_tokens >= 0 or
                      self.tiers.read_seconds(lower) < len(lower) * bs / self.prefill_tokens_per_s):
            promote_end, promote_s = num_local + len(lower), self.tiers.read_seconds(lower)
        held_end = max([promote_end] + [min(length, end) for length in hits.values()])
        prefill_nodes = self.membership.nodes("prefill")
        if self.cfg.local_prefill_tokens >= 0:  # forced (tests, benchmarks): fetch whatever is longer
            fetch = (end - promote_end) * bs > self.cfg.local_prefill_tokens
            return FetchPlan(held_end if fetch else promote_end, fetch and bool(prefill_nodes), 0.0, 0.0,
                             promote_end)
        prefill = self._best_prefill_node(prefill_nodes, (end - held_end) * bs)
        holder = max(hits, key=hits.get) if hits else None
        bytes_per_s = self._bytes_per_s(holder) if holder is not None else self.rates.bytes_per_s
        rtt_s = self.rates.rtt_s_for(self._link(holder)) if holder is not None else self.rates.rtt_s
        if holder is not None and held_end > promote_end:  # a holder streams disk-tier blocks off its disk first
            if self.membership.index.slowest_tier(seq.block_hashes[promote_end:held_end], holder) == 2:
                disk_rate = self.membership.probe_of(holder).disk_read_bytes_per_s
                if disk_rate > 0:
                    bytes_per_s = min(bytes_per_s, disk_rate)
        plan = plan_fetch(promote_end, held_end, end, bs, self.engine.layout.bytes_per_token,
                          local_tokens_per_s=self.prefill_tokens_per_s, remote_tokens_per_s=prefill.tokens_per_s,
                          bytes_per_s=bytes_per_s, rtt_s=rtt_s,
                          have_prefill_node=bool(prefill_nodes), prefill_queue_s=prefill.queue_s,
                          prefill_bytes_per_s=self._bytes_per_s(prefill.node_id) if prefill.node_id else None,
                          prefill_rtt_s=prefill.fixed_s,
                          local_queue_s=local_queue_s,
                          prefill_holds_prefix=hits.get(prefill.node_id, 0) >= held_end)
        return plan._replace(seconds=plan.seconds + promote_s, promote_end=promote_end)

    def _queued_prompt_tokens(self) -> int:
        """Prompt tokens admitted here and not yet computed (engine thread): what a new prompt waits behind."""
        scheduler = self.engine.scheduler
        return sum(max(0, seq.num_prompt_tokens - seq.num_computed_tokens)
                   for seq in (*scheduler.waiting, *scheduler.running))

    def _prefill_costs_snapshot(self) -> tuple[dict[str, float], dict[str, float]]:
        with self._lock:
            return ({n: f.per_s for n, f in self._prefill_costs.items()},
                    {n: f.fixed_s * 1e3 for n, f in self._prefill_costs.items()})

    def _prefill_cost(self, node_id: str, published_per_s: float, step_s: float) -> CostFit:
        """What a ComputeAndPush conversation with ``node_id`` costs as this node sees it, end to end: a fixed
        part (messaging, the node's own step and queue, the writes, the final answer) plus its tokens at a
        rate. Seeded with the rate the node published (its start-up probe) and, as the fixed part,
        ``--transfer-rtt-ms`` plus one engine step there (its published decode step: a conversation costs that
        node at least one step of its own, in series with the step here that computes the last token);
        refitted to every conversation that succeeded (caller holds ``_lock``)."""
        fit = self._prefill_costs.get(node_id)
        if fit is None:
            fixed = self.rates.prior_rtt_s + step_s
            fit = self._prefill_costs[node_id] = CostFit([(n, fixed + n / published_per_s) for n in (64, 512)])
        return fit

    def _link(self, node_id: str) -> str:
        """How ``node_id``'s pushes reach us: by one copy into our shared-memory KV buffer (a writer on this host)
        or through the transfer engine."""
        ours = self.agent.shared_region
        if ours is None or same_host_region(self.membership.peer(node_id), ours.host) is None:
            return NETWORK
        return SHARED_MEMORY

    def _bytes_per_s(self, node_id: str) -> float:
        return self.rates.bytes_per_s_to(node_id, self._link(node_id))

    def _record_transfer(self, node_id: str, num_blocks: int, write_s: float) -> None:
        self.rates.record_transfer(num_blocks * self.agent.block_bytes, write_s, node_id, self._link(node_id))

    def _best_prefill_node(self, prefill_nodes: dict, num_tokens: int) -> _PrefillChoice:
        """The prefill node that would finish ``num_tokens`` soonest, with what its conversation costs."""
        best = _PrefillChoice("", 0.0, 0.0, 0.0)
        best_s = float("inf")
        with self._lock:
            for node_id, record in prefill_nodes.items():
                published, step_s = record.probe.prefill_tokens_per_s, record.probe.decode_step_s
                if not published > 0:
                    continue
                fit = self._prefill_cost(node_id, published, step_s)
                # Never faster than the node measured itself computing: a quicker conversation found the
                # prompt cached there (an index not yet updated), which says nothing about the next one.
                rate = min(fit.per_s, published)
                queue_s = self._prefill_tokens_in_flight[node_id] / rate
                finish_s = queue_s + fit.fixed_s + num_tokens / rate
                if finish_s < best_s:
                    best, best_s = _PrefillChoice(node_id, rate, queue_s, fit.fixed_s), finish_s
        return best

    def _admit(self, identity: bytes, msg: nm.GenerateRequest) -> None:
        rid = msg.request_id
        if rid in self._requests:
            self._send_error(identity, rid, f"request id {rid!r} is already in use")
            return
        try:
            seq = self.engine.prepare_request(msg.prompt_token_ids, msg.sampling_params(), request_id=rid)
        except Exception as e:  # any refusal must reach the caller, never leave it waiting
            error = str(e) if isinstance(e, (KvmeshError, ValueError, TypeError)) else f"{type(e).__name__}: {e}"
            self._send_error(identity, rid, error)
            return
        request = self._requests[rid] = _ClientRequest(identity, seq)
        local = self.engine.kv.find_cached_prefix(seq)
        bs = self.cfg.block_size
        fetchable_end = (seq.num_prompt_tokens - 1) // bs  # the last token is always computed here
        uncached = seq.num_prompt_tokens - len(local) * bs
        local_queue_s = self._queued_prompt_tokens() / self.prefill_tokens_per_s
        if self.cfg.local_prefill_tokens >= 0:
            forced_local = uncached <= self.cfg.local_prefill_tokens
        else:  # cheaper here than any round trip: not even a lookup
            forced_local = not worth_a_lookup(uncached, self.prefill_tokens_per_s, self.rates.min_rtt_s, local_queue_s)
        plan, hits = None, {}
        lower = self.tiers.lower_run(seq.block_hashes[:fetchable_end], len(local)) \
            if self.tiers is not None and fetchable_end > len(local) else []
        if fetchable_end > len(local) and (lower or not forced_local):
            # Planned here, on the engine thread (the index lookup reads the in-memory mirror): a request that
            # is cheapest computed here joins the scheduler at once, without a detour through a fetch thread.
            if not forced_local:
                hits = self.lookup_holders(seq.block_hashes[:fetchable_end])
            plan = self._plan(seq, len(local), fetchable_end, hits, lower, local_queue_s)
        if plan is not None and plan.promote_end > len(local) and plan.holders_end <= plan.promote_end and \
                not plan.use_prefill:  # only our own lower tiers: promote here, no detour through a fetch thread
            self._promote_now(request, len(local), plan.promote_end)
            plan = None
        if plan is None or (plan.holders_end <= len(local) and not plan.use_prefill):
            with self._lock:
                self.num_local += 1
            self.engine.scheduler.add(seq)
            return
        try:
            self.engine.scheduler.add_awaiting_remote_kv(seq)
        except OutOfBlocksError:
            with self._lock:
                self.num_local += 1
            self.engine.scheduler.add(seq)
            return
        with self._lock:
            self.num_remote += 1
        request.fetching, request.fetch_started = True, time.perf_counter()
        self.workers.submit(self._fetch, seq, seq.num_prefix_hit_tokens // bs, fetchable_end, msg.prefill_node, hits,
                            plan)

    def _promote_now(self, request: _ClientRequest, num_local: int, end: int) -> None:
        """Engine thread: restore blocks [num_local, end) from this node's lower tiers into tier 0 (cached, free),
        where the scheduler's prefix match finds them; cheaper than computing them, by the plan."""
        seq = request.seq
        held = self.pool.match_and_touch(seq.block_hashes[:num_local])  # the parent must outlive the allocation
        if len(held) == num_local:
            promotion = self.tiers.promote(seq.block_hashes[num_local:end], held[-1] if held else NO_BLOCK)
            self.pool.free(promotion.block_ids)
            restored, bs = promotion.restored, self.cfg.block_size
            request.tokens_from_host, request.tokens_from_disk = restored.num_host * bs, restored.num_disk * bs
            request.promote_s, request.promoted_in_place = restored.seconds, True
            request.tier0_hit_tokens = num_local * bs
        self.pool.free(held)

    # ---- fetching (worker thread) -----------------------------------------------------------------------
    def _fetch(self, seq: Sequence, num_local: int, end: int, preferred: str, hits: dict[str, int],
               plan: FetchPlan) -> None:
        """Holders push the prefix they have while a prefill node computes the rest (overlapped), as planned.

            blocks  [0, num_local)      our own hits
                    [num_local, promoted) restored from our own lower tiers (plan.promote_end)
                    [promoted, split)   the longest prefix the index says a peer holds: a holder's grant
                    [split, end)        computed and pushed by a prefill node (plan.use_prefill), at the
                                        same time: its grant; otherwise computed here

        The prefill node's blocks are usable only if the holders delivered all of theirs (a stale
        index leaves a gap, which this node then computes itself). ``hits`` and ``plan`` come from admission.
        """
        result = _FetchResult(num_local, num_local, num_local, promoted=num_local)
        try:
            split = plan.holders_end
            computing, prefill = None, _FetchResult(split, split, split)
            if plan.use_prefill:
                result.asked_prefill = True
                computing = self._prefill_workers.submit(self._fetch_from_prefill, seq, prefill, end, hits,
                                                         preferred, plan.local_seconds)
            if plan.promote_end > num_local:  # our own lower tiers (while the prefill node computes)
                restored = self.tiers.restore(seq.block_hashes[num_local:plan.promote_end],
                                              seq.block_ids[num_local:plan.promote_end])
                result.promoted = result.from_holders = result.got = num_local + restored.num_blocks
                result.num_host, result.num_disk, result.promote_s = restored.num_host, restored.num_disk, \
                    restored.seconds
            self._fetch_from_holders(seq, result, split, hits)
            result.got = result.from_holders
            if computing is not None:
                computing.result()
                result.tainted += prefill.tainted
                if result.from_holders == split:
                    result.got = prefill.got
        except Exception:
            log.exception("%s: fetching KV for %s failed", self.cfg.node_id, seq.request_id)
        finally:
            self.call_soon(lambda: self._kv_arrived(seq, result))

    def _fetch_from_holders(self, seq: Sequence, result: _FetchResult, end: int, hits: dict[str, int]) -> None:
        """A peer (any role) already holding a longer prefix pushes it into a grant on our blocks."""
        got = result.from_holders
        for node_id, length in sorted(hits.items(), key=lambda kv: -kv[1]):
            length = min(length, end)
            if length <= got or self._aborting(seq):
                continue
            outcome = self.agent.requester.push(node_id, seq.block_ids[got:length], seq.block_hashes[got:length],
                                                request_id=f"{seq.request_id}/hold", timeout_s=self.cfg.holder_timeout_s)
            self._record_transfer(node_id, outcome.num_written, outcome.write_s)
            result.tainted += outcome.tainted_block_ids
            if outcome.error is not None:
                log.warning("%s: holder %s: %s", self.cfg.node_id, node_id, outcome.error)
            if outcome.num_written or outcome.tainted_block_ids:
                result.from_holders = got + outcome.num_written
                result.holder = node_id
                return

    def _prefill_candidates(self, hits: dict[str, int], preferred: str) -> list[str]:
        """Prefill nodes, best first: the caller's choice, the longest cached prefix, the fewest prompts we
        have in flight there (load as this node sees it), then rotation."""
        nodes = sorted(self.membership.nodes("prefill"))
        if not nodes:
            return []
        turn = next(self._round_robin) % len(nodes)
        rotation = {n: (i - turn) % len(nodes) for i, n in enumerate(nodes)}
        with self._lock:
            load = dict(self._prefills_in_flight)
        return sorted(nodes, key=lambda n: (n != preferred, -hits.get(n, 0), load.get(n, 0), rotation[n]))

    def _fetch_from_prefill(self, seq: Sequence, result: _FetchResult, end: int, hits: dict[str, int],
                            preferred: str, local_s: float = 0.0) -> None:
        """One ComputeAndPush conversation at a time, on to the next prefill node after a refusal or failure.

        ``local_s``: the plan's estimate of computing everything here (0: forced, no limit): a prefill node
        that cannot deliver sooner, its backlog from every decode node included, refuses (BUSY)."""
        asked = time.perf_counter()
        for node_id in self._prefill_candidates(hits, preferred)[:3]:
            if self._aborting(seq):
                return
            wanted_within_s = max(1e-3, local_s - (time.perf_counter() - asked)) if local_s > 0 else 0.0
            got = result.got
            num_tokens = (end - got) * self.cfg.block_size
            with self._lock:
                self._prefills_in_flight[node_id] += 1
                self._prefill_tokens_in_flight[node_id] += num_tokens
            started = time.perf_counter()
            try:
                outcome = self.agent.requester.compute_and_push(
                    node_id, seq.block_ids[got:end], list(seq.prompt_token_ids), got,
                    request_id=f"{seq.request_id}/prefill", timeout_s=self.cfg.prefill_timeout_s,
                    wanted_within_s=wanted_within_s, cache_salt=seq.params.cache_salt or "")
            finally:
                with self._lock:
                    self._prefills_in_flight[node_id] -= 1
                    self._prefill_tokens_in_flight[node_id] -= num_tokens
            if outcome.error is None and node_id in self._prefill_costs:
                with self._lock:  # the whole conversation: its queueing and the transfer included
                    self._prefill_costs[node_id].record(num_tokens, time.perf_counter() - started)
            self._record_transfer(node_id, outcome.num_written, outcome.write_s)
            result.tainted += outcome.tainted_block_ids
            result.got = got + outcome.num_written
            if outcome.error is None:
                return
            if isinstance(outcome.error, TransferRefused):
                self.num_refusals += 1
            else:
                self.num_fallbacks += 1
            log.warning("%s: prefill node %s for %s: %s", self.cfg.node_id, node_id, seq.request_id, outcome.error)
            if result.got >= end or outcome.tainted_block_ids:
                return  # tainted blocks cannot be granted again: compute the rest here

    def _aborting(self, seq: Sequence) -> bool:
        request = self._requests.get(seq.request_id)
        return request is None or request.abort_after_fetch

    # ---- back on the engine thread --------------------------------------------------------------------------
    def _kv_arrived(self, seq: Sequence, result: _FetchResult) -> None:
        bs = self.cfg.block_size
        request = self._requests[seq.request_id]
        request.fetching = False
        request.kv_wait_s = time.perf_counter() - request.fetch_started
        num_moved = result.from_holders - result.promoted
        if num_moved > 0 and not result.asked_prefill and not result.tainted and result.promoted == result.num_local:
            # A fetch from holders alone, end to end (thread hops and the wait for a step boundary included):
            # what it cost beyond moving the bytes is the round trip the next decision should price.
            moved_s = num_moved * self.agent.block_bytes / self._bytes_per_s(result.holder)
            self.rates.record_round_trip(max(0.0, request.kv_wait_s - moved_s), self._link(result.holder))
        request.tokens_from_peers = (result.from_holders - result.promoted) * bs
        request.tokens_from_host, request.tokens_from_disk = result.num_host * bs, result.num_disk * bs
        request.promote_s = result.promote_s
        request.tokens_from_prefill = (result.got - result.from_holders) * bs
        if result.tainted:  # a stalled writer may still write these: never let this request (or anyone) use them
            self.num_tainted_swapped += len(result.tainted)
            try:
                self.engine.kv.replace_blocks(seq, result.tainted)
            except OutOfBlocksError:  # the pool is short while they are fenced: wait for blocks, do not fail
                tainted = set(result.tainted)
                self.engine.kv.release_from(seq, next((i for i, b in enumerate(seq.block_ids) if b in tainted),
                                                         len(seq.block_ids)))
        self.engine.scheduler.remote_kv_ready(seq.request_id, result.got * bs)
        if request.abort_after_fetch:
            self._abort(seq.request_id)

    def _abort(self, request_id: str) -> None:
        """Stop a request whose caller went away; its blocks are freed (after any transfer into them)."""
        request = self._requests.get(request_id)
        if request is None:
            return
        if request.fetching:  # writers may still be writing its blocks: stop them, free the blocks afterwards
            request.abort_after_fetch = True
            self.agent.requester.abort(request_id, "the client aborted the request")
            return
        del self._requests[request_id]
        if not request.seq.is_finished:
            self.engine.abort(request.seq)
            self.num_aborted += 1

    def _send_error(self, identity: bytes, request_id: str, error: str) -> None:
        self.endpoint.send(identity, encode(nm.TokenEvent(request_id, [], finished=True, error=error)))

    def on_token(self, seq: Sequence, token_id: int) -> None:
        request = self._requests.get(seq.request_id)
        if request is None or seq.is_finished:
            return
        event = nm.TokenEvent(seq.request_id, [token_id])
        if seq.params.logprobs is not None:
            top = seq.output_top_logprobs[-1]
            event = nm.TokenEvent(seq.request_id, [token_id], logprobs=[seq.output_logprobs[-1]],
                                  top_token_ids=[t for t, _ in top], top_logprobs=[v for _, v in top])
        self.endpoint.send(request.identity, encode(event))

    def on_failed(self, seq: Sequence, error: str) -> None:
        request = self._requests.pop(seq.request_id, None)
        if request is not None:
            self.endpoint.send(request.identity, encode(nm.TokenEvent(seq.request_id, [], finished=True,
                                                                      finish_reason="error", error=error)))

    def on_finish(self, seq: Sequence) -> None:
        request = self._requests.pop(seq.request_id, None)
        if request is None:
            return
        remote, from_prefill = request.tokens_from_peers, request.tokens_from_prefill
        host, disk, tier0 = request.tokens_from_host, request.tokens_from_disk, seq.num_prefix_hit_tokens
        if request.promoted_in_place:  # the prefix hit includes what was promoted (unless it was evicted again)
            used = max(0, tier0 - request.tier0_hit_tokens)
            host = min(host, used)
            disk = min(disk, used - host)
            tier0 -= host + disk
        sources = {"tokens_reused_local": tier0, "tokens_reused_host": host,
                   "tokens_reused_disk": disk, "tokens_reused_remote": remote,
                   "tokens_from_prefill_node": from_prefill,
                   "tokens_computed": seq.num_prompt_tokens - tier0 - host - disk - remote - from_prefill}
        self.prompt_token_sources.update(sources)
        stats = {**sources, "kv_wait_ms": request.kv_wait_s * 1e3, "promote_ms": request.promote_s * 1e3}
        if seq.num_draft_tokens:
            stats.update(spec_draft_tokens=seq.num_draft_tokens, spec_accepted_tokens=seq.num_accepted_tokens)
        self.endpoint.send(request.identity, encode(nm.TokenEvent(seq.request_id, [], finished=True,
                                                                  finish_reason=seq.finish_reason or "",
                                                                  stats=stats)))

    def close(self) -> None:
        super().close()
        self._prefill_workers.shutdown(wait=False, cancel_futures=True)

    def role_stats(self) -> dict:
        prefill_rates, prefill_fixed_ms = self._prefill_costs_snapshot()
        return {"num_remote": self.num_remote, "num_local": self.num_local, "num_fallbacks": self.num_fallbacks,
                "num_prefill_refusals": self.num_refusals, "num_aborted": self.num_aborted,
                "num_tainted_swapped": self.num_tainted_swapped,
                **{f"prompt_{key}": value for key, value in self.prompt_token_sources.items()},
                "transfer_gib_per_s_measured": self.rates.bytes_per_s / 2**30,
                "transfer_gib_per_s_by_link": {k: v / 2**30 for k, v in self.rates.by_link().items()},
                "rtt_ms_measured": self.rates.rtt_s * 1e3, "num_rtt_samples": self.rates.num_rtt_samples,
                "rtt_ms_by_link": {k: v * 1e3 for k, v in self.rates.rtt_by_link().items()},
                "prefill_node_tokens_per_s": prefill_rates, "prefill_node_fixed_ms": prefill_fixed_ms,
                "prefill_node_ids": sorted(self.membership.nodes("prefill")),  # what this node can send work to
                "num_transfer_samples": self.rates.num_samples}
