"""The KV connectors every role composes: a node's own lower tiers, and the peers that hold a prefix in their caches.

Each offers what it can supply of a prompt and at what price (what the planner, ``planner.py``, weighs against
computing here), and loads into the block ids of a ``KVLease`` (``kvmesh/engine/kv_connector.py``): never the
pool, never the request itself. A decode node has a third, prefill nodes computing a prompt and pushing its
blocks (``decode_node/prefill_nodes.py``).
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import NamedTuple, Protocol

from kvmesh.engine.kv_connector import KVLease
from kvmesh.kv.tiers.tiered_cache import RestoreResult
from kvmesh.node.planner import HolderOption

log = logging.getLogger("kvmesh.decode")


class LinkPrices(Protocol):
    """What a holder's link costs as this node knows it (a decode node's measured ``PeerLinks``, a prefill node's
    priors), and where each transfer's measurement goes."""

    def bytes_per_s(self, node_id: str) -> float: ...

    def rtt_s(self, node_id: str) -> float: ...

    def record_transfer(self, node_id: str, num_blocks: int, seconds: float) -> None: ...


class TierOffer(NamedTuple):
    num_blocks: int  # blocks [start, start + num_blocks) are in this node's host or disk tier
    seconds: float  # reading them back into tier 0


class TierConnector:
    """This node's host and disk tiers (``tiers``: the ``TieredCache``, None where there are none)."""

    def __init__(self, tiers):
        self._tiers = tiers

    def offer(self, block_hashes: Sequence[bytes], start: int) -> TierOffer:
        """The run of blocks from ``start`` the lower tiers hold, and the seconds to read it (engine thread)."""
        if self._tiers is None:
            return TierOffer(0, 0.0)
        run = self._tiers.lower_run(block_hashes, start)
        return TierOffer(len(run), self._tiers.read_seconds(run) if run else 0.0)

    def load(self, lease: KVLease, start: int, end: int) -> RestoreResult:
        """Blocks [start, end) read into the lease's block ids (the leading ones that checked out)."""
        return self._tiers.restore(lease.block_hashes[start:end], lease.block_ids[start:end])


class HolderLoad(NamedTuple):
    got: int  # blocks [start, got) written by ``holder``
    holder: str  # "" when none wrote anything
    tainted: list[int]  # block ids a stalled writer may still write
    fences: list[str]  # per conversation, what fenced its writes
    num_rounds: int


class HolderConnector:
    """Peers whose caches hold a prompt's prefix (the global index's hits), each priced over its measured link:
    the planned holder pushes first, the next longest after a failure."""

    def __init__(self, requester, links: LinkPrices, membership, timeout_s: float):
        self._requester = requester
        self._links = links
        self._membership = membership
        self._timeout_s = timeout_s

    def offers(self, block_hashes: Sequence[bytes], hits: dict[str, int], start: int) -> tuple[HolderOption, ...]:
        """Each holder with more than ``start`` blocks, with its rate and round trip (``hits``: index hits by node,
        in blocks from the prompt's start)."""
        return tuple(HolderOption(node_id, length, self._bytes_per_s(block_hashes, node_id, start, length),
                                  self._links.rtt_s(node_id))
                     for node_id, length in hits.items() if length > start)

    def _bytes_per_s(self, block_hashes: Sequence[bytes], node_id: str, start: int, end: int) -> float:
        """A holder's link rate, or its disk's read rate where the blocks asked of it are on its disk tier."""
        rate = self._links.bytes_per_s(node_id)
        if end > start and self._membership.index.slowest_tier(block_hashes[start:end], node_id) == 2:
            disk_rate = self._membership.probe_of(node_id).disk_read_bytes_per_s
            if disk_rate > 0:
                rate = min(rate, disk_rate)
        return rate

    def load(self, lease: KVLease, start: int, end: int, hits: dict[str, int], planned: str,
             trace_context: str = "") -> HolderLoad:
        """Blocks [start, end) pushed by ``planned`` into the lease's block ids; after a failure that wrote
        nothing, by the next longest holder. Never raises for a peer's failure."""
        tainted, fences, rounds = [], [], 0
        for node_id, length in sorted(hits.items(), key=lambda kv: (kv[0] != planned, -kv[1])):
            length = min(length, end)
            if length <= start or lease.cancelled():
                continue
            pushed = self._requester.push(node_id, list(lease.block_ids[start:length]),
                                          list(lease.block_hashes[start:length]),
                                          request_id=f"{lease.request_id}/hold", timeout_s=self._timeout_s,
                                          trace_context=trace_context)
            self._links.record_transfer(node_id, pushed.num_written, pushed.write_s)
            tainted += pushed.tainted_block_ids
            fences.append(pushed.fence)
            rounds += pushed.num_rounds
            if pushed.error is not None:
                log.warning("holder %s for %s: %s", node_id, lease.request_id, pushed.error)
            if pushed.num_written or pushed.tainted_block_ids:
                return HolderLoad(start + pushed.num_written, node_id, tainted, fences, rounds)
        return HolderLoad(start, "", tainted, fences, rounds)
