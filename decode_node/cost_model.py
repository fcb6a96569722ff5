"""When should a decode node compute an uncached suffix itself? (docs/design.md §2)

Computing ``n`` tokens here costs ``n / prefill_rate``; having them computed
elsewhere and moved costs a round trip plus ``n * bytes_per_token / bandwidth``.
Both per-token costs are linear, so the answer is a token count: compute locally
up to the break-even length, fetch beyond it.
"""
from __future__ import annotations


def local_prefill_limit(prefill_tokens_per_s: float, bytes_per_token: int, transfer_bytes_per_s: float,
                        round_trip_s: float) -> int:
    """The largest uncached suffix (in tokens) that is cheaper to compute here than to fetch."""
    if prefill_tokens_per_s <= 0 or transfer_bytes_per_s <= 0:
        raise ValueError("rates must be positive")
    per_token_compute = 1 / prefill_tokens_per_s
    per_token_transfer = bytes_per_token / transfer_bytes_per_s
    if per_token_compute <= per_token_transfer:
        return 1 << 30  # computing beats moving the bytes at any length
    return int(round_trip_s / (per_token_compute - per_token_transfer))


class TransferRateEstimator:
    """Bandwidth and round trip to peers, learned from real transfers (exponentially weighted).

    Starts from a prior (``--transfer-gib-per-s``; round trip 5 ms); every transfer that
    moved at least ``min_bytes`` updates the bandwidth (the first one replaces the prior),
    timed by the writer inside its transfer engine, so a prefill node's compute is not counted.
    """

    def __init__(self, prior_bytes_per_s: float, prior_rtt_s: float = 0.005, weight: float = 0.3,
                 min_bytes: int = 256 * 1024):
        self.bytes_per_s = prior_bytes_per_s
        self.rtt_s = prior_rtt_s
        self.weight = weight
        self.min_bytes = min_bytes
        self.num_samples = 0

    def record_transfer(self, num_bytes: int, seconds: float) -> None:
        if num_bytes < self.min_bytes or seconds <= 0:
            return
        rate = num_bytes / seconds
        if self.num_samples == 0:
            self.bytes_per_s = rate
        else:
            self.bytes_per_s += self.weight * (rate - self.bytes_per_s)
        self.num_samples += 1
