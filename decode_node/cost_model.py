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
