"""Carrying out a plan: this node's lower tiers, a holder's push and a prefill node's conversation, overlapped.

``Fetcher.fetch`` runs on a worker thread for one request whose plan needs peers (``FetchPlan.needs_fetch``):

    blocks  [0, num_local)            our own hits
            [num_local, promoted)     restored from our own lower tiers (plan.promote_end)
            [promoted, from_holders)  pushed by the planned holder (others that hold as much, if it fails)
            [from_holders, got)       computed and pushed by a prefill node (the planned one first), asked at
                                      the same time as the holder: usable only if the holder delivered all
                                      of its part (a stale index leaves a gap, which this node computes)

and returns a ``FetchOutcome`` saying where each block came from, which the decode worker turns into
its accounting and the scheduler's computed length. Blocks a stalled writer may still write are listed
(``tainted``): the worker swaps them for fresh ones before anyone reads them.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field

from kvmesh.decode_node.cost_model import PeerLinks
from kvmesh.node.planner import FetchPlan
from kvmesh.decode_node.prefill_nodes import PrefillNodes
from kvmesh.engine.sequence import Sequence

log = logging.getLogger("kvmesh.decode")


@dataclass(slots=True)
class FetchOutcome:
    num_local: int  # blocks we had in tier 0
    promoted: int  # blocks [num_local, promoted) restored from our own lower tiers
    from_holders: int  # blocks [promoted, from_holders) came from a peer's cache
    got: int  # blocks [from_holders, got) from a prefill node
    prefill_reused: int = 0  # of those, leading blocks the prefill node had cached (not computed for us)
    tainted: list[int] = field(default_factory=list)  # block ids a stalled writer may still write
    num_host: int = 0
    num_disk: int = 0
    promote_s: float = 0.0
    asked_prefill: bool = False  # a prefill node was asked for blocks [from_holders, end)
    holder: str = ""  # the peer that sent blocks [promoted, from_holders)
    fences: list[str] = field(default_factory=list)  # what fenced each conversation's writes (holders', prefill's)
    num_rounds: int = 0  # conversations in all (landing rounds included)
    fetch_s: float = 0.0  # the fetch thread's time on it (the request's KV wait adds the hops to the engine thread)

    @classmethod
    def nothing(cls, num_local: int) -> FetchOutcome:
        return cls(num_local, num_local, num_local, num_local)


class Fetcher:
    def __init__(self, tiers, requester, links: PeerLinks, prefill_nodes: PrefillNodes, holder_timeout_s: float,
                 conversations: Executor, block_size: int):
        """``conversations``: where prefill conversations run beside the fetch that waits for them (never the
        fetch's own pool: no deadlock)."""
        self._block_size = block_size
        self._tiers = tiers
        self._requester = requester
        self._links = links
        self._prefill_nodes = prefill_nodes
        self._holder_timeout_s = holder_timeout_s
        self._conversations = conversations

    def fetch(self, seq: Sequence, plan: FetchPlan, hits: dict[str, int], aborting: Callable[[], bool],
              trace_context: str = "") -> FetchOutcome:
        """Worker thread. ``hits``: index hits by node (blocks from the prompt's start). The planned prefill
        conversation must have been ``reserve``d with ``PrefillNodes`` when it was planned (it is released
        here). Never raises for a peer's failure: what did not arrive is computed. ``trace_context``: the
        fetch's span, which a prefill node's continues."""
        start, split, end = plan.num_local, plan.holders_end, plan.end
        outcome = FetchOutcome.nothing(start)
        computing = None
        if plan.prefill_node:
            outcome.asked_prefill = True
            reserved = (plan.prefill_node, (end - split) * self._block_size)
            try:
                order = self._prefill_nodes.candidates(hits, plan.prefill_node)
                computing = self._conversations.submit(self._prefill_nodes.compute_and_push, seq, split, end,
                                                       order, plan.local_seconds, aborting, reserved, trace_context)
            except BaseException:
                self._prefill_nodes.release(*reserved)  # the conversation never starts: nor does its count
                raise
        if plan.promote_end > start:  # our own lower tiers (while the prefill node computes)
            restored = self._tiers.restore(seq.block_hashes[start:plan.promote_end],
                                           seq.block_ids[start:plan.promote_end])
            outcome.promoted = outcome.from_holders = outcome.got = start + restored.num_blocks
            outcome.num_host, outcome.num_disk, outcome.promote_s = restored.num_host, restored.num_disk, \
                restored.seconds
        self._from_holders(seq, outcome, split, hits, plan.holder, aborting, trace_context)
        outcome.got = outcome.from_holders
        if computing is not None:
            computed = computing.result()
            outcome.tainted += computed.tainted
            outcome.fences += computed.fences
            outcome.num_rounds += computed.num_rounds
            if outcome.from_holders == split:
                outcome.got, outcome.prefill_reused = computed.got, min(computed.reused, computed.got - split)
        return outcome

    def _from_holders(self, seq: Sequence, outcome: FetchOutcome, end: int, hits: dict[str, int], planned: str,
                      aborting: Callable[[], bool], trace_context: str = "") -> None:
        """The planned holder pushes its prefix into our blocks; after a failure, the next longest holder."""
        got = outcome.from_holders
        for node_id, length in sorted(hits.items(), key=lambda kv: (kv[0] != planned, -kv[1])):
            length = min(length, end)
            if length <= got or aborting():
                continue
            pushed = self._requester.push(node_id, seq.block_ids[got:length], seq.block_hashes[got:length],
                                          request_id=f"{seq.request_id}/hold", timeout_s=self._holder_timeout_s,
                                          trace_context=trace_context)
            self._links.record_transfer(node_id, pushed.num_written, pushed.write_s)
            outcome.tainted += pushed.tainted_block_ids
            outcome.fences.append(pushed.fence)
            outcome.num_rounds += pushed.num_rounds
            if pushed.error is not None:
                log.warning("holder %s for %s: %s", node_id, seq.request_id, pushed.error)
            if pushed.num_written or pushed.tainted_block_ids:
                outcome.from_holders = got + pushed.num_written
                outcome.holder = node_id
                return
