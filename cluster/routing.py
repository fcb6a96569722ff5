"""Routing policies: which decode node serves a request (policy, apart from the router's mechanism).

A policy sees, for each live decode node, how long a prefix of the prompt the
global index says it holds, how loaded it is, the prompt tokens already queued
there and the node's measured compute (a decode step, a marginal prefill rate
per token), and picks one. ``cache-aware`` predicts the time to
first token on each node and takes the soonest:

    requests decoding there x step cost  +  the node's own plan for the prompt  +  its last tokens / rate

where the plan is what that decode node's planner (``kvmesh/node/planner.py``) would estimate
for it: the prompts queued there (a node that slices prompts computes each beside the new one, so each
delays it by about what it computes meanwhile, not by all of it), then its uncached blocks computed there
or fetched from the nodes the index says hold them (a fetch into a node priced at what fetches into it
have cost, end to end, as the router saw them: ``cluster/fetch_costs.py``),

(every request in flight there delays a new one by about one decode step: measured,
a hit's first token comes ~0.6 ms later per request in flight on the tiny preset,
~15 ms on SmolLM2 at one thread, each about the node's probed decode step), so a
cached prefix wins exactly while computing it elsewhere would take longer than
waiting for it;
it keeps a multi-turn session on its node unless that node is clearly more
loaded. ``round-robin`` and ``random`` are the baselines.
"""
from __future__ import annotations

import itertools
import random
from collections import OrderedDict
from typing import NamedTuple, Protocol

from kvmesh.node.planner import HolderOption, PlanRequest, plan_fetch, prompt_tokens_ahead


class Candidate(NamedTuple):
    node_id: str
    cached_tokens: int  # prefix of this prompt the index says the node holds
    load: int  # requests in flight through this router to the node
    prompt_tokens: int = 0  # this prompt's length
    queued: tuple[int, ...] = ()  # uncached tokens of each prompt routed to the node whose first token is to come
    prefill_tokens_per_s: float = 0.0  # the node's measured marginal prefill rate (its registry record); 0: unknown
    step_s: float = 0.0  # the node's measured decode step of one sequence (its registry record); 0: unknown
    holders: tuple[HolderOption, ...] = ()  # other nodes holding a prefix of this prompt (blocks), to fetch from
    block_size: int = 16
    bytes_per_block: int = 0  # the node's KV bytes per block (its record); 0: unknown, no fetch is priced
    prompt_tokens_per_step: int = 0  # the node's prompt slice (its record); 0: prompts computed one after another

    def predicted_ttft_s(self) -> float:
        """Seconds until this prompt's first token here, beyond one step: a step per request decoding there, then
        the node's own plan for the prompt (its queue, fetches, computing), then its last tokens (rate known).
        Its queue: the tokens the node computes for the prompts ahead before this one is done, where each of
        them, sliced, advances beside it (``prompt_tokens_ahead``)."""
        rate, bs = self.prefill_tokens_per_s, self.block_size
        end = max(0, (self.prompt_tokens - 1) // bs)  # the blocks a decode node plans (the last token: computed)
        num_local = min(self.cached_tokens // bs, end)
        held = max([num_local, *(min(h.end, end) for h in self.holders)]) if self.bytes_per_block > 0 else num_local
        own = max(0, self.prompt_tokens - max(self.cached_tokens, held * bs))  # the least it computes itself
        queue_s = prompt_tokens_ahead(list(self.queued), self.prompt_tokens_per_step, own) / rate
        decoding = max(0, self.load - len(self.queued))  # a request still computing its prompt is in the queue
        if not self.holders or self.bytes_per_block <= 0 or end <= num_local:
            return decoding * self.step_s + queue_s + max(0, self.prompt_tokens - self.cached_tokens) / rate
        plan = plan_fetch(PlanRequest(num_local, end, bs, self.bytes_per_block // bs, rate, queue_s,
                                      holders=self.holders))
        return decoding * self.step_s + plan.seconds + (self.prompt_tokens - end * bs) / rate


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
    """The soonest predicted first token (rates known), else cached_tokens - tokens_per_request * load;
    sessions stick within ``slack`` requests of load."""

    name = "cache-aware"

    def __init__(self, tokens_per_request: int = 256, slack: int = 2, max_sessions: int = 100_000) -> None:
        self.tokens_per_request = tokens_per_request
        self.slack = slack
        self._sessions: OrderedDict[str, str] = OrderedDict()
        self._max_sessions = max_sessions

    def choose(self, candidates: list[Candidate], session_id: str = "") -> str:
        if all(c.prefill_tokens_per_s > 0 for c in candidates):
            best = min(candidates, key=lambda c: (c.predicted_ttft_s(), c.load, c.node_id))
        else:
            best = max(candidates, key=lambda c: (c.cached_tokens - self.tokens_per_request * c.load, -c.load,
                                                  c.node_id))
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
