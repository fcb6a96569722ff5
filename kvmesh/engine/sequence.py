"""Sequence: one request's tokens, its blocks and how much of it has KV in cache."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvmesh.engine.request_state import RequestStatus
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.kv.block_hash import BlockHash


@dataclass(slots=True, eq=False)
class Sequence:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None = None
    output_token_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in this sequence's blocks
    status: RequestStatus = RequestStatus.WAITING
    block_hashes: list[BlockHash] = field(default_factory=list)  # of every full block of its tokens
    num_cached_blocks: int = 0  # leading blocks registered in the prefix cache
    num_prefix_hit_tokens: int = 0  # tokens reused from the prefix cache at admission
    was_admitted: bool = False
    cumulative_logprob: float = 0.0
    output_logprobs: list[float] = field(default_factory=list)  # per output token
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # when params.logprobs
    output_text: str | None = None  # set when a stop string cut the text
    stop_strings: object = None  # a request with stop strings: its ``StopStrings`` (the engine's)
    finish_reason: str | None = None
    error: str = ""  # why a FAILED sequence failed
    arrival: int = 0  # the scheduler's arrival order (ties between equal priorities: earlier first)
    arrival_step: int = 0  # the scheduler step it arrived at (ageing)
    num_draft_tokens: int = 0  # speculative decoding: guesses verified for this request ...
    num_accepted_tokens: int = 0  # ... and how many of them were kept

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_final

    @property
    def is_prefilling(self) -> bool:
        """More than one token lacks K/V: a prompt (or, after preemption, a recompute) is in progress."""
        return self.num_tokens - self.num_computed_tokens > 1

    def token_at(self, position: int) -> int:
        """The token at ``position`` of prompt + output."""
        prompt_len = len(self.prompt_token_ids)
        if position < prompt_len:
            return self.prompt_token_ids[position]
        return self.output_token_ids[position - prompt_len]

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens ``[start, end)`` of prompt + output."""
        prompt_len = len(self.prompt_token_ids)
        if end <= prompt_len:
            return self.prompt_token_ids[start:end]
        if start >= prompt_len:
            return self.output_token_ids[start - prompt_len : end - prompt_len]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - prompt_len]
