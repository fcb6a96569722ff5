"""RecentRequests: the requests a router finished in the last minute, by where their prompt tokens came from.

``record`` is called once per finished request with the decode node's final stats; ``totals`` forgets what
is older than the window. Thread-safe (requests finish on many threads).
"""
from __future__ import annotations

import threading
import time
from collections import deque

from kvmesh.cluster.metrics import PROMPT_SOURCES


class RecentRequests:
    def __init__(self, window_s: float = 60.0, clock=time.monotonic):
        self.window_s = window_s
        self._clock = clock
        self._lock = threading.Lock()
        self._finished: deque[tuple[float, dict[str, int]]] = deque()

    def record(self, stats) -> None:
        """``stats``: the request's ``RequestStats``."""
        tokens = {name: getattr(stats, key) for key, name in PROMPT_SOURCES}
        with self._lock:
            self._finished.append((self._clock(), tokens))
            self._forget()

    def totals(self) -> dict:
        """{"window_s", "num_requests", "prompt_tokens": {source: tokens}} over the window."""
        with self._lock:
            self._forget()
            prompt_tokens = {name: sum(t[name] for _, t in self._finished) for _, name in PROMPT_SOURCES}
            return {"window_s": self.window_s, "num_requests": len(self._finished), "prompt_tokens": prompt_tokens}

    def _forget(self) -> None:
        horizon = self._clock() - self.window_s
        while self._finished and self._finished[0][0] < horizon:
            self._finished.popleft()
