"""Speculator: the engine's side of speculative decoding (which decodes get drafts, and the stats).

Each step, after scheduling, every decode of the batch may get up to ``num_speculative_tokens``
guesses from the proposer; the decode then becomes a verification of ``k + 1`` tokens in the
same forward (``ModelRunner.execute``). Guesses need room: the sequence's blocks are extended
to cover them when the pool has free blocks, and a decode is never preempted for a guess.
KV written for rejected guesses sits past ``num_computed_tokens`` in the sequence's own
(uncached, private) last blocks and is overwritten by the next step.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvmesh.engine.kv_cache_manager import KVCacheManager
from kvmesh.engine.sequence import Sequence
from kvmesh.engine.spec_decode.proposers import AdaptiveSpeculation, NgramProposer, Proposal, Proposer


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"  # "ngram" (prompt lookup) or "self-draft" (the target's first layers)
    num_speculative_tokens: int = 4
    draft_layers: int = 0  # self-draft: layers of the target the draft runs (0: a quarter of them)
    min_acceptance: float = 0.3  # below this (per request, over recent drafts) proposing pauses

    def __post_init__(self) -> None:
        if self.method not in ("ngram", "self-draft"):
            raise ValueError(f"unknown speculative method {self.method!r} (choose ngram or self-draft)")
        if self.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be >= 1")


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer | None = None):
        self.config = config
        self.adaptive = AdaptiveSpeculation(proposer or NgramProposer(), config.min_acceptance)
        self.num_drafted = 0
        self.num_accepted = 0
        self.num_verifications = 0

    def propose(self, batch: list[tuple[Sequence, int]], kv: KVCacheManager, max_model_len: int
                ) -> dict[int, Proposal]:
        """Drafts for the batch's decodes (index -> Proposal); rewrites those items to ``(seq, k + 1)``."""
        drafts: dict[int, Proposal] = {}
        for i, (seq, n) in enumerate(batch):
            if n != 1 or seq.num_uncomputed_tokens != 1:
                continue
            room = min(self.config.num_speculative_tokens, seq.params.max_tokens - len(seq.output_token_ids) - 1,
                       max_model_len - seq.num_tokens - 1)
            if room <= 0:
                continue
            if not kv.allocate(seq, seq.num_computed_tokens + 1 + room):  # room first: a draft may write K/V
                continue
            proposal = self.adaptive.propose(seq, room)
            k = len(proposal.token_ids)
            if k == 0:
                continue
            drafts[i] = proposal
            batch[i] = (seq, 1 + k)
        return drafts

    def record(self, seq: Sequence, num_drafted: int, num_accepted: int) -> None:
        seq.num_draft_tokens += num_drafted
        seq.num_accepted_tokens += num_accepted
        self.num_drafted += num_drafted
        self.num_accepted += num_accepted
        self.num_verifications += 1
        self.adaptive.record(seq, num_drafted, num_accepted)

    def forget(self, seq: Sequence) -> None:
        self.adaptive.forget(seq)

    def stats(self) -> dict:
        return {"spec_draft_tokens": self.num_drafted, "spec_accepted_tokens": self.num_accepted,
                "spec_verifications": self.num_verifications,
                "spec_acceptance": self.num_accepted / self.num_drafted if self.num_drafted else 0.0}
