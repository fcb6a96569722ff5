"""ChangeSignal: a counter that threads wait on until it moves.

A holder serving pushes bumps it when it has new work (a message, a finished write, blocks its
node cached), and its watcher thread waits on it between rounds. A waiter passes
the value it last saw, so a bump between its check and its wait is never missed.
"""
from __future__ import annotations

import threading


class ChangeSignal:
    def __init__(self):
        self._cond = threading.Condition()
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
