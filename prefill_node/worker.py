"""PrefillRole: a node's prefill work (``kvmesh prefill-node``, or any node while it takes the prefill role).

It serves ComputeAndPush conversations on the node's side channel (its holder calls
``admit``) while the node takes prefills (``accepting``; otherwise BUSY): the prompt
is validated and accepted or refused at once; then, on the engine thread, the rest of
the prefix beyond its local hits is planned with the cluster's planner
(``kvmesh/node/planner.py``, no prefill option) from the connectors' offers
(``kvmesh/node/connectors.py``): where that beats computing them, what its lower KV tiers
hold next is restored and a longer prefix held by a peer is pushed into the request's
blocks, leased to a worker thread (``KVLoads``, ``kvmesh/engine/kv_connector.py``); the
engine computes the rest with chunked prefill. Every full block is cached as soon as it
is computed, and the holder writes the granted blocks into the decode node chunk by
chunk. The blocks held before computing are referenced for the conversation; when it
ends (all blocks written, aborted, expired) ``release`` aborts what is left of the
engine request and drops those references.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

from kvmesh.engine.kv_connector import KVLease, KVLoads, LoadReport
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.engine.sequence import Sequence
from kvmesh.kv.block_hash import BlockHash
from kvmesh.node.connectors import HolderConnector, TierConnector, TierOffer
from kvmesh.node.planner import FetchPlan, PlanRequest
from kvmesh.tracing import NO_SPAN
from kvmesh.transfer import messages as m
from kvmesh.transfer.errors import TransferRefused

log = logging.getLogger("kvmesh.prefill")
def _prefill_only(cache_salt: str) -> SamplingParams:
    return SamplingParams(max_tokens=1, temperature=0.0, cache_salt=cache_salt or None)


@dataclass(slots=True)
class _Prefill:
    """One accepted ComputeAndPush, from acceptance until its conversation ends."""

    prompt_token_ids: list[int]
    hashes: list[BlockHash]
    cache_salt: str = ""
    first_block: int = 0  # the first block of the chain the requester asked for
    held: list[int] = field(default_factory=list)  # blocks held before computing (hits, restored, pushed), referenced
    seq: Sequence | None = None
    with_tail: bool = False  # the requester asked for the prompt's last block too (and the token after it)
    tail_block: int | None = None  # ... held here (referenced) once the whole prompt is computed
    first_token: tuple[int, float] | None = None  # ... and the token picked greedily after it, with its logprob
    released: bool = False
    span: object = NO_SPAN  # its trace span (kvmesh/tracing.py): acceptance to the conversation's end


class _PriorLinks:
    """Every holder's link at the configured prior: a prefill node fetches too rarely to learn them."""

    def __init__(self, bytes_per_s: float, rtt_s: float):
        self._bytes_per_s, self._rtt_s = bytes_per_s, rtt_s

    def bytes_per_s(self, node_id: str) -> float:
        return self._bytes_per_s

    def rtt_s(self, node_id: str) -> float:
        return self._rtt_s

    def record_transfer(self, node_id: str, num_blocks: int, seconds: float) -> None:
        pass


class PrefillRole:
    name = "prefill"

    def __init__(self, node):
        """``node``: the ``NodeRuntime`` whose engine, pool, tiers and transfer agent this role uses."""
        self.node = node
        self.cfg, self.engine, self.pool, self.agent, self.tiers = node.cfg, node.engine, node.pool, node.agent, \
            node.tiers
        self.tracer, self.placement, self.workers, self.call_soon = node.tracer, node.placement, node.workers, \
            node.call_soon
        self.accepting = True  # takes new conversations (off while the node is not a prefill node)
        self._prefills: dict[str, _Prefill] = {}  # conversation id -> state
        self._lock = threading.Lock()
        # The connectors a prefill node fetches its prefix through: its lower tiers, peers holding it.
        self.tier_connector = TierConnector(self.tiers)
        self.holders = HolderConnector(self.agent.requester, _PriorLinks(self.cfg.transfer_gib_per_s * 2**30,
                                                                         self.cfg.transfer_rtt_s),
                                       node.membership, self.cfg.holder_timeout_s)
        self.loads = KVLoads(self.engine, self.call_soon, self._prefix_landed)
        self.num_prefills = 0
        self.num_refused = 0
        self.num_refused_busy = 0  # of those: it could not beat the requester computing the prompt itself, or its deadline
        self.tokens_pulled = 0
        self.tokens_promoted = 0

    # ---- ComputeHook (holder's worker threads) ---------------------------------------------------------
    def admit(self, msg: m.ComputeAndPush) -> list[BlockHash]:
        bs = self.cfg.block_size
        prompt = msg.prompt_token_ids
        if not self.accepting:
            self.num_refused += 1
            self.num_refused_busy += 1
            raise TransferRefused("busy: this node does not take prefills now (it serves streams)",
                                  code=m.ErrorCode.BUSY.value, request_id=msg.request_id)
        try:
            self.engine.prepare_request(prompt, _prefill_only(msg.cache_salt), request_id=f"check:{msg.request_id}")
        except Exception as e:
            self.num_refused += 1
            raise TransferRefused(str(e), code=m.ErrorCode.INVALID_PROMPT.value, request_id=msg.request_id) from None
        hashes = self.engine.kv.hash_prompt(prompt[: (len(prompt) - 1) // bs * bs], msg.cache_salt or None)
        num_chain = len(msg.dst_block_ids) - msg.with_tail  # blocks of the chain asked for (the tail is not one)
        wanted = hashes[msg.first_block: msg.first_block + num_chain]
        if len(wanted) < num_chain or msg.with_tail and msg.first_block + num_chain != len(hashes):
            self.num_refused += 1
            raise TransferRefused(f"the prompt has {len(hashes)} full blocks before its last token's; blocks "
                                  f"{msg.first_block}..{msg.first_block + num_chain} were asked for"
                                  f"{', then its last block' if msg.with_tail else ''}",
                                  code=m.ErrorCode.INVALID_PROMPT.value, request_id=msg.request_id)
        uncached = len(prompt) - len(self.pool.match(hashes)) * bs
        with self._lock:
            finish_s = self._finish_estimate_s(uncached)
            # Past the requester's deadline it would give up and compute the prompt itself: both would compute it.
            limits = [(msg.deadline_ms, "the conversation's deadline is")]
            if msg.wanted_within_ms:
                limits.append((msg.wanted_within_ms, "the requester computes it in"))
            limit_ms, limit = min(limits)
            if finish_s * 1e3 > limit_ms:
                self.num_refused += 1
                self.num_refused_busy += 1
                raise TransferRefused(f"busy: this prompt would be ready in {finish_s * 1e3:.0f} ms here, {limit} "
                                      f"{limit_ms} ms", code=m.ErrorCode.BUSY.value, request_id=msg.request_id)
            prefill = self._prefills[msg.request_id] = _Prefill(list(prompt), hashes, msg.cache_salt, msg.first_block,
                                                                with_tail=msg.with_tail)
        prefill.span = self.tracer.start("prefill.compute", msg.trace_context, {
            "kvmesh.node": self.cfg.node_id, "kvmesh.prompt_tokens": len(prompt), "kvmesh.first_block": msg.first_block,
            "kvmesh.blocks": len(msg.dst_block_ids), "kvmesh.landing": msg.landing})
        self.call_soon(lambda: self._begin(msg.request_id, prefill))
        return wanted

    def _finish_estimate_s(self, num_new_tokens: int) -> float:
        """When a prompt of ``num_new_tokens`` uncached tokens accepted now would be computed: after every
        accepted conversation's tokens still to compute (caller holds ``_lock``), at this node's fitted cost."""
        backlog = self._backlog_tokens() + max(0, num_new_tokens)
        return self.node.prefill_cost.fixed_s + backlog / self.node.prefill_tokens_per_s

    def _backlog_tokens(self, but: _Prefill | None = None) -> int:
        """Prompt tokens of accepted conversations (``but`` one) still to compute (caller holds ``_lock``)."""
        backlog = 0
        for prefill in self._prefills.values():
            seq = prefill.seq
            if prefill is but:
                continue
            if seq is None:  # still being prepared (pulling a prefix): its whole prompt, at most
                backlog += len(prefill.prompt_token_ids)
            elif not seq.is_finished:
                backlog += max(0, seq.num_prompt_tokens - seq.num_computed_tokens)
        return backlog

    def _plan_prefix(self, prefill: _Prefill, num_local: int, lower: TierOffer, hits: dict[str, int]) -> FetchPlan:
        """The planner the decode nodes use, for this node's own prefix: restore, fetch from a holder, or compute (no
        prefill option). Links are priced at the configured prior (``_PriorLinks``)."""
        bs, hashes = self.cfg.block_size, prefill.hashes
        with self._lock:
            queue_s = self._backlog_tokens(but=prefill) / self.node.prefill_tokens_per_s
        request = PlanRequest(num_local, len(hashes), bs, self.engine.layout.bytes_per_token,
                              self.node.prefill_tokens_per_s, queue_s, lower.num_blocks, lower.seconds,
                              self.holders.offers(hashes, hits, num_local + lower.num_blocks))
        return self.placement.plan(request)

    def num_reused(self, request_id: str) -> int:
        """Granted blocks (from the first one asked) this node held before computing: cached, promoted, pulled."""
        with self._lock:
            prefill = self._prefills.get(request_id)
        if prefill is None:
            return 0
        return max(0, len(prefill.held) - prefill.first_block)

    def tail_block(self, request_id: str) -> int | None:
        """The block holding the prompt's last token once the whole prompt is computed, when the requester asked
        for it (held until ``release``; any thread)."""
        with self._lock:
            prefill = self._prefills.get(request_id)
            return prefill.tail_block if prefill is not None else None

    def first_token(self, request_id: str) -> tuple[int, float] | None:
        """The token picked greedily after the whole prompt and its logprob, once computed, when the requester asked
        for the tail (any thread)."""
        with self._lock:
            prefill = self._prefills.get(request_id)
            return prefill.first_token if prefill is not None else None

    def prompt_computed(self, seq: Sequence) -> bool:
        """Engine thread, as a prompt's token is sampled (its blocks not freed yet): a prefill's prompt is computed;
        hold its last block and keep the token when the requester asked for them, and tell the holder. False: not
        a prefill."""
        if not seq.request_id.startswith("prefill:"):
            return False
        with self._lock:
            prefill = self._prefills.get(seq.request_id.removeprefix("prefill:"))
            if prefill is None or not prefill.with_tail or prefill.tail_block is not None:
                return True
            block_id = seq.block_ids[(seq.num_prompt_tokens - 1) // self.cfg.block_size]
            self.pool.touch([block_id])  # freed by ``_drop`` (engine thread, queued by ``release``)
            prefill.tail_block = block_id
            prefill.first_token = (seq.output_token_ids[0], seq.output_logprobs[0])
        self.agent.holder.blocks_cached()
        return True

    def release(self, request_id: str) -> None:
        with self._lock:
            prefill = self._prefills.pop(request_id, None)
        if prefill is not None:
            prefill.released = True
            seq = prefill.seq
            prefill.span.set_attributes({
                "kvmesh.blocks_reused": max(0, len(prefill.held) - prefill.first_block),
                "kvmesh.tokens_computed": seq.num_computed_tokens - seq.num_prefix_hit_tokens if seq else 0})
            prefill.span.end()
            self.call_soon(lambda: self._drop(prefill))

    # ---- preparing and computing -------------------------------------------------------------------------
    def _begin(self, request_id: str, prefill: _Prefill) -> None:
        """Engine thread: the prompt's request, its prefix planned beyond its local hits; fetched into its blocks
        under a lease where that beats computing it, else queued at once."""
        if prefill.released:
            return  # the conversation ended before it began (its ``_drop`` is queued)
        try:
            seq = prefill.seq = self.engine.prepare_request(prefill.prompt_token_ids,
                                                            _prefill_only(prefill.cache_salt),
                                                            request_id=f"prefill:{request_id}")
        except Exception as e:  # validated at admission; a failure here ends in the holder's deadline
            log.warning("%s: prefill %s failed to start: %s", self.cfg.node_id, request_id, e)
            self.release(request_id)
            return
        self.num_prefills += 1
        hashes = prefill.hashes
        num_local = len(self.engine.kv.find_cached_prefix(seq))
        if self.cfg.enable_prefix_caching and num_local < len(hashes):  # (the baseline reuses nothing)
            lower = self.tier_connector.offer(hashes, num_local)
            hits = self.node.lookup_holders(hashes) if num_local + lower.num_blocks < len(hashes) else {}
            plan = self._plan_prefix(prefill, num_local, lower, hits)
            if plan.promote_end > num_local or plan.holder:
                lease = self.loads.start(seq, len(hashes))
                if lease is not None:
                    self.workers.submit(self.loads.run, lease, lambda: self._fetch_prefix(lease, plan, hits))
                    return
        self._hold(prefill, num_local)
        self.engine.scheduler.add(seq)

    def _fetch_prefix(self, lease: KVLease, plan: FetchPlan, hits: dict[str, int]) -> LoadReport:
        """Worker thread: this node's lower tiers first, then the planned holder (after a failure, the next
        longest), into the lease's blocks."""
        bs, got = self.cfg.block_size, lease.start
        if plan.promote_end > got:
            got += self.tier_connector.load(lease, got, plan.promote_end).num_blocks
            self.tokens_promoted += (got - lease.start) * bs
        if not plan.holder or lease.cancelled():
            return LoadReport(got)
        pushed = self.holders.load(lease, got, lease.end, hits, plan.holder)
        self.tokens_pulled += (pushed.got - got) * bs
        return LoadReport(pushed.got, pushed.tainted)

    def _prefix_landed(self, seq: Sequence, report: LoadReport) -> None:
        """Engine thread: the prefix fetch reported; blocks [0, got) are cached in the request's table."""
        with self._lock:
            prefill = self._prefills.get(seq.request_id.removeprefix("prefill:"))
        if prefill is None or prefill.released:  # the conversation ended while the fetch ran
            self.engine.abort(seq)
            return
        # Counted as the scheduler counts a prompt it admits: what was here before computing is reused.
        self.engine.kv.stats.record_lookup(seq.num_prompt_tokens, seq.num_computed_tokens)
        self._hold(prefill, report.got)

    def _hold(self, prefill: _Prefill, num_blocks: int) -> None:
        """Engine thread: reference the prompt's first ``num_blocks`` blocks (held before computing) for the
        conversation, so the holder finds them until it ends."""
        prefill.held = self.pool.match(prefill.hashes[:num_blocks], hold="ref")
        prefill.span.add_event("prefix_ready", {"kvmesh.blocks_held": len(prefill.held)})

    def _drop(self, prefill: _Prefill) -> None:
        """Engine thread: the conversation is over; stop computing and let go of our references (a request whose
        prefix is still being fetched is aborted when the fetch reports)."""
        seq = prefill.seq
        if seq is not None and self.loads.cancel(seq.request_id):
            self.agent.requester.abort(seq.request_id, "the prefill conversation ended")
        elif seq is not None and not seq.is_finished:
            self.engine.abort(seq)
        held, prefill.held = prefill.held, []
        if prefill.tail_block is not None:
            held.append(prefill.tail_block)
            prefill.tail_block = None
        self.pool.free(held)

    @property
    def num_open(self) -> int:
        """Conversations accepted and not yet ended."""
        return len(self._prefills)

    def stats(self) -> dict:
        return {"num_prefills": self.num_prefills, "tokens_pulled": self.tokens_pulled,
                "tokens_promoted": self.tokens_promoted,
                "num_prefills_refused": self.num_refused, "num_prefills_refused_busy": self.num_refused_busy,
                "num_open_prefills": len(self._prefills), "prefill_queue_s": self.queue_s()}

    def queue_s(self) -> float:
        """Seconds of accepted prompt tokens still to compute here, at this node's rate (any thread)."""
        with self._lock:
            return self._backlog_tokens() / self.node.prefill_tokens_per_s
