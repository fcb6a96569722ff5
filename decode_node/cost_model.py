"""What moving KV to this decode node costs, as measured: links, their bandwidth and round trips.

``TransferRateEstimator`` learns each peer's bandwidth and each link class's round trip from real
transfers (timed by the writer inside its transfer engine, so a prefill node's compute is not
counted); ``PeerLinks`` says which link a peer's pushes take (one copy into this node's
shared-memory KV buffer for a writer on this host, else the transfer engine) and prices it. The
planner (``planner.py``) turns these rates into plans; it never measures anything itself.
"""
from __future__ import annotations

from kvmesh.transfer.shared_memory import same_host_region

NETWORK = "network"  # link classes: pushes through the transfer engine ...
SHARED_MEMORY = "shared-memory"  # ... or by one copy into our memfd KV buffer (a writer on this host)


class TransferRateEstimator:
    """Bandwidth to each peer and the fetch round trip per link, learned from real transfers (exponentially
    weighted).

    Starts from a prior (``--transfer-gib-per-s``, ``--transfer-rtt-ms``; a link's round trip may be seeded
    by a start-up measurement, ``seed_round_trip``). Every transfer that moved at least ``min_bytes``
    updates its peer's bandwidth and its link class's (the first sample of each replaces what stood
    before), timed by the writer inside its transfer engine, so a prefill node's compute is not counted.
    A peer not measured yet is priced at its link class's rate, else the prior: a same-host peer writing
    through shared memory (~6 GiB/s here) says nothing about a network link (~1.3-3.8 GiB/s over
    loopback TCP, less between hosts), and the reverse. Every fetch from holders alone updates its
    link's round trip with what it cost beyond those bytes.
    """

    def __init__(self, prior_bytes_per_s: float, prior_rtt_s: float = 0.010, weight: float = 0.3,
                 min_bytes: int = 256 * 1024):
        self.prior_bytes_per_s = prior_bytes_per_s
        self.prior_rtt_s = prior_rtt_s
        self.weight = weight
        self.min_bytes = min_bytes
        self.num_samples = 0
        self.num_rtt_samples = 0
        self._by_peer: dict[str, float] = {}
        self._by_link: dict[str, float] = {}
        self._rtt_by_link: dict[str, float] = {}

    def bytes_per_s_to(self, peer: str = "", link: str = NETWORK) -> float:
        """What a transfer from ``peer`` (over ``link``) is expected to move per second."""
        return self._by_peer.get(peer) or self._by_link.get(link) or self.prior_bytes_per_s

    @property
    def bytes_per_s(self) -> float:
        """The network links' rate (the prior until one was measured)."""
        return self._by_link.get(NETWORK, self.prior_bytes_per_s)

    def by_link(self) -> dict[str, float]:
        return dict(self._by_link)

    def rtt_s_for(self, link: str = NETWORK) -> float:
        """A fetch's cost beyond its bytes over ``link``."""
        return self._rtt_by_link.get(link, self.prior_rtt_s)

    @property
    def rtt_s(self) -> float:
        """The network links' round trip."""
        return self.rtt_s_for(NETWORK)

    @property
    def min_rtt_s(self) -> float:
        """The cheapest round trip of any link (below it, no fetch can beat computing)."""
        return min([self.rtt_s_for(NETWORK), *self._rtt_by_link.values()])

    def rtt_by_link(self) -> dict[str, float]:
        return dict(self._rtt_by_link)

    def seed_round_trip(self, seconds: float, link: str) -> None:
        """A start-up measurement of ``link``'s round trip: replaces the prior until fetches are measured."""
        if seconds >= 0:
            self._rtt_by_link[link] = seconds

    def record_round_trip(self, seconds: float, link: str = NETWORK) -> None:
        """What one fetch cost beyond moving its bytes, end to end: from the decision to the KV being usable
        (exchanges, thread hops, the wait for an engine step boundary), less bytes / its bandwidth."""
        if seconds >= 0:
            old = self.rtt_s_for(link)
            self._rtt_by_link[link] = old + self.weight * (seconds - old)
            self.num_rtt_samples += 1

    def record_transfer(self, num_bytes: int, seconds: float, peer: str = "", link: str = NETWORK) -> None:
        if num_bytes < self.min_bytes or seconds <= 0:
            return
        rate = num_bytes / seconds
        for table, key in ((self._by_link, link), (self._by_peer, peer)):
            if key:
                old = table.get(key)
                table[key] = rate if old is None else old + self.weight * (rate - old)
        self.num_samples += 1


class PeerLinks:
    """Which link each peer's pushes take to this node, and what it costs (the estimator's rates)."""

    def __init__(self, rates: TransferRateEstimator, membership, shared_region, block_bytes: int):
        """``shared_region``: this node's shared-memory KV buffer (None: every peer is over the network)."""
        self.rates = rates
        self._membership = membership
        self._shared_region = shared_region
        self._block_bytes = block_bytes

    def link(self, node_id: str) -> str:
        """How ``node_id``'s pushes reach us: by one copy into our shared-memory KV buffer (a writer on this host)
        or through the transfer engine."""
        ours = self._shared_region
        if ours is None or same_host_region(self._membership.peer(node_id), ours.host) is None:
            return NETWORK
        return SHARED_MEMORY

    def bytes_per_s(self, node_id: str) -> float:
        return self.rates.bytes_per_s_to(node_id, self.link(node_id))

    def rtt_s(self, node_id: str) -> float:
        return self.rates.rtt_s_for(self.link(node_id))

    def record_transfer(self, node_id: str, num_blocks: int, write_s: float) -> None:
        self.rates.record_transfer(num_blocks * self._block_bytes, write_s, node_id, self.link(node_id))
