"""Measured rates that keep themselves current.

``RateMeter``: one rate (amount per second), an exponentially weighted average of
observations (a tier's read rate, a prefill node's rate as a decode node sees it).

``CostFit``: the seconds a piece of work takes as a fixed part plus a per-unit part,

    seconds(n) = fixed_s + n / per_s

fitted by exponentially weighted least squares. An engine step is such a cost: a
32-token prefill on a tiny model costs ~0.75 ms of which ~0.45 ms is the step itself
(launches, sampling, bookkeeping) paid whatever is computed. Dividing tokens by step
time (``RateMeter``) gives the average rate of the steps that happened to run, which
under-prices long prompts when the steps were short; decisions about computing *more*
tokens need the marginal rate ``per_s``.
"""
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


class CostFit:
    """``seconds(n) = fixed_s + n / per_s``, fitted to observations (exponentially weighted least squares).

    ``prior``: (amount, seconds) points measured once (a start-up probe at two sizes), worth
    ``prior_weight`` observations at first (a few odd first steps do not overturn the probe)
    and, as observations come, never less than ``prior_floor``: a run of same-sized
    observations (which says nothing about the slope) moves the fixed part and leaves the
    slope to the probe, while observations of varied sizes take over. Recent observations
    count most: each new one multiplies the weight of the earlier ones by ``decay``. An
    observation is clipped to within ``clip`` times the prediction first: the first step of
    a new shape (allocations, kernel set-up) can take twice as long as the next ones, and
    one such step must not make every long prompt look twice as dear.
    Not thread-safe: one thread records (the engine's), readers may see a slightly old fit.
    """

    def __init__(self, prior: list[tuple[float, float]], decay: float = 0.97, prior_weight: float = 16.0,
                 prior_floor: float = 2.0, clip: float = 1.25):
        if len(prior) < 2 or len({a for a, _ in prior}) < 2 or any(a <= 0 or s <= 0 for a, s in prior):
            raise ValueError(f"CostFit needs positive (amount, seconds) points at two amounts or more, got {prior}")
        self.decay = decay
        self.clip = clip
        self._prior = self._sums(prior, 1.0 / len(prior))  # at weight 1 in all, scaled by _prior_weight
        self._prior_weight, self._prior_floor = prior_weight, prior_floor
        self._live = (0.0, 0.0, 0.0, 0.0, 0.0)
        self.num_samples = 0
        self.fixed_s, self.per_s = self._fit()

    @staticmethod
    def _sums(points: list[tuple[float, float]], weight: float) -> tuple[float, float, float, float, float]:
        return (weight * len(points), weight * sum(a for a, _ in points), weight * sum(s for _, s in points),
                weight * sum(a * a for a, _ in points), weight * sum(a * s for a, s in points))

    def record(self, amount: float, seconds: float) -> None:
        """One observation: ``amount`` units of work took ``seconds``."""
        if amount <= 0 or seconds <= 0:
            return
        predicted = self.seconds(amount)
        seconds = min(max(seconds, predicted / self.clip), predicted * self.clip)
        w0, wa, ws, waa, was = (self.decay * x for x in self._live)
        self._live = (w0 + 1, wa + amount, ws + seconds, waa + amount * amount, was + amount * seconds)
        self._prior_weight = max(self._prior_floor, self._prior_weight * self.decay)
        self.num_samples += 1
        self.fixed_s, self.per_s = self._fit()

    def _fit(self) -> tuple[float, float]:
        w0, wa, ws, waa, was = (self._prior_weight * p + q for p, q in zip(self._prior, self._live))
        spread = w0 * waa - wa * wa  # w0^2 x the weighted variance of the amounts: > 0 thanks to the prior
        slope = (w0 * was - wa * ws) / spread
        fixed = (ws - slope * wa) / w0
        if slope <= 0:  # noise bigger than the size effect: the average rate, no fixed part
            return 0.0, wa / ws
        if fixed < 0:  # a line through the origin
            return 0.0, waa / was
        return fixed, 1.0 / slope

    def seconds(self, amount: float) -> float:
        """Predicted seconds for ``amount`` units, the fixed part included."""
        return self.fixed_s + amount / self.per_s
