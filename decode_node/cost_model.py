"""Where should a decode node's uncached prompt blocks come from? (docs/design.md §2)

Three sources beyond the node's own lower tiers (whose blocks the decode node promotes when
reading them back is faster than computing them, at their measured read rate), priced in
seconds with measured rates:

    local     compute them here                       tokens / local prefill rate
    holders   peers that already cache a prefix       round trip + bytes / bandwidth
    prefill   a prefill node computes and streams     round trip + max(tokens / its rate, bytes / bandwidth)
              the part no holder has                  (its chunks are sent while it computes)

Holders and the prefill node work at the same time; whatever is not fetched is computed
here. ``plan_fetch`` picks the cheapest plan, so the cluster never chooses to be slower
than computing locally (by its estimates, all measured: ``TransferRateEstimator`` for the
links, this node's marginal prefill rate (``CostFit``: a step's fixed cost is paid whether
or not more tokens join it), each prefill node's effective rate as this node sees it
(``RateMeter``, queueing included)). A prompt whose local estimate is below one round
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


def worth_a_lookup(num_tokens: int, local_tokens_per_s: float, rtt_s: float) -> bool:
    """False when computing ``num_tokens`` here takes less than one round trip (so no fetch can win)."""
    return num_tokens / max(local_tokens_per_s, 1e-9) > rtt_s


def plan_fetch(num_local: int, held_end: int, end: int, block_size: int, bytes_per_token: int, *,
               local_tokens_per_s: float, remote_tokens_per_s: float, bytes_per_s: float, rtt_s: float,
               have_prefill_node: bool, prefill_queue_s: float = 0.0) -> FetchPlan:
    """The cheapest way to get blocks ``[num_local, end)``; peers hold ``[num_local, held_end)``.

    ``prefill_queue_s``: how long the chosen prefill node needs for the work already sent to it.
    """
    if local_tokens_per_s <= 0 or bytes_per_s <= 0:
        raise ValueError("rates must be positive")
    held_end = max(num_local, min(held_end, end))

    def compute_here(blocks: int) -> float:
        return blocks * block_size / local_tokens_per_s

    def move(blocks: int) -> float:
        return blocks * block_size * bytes_per_token / bytes_per_s

    local = compute_here(end - num_local)
    plans = [FetchPlan(num_local, False, local, local)]
    if held_end > num_local:  # holders send their part while this node computes the rest
        plans.append(FetchPlan(held_end, False, max(rtt_s + move(held_end - num_local), compute_here(end - held_end)),
                               local))
    if have_prefill_node and remote_tokens_per_s > 0 and held_end < end:
        rest = end - held_end
        remote = rtt_s + prefill_queue_s + max(rest * block_size / remote_tokens_per_s, move(rest))
        plans.append(FetchPlan(held_end, True, max(rtt_s + move(held_end - num_local), remote), local))
    return min(plans, key=lambda p: p.seconds)


class TransferRateEstimator:
    """Bandwidth and round trip to peers, learned from real transfers (exponentially weighted).

    Starts from a prior (``--transfer-gib-per-s``, ``--transfer-rtt-ms``); every transfer that
    moved at least ``min_bytes`` updates the bandwidth (the first one replaces the prior),
    timed by the writer inside its transfer engine, so a prefill node's compute is not counted;
    every fetch from holders alone updates the round trip with what it cost beyond those bytes.
    """

    def __init__(self, prior_bytes_per_s: float, prior_rtt_s: float = 0.010, weight: float = 0.3,
                 min_bytes: int = 256 * 1024):
        self.bytes_per_s = prior_bytes_per_s
        self.rtt_s = prior_rtt_s
        self.weight = weight
        self.min_bytes = min_bytes
        self.num_samples = 0
        self.num_rtt_samples = 0

    def record_round_trip(self, seconds: float) -> None:
        """What one fetch cost beyond moving its bytes, end to end: from the decision to the KV being usable
        (exchanges, thread hops, the wait for an engine step boundary), less bytes / ``bytes_per_s``."""
        if seconds >= 0:
            self.rtt_s += self.weight * (seconds - self.rtt_s)
            self.num_rtt_samples += 1

    def record_transfer(self, num_bytes: int, seconds: float) -> None:
        if num_bytes < self.min_bytes or seconds <= 0:
            return
        rate = num_bytes / seconds
        if self.num_samples == 0:
            self.bytes_per_s = rate
        else:
            self.bytes_per_s += self.weight * (rate - self.bytes_per_s)
        self.num_samples += 1

