"""PrefillRole: a node's prefill work (``kvmesh prefill-node``, or any node while it takes the prefill role).

It serves ComputeAndPush conversations on the node's side channel (its holder calls
``admit``) while the node takes prefills (``accepting``; otherwise BUSY): the prompt
is validated and accepted or refused at once; then, on a worker thread, its local
prefix hits are referenced and the rest of the prefix is planned with the cluster's
planner (``kvmesh/node/planner.py``, no prefill option): what its lower KV tiers hold
next is promoted and a longer prefix held by a peer is pulled into this node's pool
where that beats computing them; the engine computes the rest with chunked prefill.
Every full block is cached as soon as it is computed, and the holder writes the
granted blocks into the decode node chunk by chunk. When the conversation ends (all
blocks written, aborted, expired) ``release`` aborts what is left of the engine
request and drops the references this node held.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

from kvmesh.node.planner import FetchPlan, HolderOption, PlanRequest
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.engine.sequence import Sequence
from kvmesh.kv.block_hash import BlockHash
from kvmesh.kv.block_pool import NO_BLOCK
from kvmesh.tracing import NO_SPAN
from kvmesh.transfer import messages as m
from kvmesh.transfer.errors import TransferError, TransferRefused

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
    held: list[int] = field(default_factory=list)  # local hits and pulled blocks we keep a reference on
    seq: Sequence | None = None
    released: bool = False
    span: object = NO_SPAN  # its trace span (kvmesh/tracing.py): acceptance to the conversation's end


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
        self.num_prefills = 0
        self.num_refused = 0
        self.num_refused_busy = 0  # of those: it could not beat the requester computing the prompt itself
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
        wanted = hashes[msg.first_block: msg.first_block + len(msg.dst_block_ids)]
        if len(wanted) < len(msg.dst_block_ids):
            self.num_refused += 1
            raise TransferRefused(f"the prompt has {len(hashes)} full blocks; blocks {msg.first_block}.."
                                  f"{msg.first_block + len(msg.dst_block_ids)} were asked for",
                                  code=m.ErrorCode.INVALID_PROMPT.value, request_id=msg.request_id)
        uncached = len(prompt) - len(self.pool.match(hashes)) * bs if msg.wanted_within_ms else 0
        with self._lock:
            if msg.wanted_within_ms:
                finish_s = self._finish_estimate_s(uncached)
                if finish_s * 1e3 > msg.wanted_within_ms:
                    self.num_refused += 1
                    self.num_refused_busy += 1
                    raise TransferRefused(f"busy: this prompt would be ready in {finish_s * 1e3:.0f} ms here, the "
                                          f"requester computes it in {msg.wanted_within_ms} ms",
                                          code=m.ErrorCode.BUSY.value, request_id=msg.request_id)
            prefill = self._prefills[msg.request_id] = _Prefill(list(prompt), hashes, msg.cache_salt, msg.first_block)
        prefill.span = self.tracer.start("prefill.compute", msg.trace_context, {
            "kvmesh.node": self.cfg.node_id, "kvmesh.prompt_tokens": len(prompt), "kvmesh.first_block": msg.first_block,
            "kvmesh.blocks": len(msg.dst_block_ids), "kvmesh.landing": msg.landing})
        self.workers.submit(self._prepare, msg.request_id)
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

    def _plan_prefix(self, prefill: _Prefill, num_local: int, lower: list[int], hits: dict[str, int]) -> FetchPlan:
        """The planner the decode nodes use, for this node's own prefix: promote, pull, or compute (no prefill option).
        Links are priced at the configured prior: a prefill node pulls too rarely to learn them."""
        bs, end = self.cfg.block_size, len(prefill.hashes)
        bytes_per_s, rtt_s = self.cfg.transfer_gib_per_s * 2**30, self.cfg.transfer_rtt_s
        with self._lock:
            queue_s = self._backlog_tokens(but=prefill) / self.node.prefill_tokens_per_s
        request = PlanRequest(num_local, end, bs, self.engine.layout.bytes_per_token, self.node.prefill_tokens_per_s,
                              queue_s, len(lower), self.tiers.read_seconds(lower) if lower else 0.0,
                              tuple(HolderOption(n, length, bytes_per_s, rtt_s) for n, length in hits.items()))
        return self.placement.plan(request)

    def num_reused(self, request_id: str) -> int:
        """Granted blocks (from the first one asked) this node held before computing: cached, promoted, pulled."""
        with self._lock:
            prefill = self._prefills.get(request_id)
        if prefill is None:
            return 0
        return max(0, len(prefill.held) - prefill.first_block)

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
    def _prepare(self, request_id: str) -> None:
        """Worker thread: reference our own prefix, pull a longer one from a peer, then queue the prompt."""
        with self._lock:
            prefill = self._prefills.get(request_id)
        if prefill is None:
            return
        if not self.cfg.enable_prefix_caching:  # the baseline: every prompt computed in full, nothing reused
            self.call_soon(lambda: self._start(request_id, prefill))
            return
        hashes = prefill.hashes
        held = self.pool.match(hashes, hold="ref")  # referenced: a concurrent allocation cannot take them
        if len(held) >= len(hashes):
            prefill.held = held
            self.call_soon(lambda: self._start(request_id, prefill))
            return
        lower = self.tiers.lower_run(hashes, len(held)) if self.tiers is not None else []
        hits = self.node.lookup_holders(hashes) if len(held) + len(lower) < len(hashes) else {}
        plan = self._plan_prefix(prefill, len(held), lower, hits)
        if plan.promote_end > len(held):  # our own lower tiers before any peer
            promoted = self.tiers.promote(hashes[len(held):plan.promote_end], held[-1] if held else NO_BLOCK).block_ids
            self.tokens_promoted += len(promoted) * self.cfg.block_size
            held += promoted
        if plan.holder:  # the planned holder first; after a failure, the next longest
            for node_id, length in sorted(hits.items(), key=lambda kv: (kv[0] != plan.holder, -kv[1])):
                if length <= len(held) or prefill.released:
                    continue
                try:
                    pulled = self.agent.pull_prefix(node_id, hashes[len(held):length],
                                                    parent_block_id=held[-1] if held else NO_BLOCK,
                                                    timeout_s=self.cfg.holder_timeout_s,
                                                    request_id=f"pull:{request_id}")
                    self.tokens_pulled += len(pulled) * self.cfg.block_size
                    held += pulled
                    break
                except TransferError as e:
                    log.warning("%s: pulling from %s failed (%s); computing instead", self.cfg.node_id, node_id, e)
        prefill.held = held
        prefill.span.add_event("prefix_ready", {"kvmesh.blocks_held": len(held)})
        self.call_soon(lambda: self._start(request_id, prefill))

    def _start(self, request_id: str, prefill: _Prefill) -> None:
        """Engine thread."""
        if prefill.released:
            self._drop(prefill)
            return
        try:
            prefill.seq = self.engine.add_request(prefill.prompt_token_ids, _prefill_only(prefill.cache_salt),
                                                  request_id=f"prefill:{request_id}")
        except Exception as e:  # validated at admission; a failure here ends in the holder's deadline
            log.warning("%s: prefill %s failed to start: %s", self.cfg.node_id, request_id, e)
            self.release(request_id)
            return
        self.num_prefills += 1

    def _drop(self, prefill: _Prefill) -> None:
        """Engine thread: the conversation is over; stop computing and let go of our references."""
        if prefill.seq is not None and not prefill.seq.is_finished:
            self.engine.abort(prefill.seq)
        held, prefill.held = prefill.held, []
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
