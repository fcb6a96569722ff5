"""ChangeSignal: a counter that threads wait on until it moves.

The block pool bumps it whenever blocks become matchable; a holder serving pushes also bumps
it when it has new work, and its sender thread waits on it between rounds. A waiter passes
the value it last saw, so a bump between its check and its wait is never missed.
"""
from __future__ import annotations

import threading


class ChangeSignal:
    def __init__(self, lock: threading.RLock | threading.Lock | None = None):
        """``lock``: the lock the notifier may already hold (the pool's), shared so that a bump
        made under it needs no second lock."""
        self._cond = threading.Condition(lock or threading.RLock())
        self._generation = 0

    def notify(self) -> None:
        """Bump the counter and wake every waiter."""
        with self._cond:
            self._generation += 1
            self._cond.notify_all()

    def wait(self, seen_generation: int, timeout_s: float) -> int:
        """Block until the counter differs from ``seen_generation`` or ``timeout_s`` passes; returns it."""
        with self._cond:
            self._cond.wait_for(lambda: self._generation != seen_generation, timeout_s)
            return self._generation
