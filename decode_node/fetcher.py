"""Carrying out a plan: this node's lower tiers, a holder's push and a prefill node's conversation, overlapped.

``Fetcher.fetch`` runs on a worker thread for one request whose plan needs peers (``FetchPlan.needs_fetch``),
into the block ids of its ``KVLease`` (``kvmesh/engine/kv_connector.py``), through the three connectors:

    blocks  [0, num_local)            our own hits
            [num_local, promoted)     restored from our own lower tiers (``TierConnector``)
            [promoted, from_holders)  pushed by the planned holder (others that hold as much, if it fails:
                                      ``HolderConnector``)
            [from_holders, got)       computed and pushed by a prefill node (the planned one first: ``PrefillNodes``),
                                      asked at the same time as the holder: usable only if the holder delivered
                                      all of its part (a stale index leaves a gap, which this node computes)

and returns a ``FetchOutcome``: the lease's report (how far blocks arrived, which ones a stalled writer may still
write) and where each block came from, which the decode role turns into its accounting.
"""
from __future__ import annotations

from concurrent.futures import Executor
from dataclasses import dataclass, field

from kvmesh.node.connectors import HolderConnector, TierConnector
from kvmesh.decode_node.prefill_nodes import PrefillNodes
from kvmesh.engine.kv_connector import KVLease, LoadReport
from kvmesh.node.planner import FetchPlan


@dataclass(slots=True)
class FetchOutcome(LoadReport):
    num_local: int = 0  # blocks we had in tier 0
    promoted: int = 0  # blocks [num_local, promoted) restored from our own lower tiers
    from_holders: int = 0  # blocks [promoted, from_holders) came from a peer's cache; [from_holders, got) from a
    #                        prefill node
    prefill_reused: int = 0  # of those, leading blocks the prefill node had cached (not computed for us)
    num_host: int = 0
    num_disk: int = 0
    promote_s: float = 0.0
    asked_prefill: bool = False  # a prefill node was asked for blocks [from_holders, end)
    holder: str = ""  # the peer that sent blocks [promoted, from_holders)
    fences: list[str] = field(default_factory=list)  # what fenced each conversation's writes (holders', prefill's)
    num_rounds: int = 0  # conversations in all (landing rounds included)

    @classmethod
    def nothing(cls, num_local: int) -> FetchOutcome:
        return cls(got=num_local, num_local=num_local, promoted=num_local, from_holders=num_local)


class Fetcher:
    def __init__(self, tiers: TierConnector, holders: HolderConnector, prefill_nodes: PrefillNodes,
                 conversations: Executor, block_size: int):
        """``conversations``: where prefill conversations run beside the fetch that waits for them (never the
        fetch's own pool: no deadlock)."""
        self._block_size = block_size
        self._tiers = tiers
        self._holders = holders
        self._prefill_nodes = prefill_nodes
        self._conversations = conversations

    def fetch(self, lease: KVLease, plan: FetchPlan, hits: dict[str, int], trace_context: str = "") -> FetchOutcome:
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
                computing = self._conversations.submit(self._prefill_nodes.compute_and_push, lease, split, end,
                                                       order, plan.local_cost, reserved, trace_context)
            except BaseException:
                self._prefill_nodes.release(*reserved)  # the conversation never starts: nor does its count
                raise
        if plan.promote_end > start:  # our own lower tiers (while the prefill node computes)
            restored = self._tiers.load(lease, start, plan.promote_end)
            outcome.promoted = outcome.from_holders = outcome.got = start + restored.num_blocks
            outcome.num_host, outcome.num_disk, outcome.promote_s = restored.num_host, restored.num_disk, \
                restored.seconds
        # The planned holder (or, where the tiers fell short, any that holds the gap).
        pushed = self._holders.load(lease, outcome.from_holders, split, hits, plan.holder, trace_context)
        outcome.from_holders, outcome.holder = pushed.got, pushed.holder
        outcome.tainted += pushed.tainted
        outcome.fences += pushed.fences
        outcome.num_rounds += pushed.num_rounds
        outcome.got = outcome.from_holders
        if computing is not None:
            computed = computing.result()
            outcome.tainted += computed.tainted
            outcome.fences += computed.fences
            outcome.num_rounds += computed.num_rounds
            if outcome.from_holders == split:
                outcome.got, outcome.prefill_reused = computed.got, min(computed.reused, computed.got - split)
                outcome.first_token = computed.first_token
        return outcome
