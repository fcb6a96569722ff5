"""Routing policies: which decode node serves a request (policy, apart from the router's mechanism).

A policy sees, for each live decode node, how long a prefix of the prompt the
global index says it holds and how loaded it is, and picks one. ``cache-aware``
scores cached tokens against load and keeps a multi-turn session on its node
unless that node is clearly more loaded than the best alternative;
``round-robin`` and ``random`` are the baselines.
"""
from __future__ import annotations

import itertools
import random
from collections import OrderedDict
from typing import NamedTuple, Protocol


class Candidate(NamedTuple):
    node_id: str
    cached_tokens: int  # prefix of this prompt the index says the node holds
    load: int  # requests in flight through this router to the node


class RoutingPolicy(Protocol):
    name: str

    def choose(self, candidates: list[Candidate], session_id: str = "") -> str:
        """The node id to use; ``candidates`` is non-empty."""


class RoundRobin:
    name = "round-robin"

    def __init__(self) -> None:
        self._next = itertools.count()

    def choose(self, candidates: list[Candidate], session_id: str = "") -> str:
        ordered = sorted(c.node_id for c in candidates)
        return ordered[next(self._next) % len(ordered)]


class RandomChoice:
    name = "random"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def choose(self, candidates: list[Candidate], session_id: str = "") -> str:
        return self._rng.choice(sorted(c.node_id for c in candidates))


class CacheAware:
    """score = cached_tokens - tokens_per_request * load; sessions stick within ``slack`` requests of load."""

    name = "cache-aware"

    def __init__(self, tokens_per_request: int = 256, slack: int = 2, max_sessions: int = 100_000) -> None:
        self.tokens_per_request = tokens_per_request
        self.slack = slack
        self._sessions: OrderedDict[str, str] = OrderedDict()
        self._max_sessions = max_sessions

    def choose(self, candidates: list[Candidate], session_id: str = "") -> str:
        best = max(candidates, key=lambda c: (c.cached_tokens - self.tokens_per_request * c.load, -c.load, c.node_id))
        if session_id:
            sticky = next((c for c in candidates if c.node_id == self._sessions.get(session_id)), None)
            if sticky is not None and sticky.load <= min(c.load for c in candidates) + self.slack:
                best = sticky
            self._sessions[session_id] = best.node_id
            self._sessions.move_to_end(session_id)
            while len(self._sessions) > self._max_sessions:
                self._sessions.popitem(last=False)
        return best.node_id


POLICIES = {p.name: p for p in (CacheAware, RoundRobin, RandomChoice)}


def make_policy(name: str) -> RoutingPolicy:
    if name not in POLICIES:
        raise ValueError(f"unknown routing policy {name!r} (choose from {', '.join(POLICIES)})")
    return POLICIES[name]()
