"""RateMeter: a measured rate that keeps itself current (prefill tokens per second, ...)."""
from __future__ import annotations


class RateMeter:
    """A rate (tokens per second) kept as an exponentially weighted average of observations.

    Seeded with a prior (e.g. a start-up measurement or a peer's published rate); each
    observation of ``amount`` units in ``seconds`` moves it by ``weight``.
    """

    def __init__(self, prior_per_s: float, weight: float = 0.2, min_amount: float = 1.0):
        self.per_s = prior_per_s
        self.weight = weight
        self.min_amount = min_amount
        self.num_samples = 0

    def record(self, amount: float, seconds: float) -> None:
        if amount < self.min_amount or seconds <= 0:
            return
        self.per_s += self.weight * (amount / seconds - self.per_s)
        self.num_samples += 1
