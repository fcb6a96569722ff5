"""Draft proposers for speculative decoding, behind one interface.

A proposer looks at a running sequence and guesses its next few tokens; the engine then
verifies the guesses in one batched forward of the target (``rejection.verify_drafts``).

- ``NgramProposer`` (prompt lookup): the longest suffix of the sequence (``max_ngram`` down to
  ``min_ngram`` tokens) that occurred earlier in it; the tokens that followed that earlier
  occurrence are the draft. No model, no state, deterministic (a point-mass draft).
- ``SelfDraftProposer`` (``self_draft.py``): the target's own first layers with its final norm
  and head, run token by token.

``AdaptiveSpeculation`` keeps per-request acceptance and stops proposing for a request whose
drafts are mostly rejected, so a workload where guessing fails costs (almost) nothing.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from kvmesh.engine.sequence import Sequence
from kvmesh.kv.block_hash import tokens_to_bytes


class Proposal(NamedTuple):
    token_ids: list[int]
    probs: torch.Tensor | None = None  # [len(token_ids), V] when the drafts were sampled, else None


class Proposer(Protocol):
    def propose(self, seq: Sequence, max_tokens: int) -> Proposal:
        """Up to ``max_tokens`` guesses of the tokens after ``seq``'s last one (empty: no guess)."""
        ...


@dataclass(frozen=True)
class NgramProposer:
    max_ngram: int = 4
    min_ngram: int = 2
    window: int = 4096  # search this many most recent tokens only

    def propose(self, seq: Sequence, max_tokens: int) -> Proposal:
        if max_tokens <= 0:
            return Proposal([])
        tokens = seq.token_ids(max(0, seq.num_tokens - self.window), seq.num_tokens)
        data = tokens_to_bytes(tokens)  # searched with bytes.rfind: the scan runs in C
        for n in range(min(self.max_ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            pattern = data[len(data) - 4 * n:]
            end = len(data) - 4  # the occurrence must end before the last token, so a follower exists
            while True:
                at = data.rfind(pattern, 0, end)
                if at < 0:
                    break
                if at % 4 == 0:  # token-aligned
                    start = at // 4 + n
                    return Proposal(tokens[start:start + max_tokens])
                end = at + len(pattern) - 1
        return Proposal([])


@dataclass(slots=True)
class _Acceptance:
    num_drafted: int = 0
    num_accepted: int = 0
    paused_until: int = 0  # the request's output length at which proposing resumes


class AdaptiveSpeculation:
    """Wraps a proposer: per request, pause proposing while recent acceptance is below ``min_acceptance``.

    After every ``window`` drafted tokens, a request whose acceptance over them was below the bar
    pauses for ``pause_tokens`` output tokens, then tries again (workloads change within a request).
    """

    def __init__(self, proposer: Proposer, min_acceptance: float = 0.3, window: int = 16, pause_tokens: int = 32,
                 max_requests: int = 65536):
        self.proposer = proposer
        self.min_acceptance = min_acceptance
        self.window = window
        self.pause_tokens = pause_tokens
        # Finished requests are forgotten; aborted or failed ones age out of this bound.
        self._by_request: OrderedDict[str, _Acceptance] = OrderedDict()
        self._max_requests = max_requests

    def propose(self, seq: Sequence, max_tokens: int) -> Proposal:
        state = self._by_request.get(seq.request_id)
        if state is not None and len(seq.output_token_ids) < state.paused_until:
            return Proposal([])
        return self.proposer.propose(seq, max_tokens)

    def record(self, seq: Sequence, num_drafted: int, num_accepted: int) -> None:
        state = self._by_request.setdefault(seq.request_id, _Acceptance())
        self._by_request.move_to_end(seq.request_id)
        if len(self._by_request) > self._max_requests:
            self._by_request.popitem(last=False)
        state.num_drafted += num_drafted
        state.num_accepted += num_accepted
        if state.num_drafted >= self.window:
            if state.num_accepted < self.min_acceptance * state.num_drafted:
                state.paused_until = len(seq.output_token_ids) + self.pause_tokens
            state.num_drafted = state.num_accepted = 0

    def forget(self, seq: Sequence) -> None:
        self._by_request.pop(seq.request_id, None)
