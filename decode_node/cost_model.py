"""Where should a decode node's uncached prompt blocks come from? (docs/design.md §2)

Three sources beyond the node's own lower tiers (whose blocks the decode node promotes when
reading them back is faster than computing them, at their measured read rate), priced in
seconds with measured rates:

    local     compute them here                       the queue here + tokens / local prefill rate
    holders   peers that already cache a prefix       round trip + bytes / bandwidth (while the queue
                                                      here drains), then the rest here
    prefill   a prefill node computes and streams     its fixed cost + its queue + max(tokens / its rate,
              the part no holder has                  bytes / bandwidth) (chunks are sent as computed)

Holders and the prefill node work at the same time; whatever is not fetched is computed
here once the prefix has arrived. The queue here is the prompt tokens already waiting on
this node, so a busy decode node sends work out that an idle one computes itself.
``plan_fetch`` picks the cheapest plan, so the cluster never chooses to be slower
than computing locally (by its estimates, all measured: ``TransferRateEstimator`` for the
links, this node's marginal prefill rate (``CostFit``: a step's fixed cost is paid whether
or not more tokens join it), each prefill node's conversations as this node sees them (a
``CostFit`` too: a fixed part for the messaging, that node's step and the writes, plus the
tokens at its rate)). A prompt whose local estimate is below one round
trip never looks further (``worth_a_lookup``): no remote plan can beat it.
"""
from __future__ import annotations

from typing import NamedTuple


class FetchPlan(NamedTuple):
    holders_end: int  # fetch blocks [num_local, holders_end) from holders (== num_local: none)
    use_prefill: bool  # a prefill node computes and sends [holders_end, end)
    seconds: float  # the estimate of the plan
    local_seconds: float  # the estimate of computing everything here
    promote_end: int = -1  # blocks [num_local, promote_end) come back from this node's lower tiers (-1: none)


def worth_a_lookup(num_tokens: int, local_tokens_per_s: float, rtt_s: float, local_queue_s: float = 0.0) -> bool:
    """False when computing ``num_tokens`` here (after the queue here) takes less than one round trip, so no
    fetch can win."""
    return local_queue_s + num_tokens / max(local_tokens_per_s, 1e-9) > rtt_s


def plan_fetch(num_local: int, held_end: int, end: int, block_size: int, bytes_per_token: int, *,
               local_tokens_per_s: float, remote_tokens_per_s: float, bytes_per_s: float, rtt_s: float,
               have_prefill_node: bool, prefill_queue_s: float = 0.0,
               prefill_bytes_per_s: float | None = None, prefill_rtt_s: float | None = None,
               local_queue_s: float = 0.0, prefill_holds_prefix: bool = False) -> FetchPlan:
    """The cheapest way to get blocks ``[num_local, end)``; peers hold ``[num_local, held_end)``.

    ``bytes_per_s``, ``rtt_s``: the holder's link; ``prefill_bytes_per_s``, ``prefill_rtt_s``: the chosen
    prefill node's (default: the same). ``prefill_queue_s``: how long that prefill node needs for the work
    already sent to it; ``prefill_holds_prefix``: it caches ``[num_local, held_end)`` itself (else it pulls
    that from the holders first, as this node would); ``local_queue_s``: how long this node needs for the
    prompt tokens already queued here, which a fetch waits out meanwhile:

        local      queue here ─────────> compute [num_local, end)
        holders    fetch [num_local, held_end) ─┐
                   queue here ──────────────────┴─> compute [held_end, end)   (it attends to the prefix)
        prefill    fetch from holders ──────────┐
                   the prefill node: the prefix, then [held_end, end) ─┤
                   queue here ──────────────────┴─> done
    """
    prefill_bytes_per_s = prefill_bytes_per_s or bytes_per_s
    prefill_rtt_s = rtt_s if prefill_rtt_s is None else prefill_rtt_s
    if local_tokens_per_s <= 0 or bytes_per_s <= 0 or prefill_bytes_per_s <= 0:
        raise ValueError("rates must be positive")
    held_end = max(num_local, min(held_end, end))

    def compute_here(blocks: int) -> float:
        return blocks * block_size / local_tokens_per_s

    def move(blocks: int, rate: float = bytes_per_s) -> float:
        return blocks * block_size * bytes_per_token / rate

    local = local_queue_s + compute_here(end - num_local)
    plans = [FetchPlan(num_local, False, local, local)]
    from_holders = rtt_s + move(held_end - num_local) if held_end > num_local else 0.0
    if held_end > num_local:
        plans.append(FetchPlan(held_end, False, max(from_holders, local_queue_s) + compute_here(end - held_end),
                               local))
    if have_prefill_node and remote_tokens_per_s > 0 and held_end < end:
        rest = end - held_end
        its_prefix = 0.0 if prefill_holds_prefix else from_holders
        remote = prefill_rtt_s + prefill_queue_s + its_prefix + max(rest * block_size / remote_tokens_per_s,
                                                                    move(rest, prefill_bytes_per_s))
        plans.append(FetchPlan(held_end, True, max(from_holders, remote, local_queue_s), local))
    return min(plans, key=lambda p: p.seconds)


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
