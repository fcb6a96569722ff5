"""Scheduler: continuous batching with chunked prefill, prefix hits and preemption by recompute.

Each step spends a token budget (``max_num_batched_tokens``) in this order:

1. running decodes (one token each), oldest first; when blocks run out, the least
   urgent request is preempted, the newest of them first (blocks freed, recomputed
   later; its own cached blocks usually make that cheap);
2. running prefills, the next chunk each (at most ``prompt_slice_tokens``: the prompt budget's slice or
   ``long_prefill_token_threshold``);
3. waiting requests by (effective priority, arrival): prefix-cache hits are adopted and
   only the rest is scheduled, while at most ``max_num_partial_prefills`` requests stay
   mid-prefill after the step (a prompt that fits in the step always may). A waiting
   request that finds no room preempts running requests strictly less urgent than it.

Priorities: ``SamplingParams.priority``, lower is more urgent (0 by default). Ageing
bounds starvation: every ``aging_steps`` scheduler steps a request waits, its effective
priority improves by one, so a request of priority p waits at most about
``(p - q) * aging_steps`` steps behind a stream of requests of priority q < p.

All status changes go through ``request_state.transition``.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Protocol

from kvmesh.engine.kv_cache_manager import KVCacheManager
from kvmesh.engine.request_state import RequestStatus, transition
from kvmesh.engine.sequence import Sequence
from kvmesh.errors import OutOfBlocksError


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    long_prefill_token_threshold: int = 0  # 0: a prefill chunk may take the whole budget
    max_num_partial_prefills: int = 4
    aging_steps: int = 256  # waiting this many steps makes a request one priority level more urgent

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1 or self.max_num_partial_prefills < 1 or \
                self.aging_steps < 1:
            raise ValueError("scheduler limits must be >= 1")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0 (0: a prompt may take a whole step)")


class PromptBudget(Protocol):
    """Policy: the prompt tokens a step may compute. A node slices prompts with it where streams decode beside
    them, and shortens steps while a fetch is about to land."""

    def prompt_tokens(self, num_decodes: int) -> int | None:
        """This step's prompt tokens beside its ``num_decodes`` decodes, at most (None: as the token budget
        allows)."""

    def prompt_slice(self) -> int | None:
        """One prompt's tokens per step, at most (0: the step's whole budget; None: the config's
        ``long_prefill_token_threshold``)."""


@dataclass(slots=True)
class SchedulerOutput:
    batch: list[tuple[Sequence, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    num_batched_tokens: int = 0


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, prompt_budget: PromptBudget | None = None):
        self.config = config
        self.kv = kv
        self.waiting: list[Sequence] = []  # sorted by ``_urgency`` at the start of every admission
        self.running: list[Sequence] = []
        self.awaiting_kv: dict[str, Sequence] = {}
        self.kv_landed: list[Sequence] = []  # remote KV written, waiting for a place among max_num_seqs
        self.num_preemptions = 0
        self.num_steps = 0
        self._arrivals = itertools.count()
        self.prompt_budget = prompt_budget  # None: no cap but the step's token budget

    def add(self, seq: Sequence) -> None:
        seq.arrival, seq.arrival_step = next(self._arrivals), self.num_steps
        self.waiting.append(seq)

    def _urgency(self, seq: Sequence) -> tuple[int, int]:
        """Sort key of waiting requests: effective priority (aged), then arrival."""
        aged = (self.num_steps - seq.arrival_step) // self.config.aging_steps
        return seq.params.priority - aged, seq.arrival

    def has_runnable(self) -> bool:
        """Work a step can do now (requests awaiting remote KV wait for their transfers, not for steps)."""
        return bool(self.waiting or self.running or self.kv_landed)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.awaiting_kv or self.kv_landed)

    # ---- one step ----------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self.num_steps += 1
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        while self.kv_landed and len(self.running) < self.config.max_num_seqs:  # 0. their KV arrived
            seq = self.kv_landed.pop(0)
            transition(seq, RequestStatus.RUNNING)
            self.running.append(seq)
        batch, block_size, running = out.batch, self.kv.block_size, RequestStatus.RUNNING
        prefilling: list[Sequence] = []
        for seq in list(self.running):  # 1. decodes (the steady state's whole step: kept to a few lookups a row)
            if budget == 0:
                break
            if seq.status is not running:
                continue
            lacking = len(seq.prompt_token_ids) + len(seq.output_token_ids) - seq.num_computed_tokens
            if lacking > 1:  # seq.is_prefilling
                prefilling.append(seq)
                continue
            # the new token's K/V fits the blocks it has (most steps), or blocks are found for it
            if seq.num_computed_tokens // block_size < len(seq.block_ids) or \
                    self._make_room(seq, seq.num_computed_tokens + 1, out):
                batch.append((seq, 1))
                budget -= 1
        cap = self.prompt_budget.prompt_tokens(len(out.batch)) if self.prompt_budget is not None else None
        prompt_room = budget if cap is None else min(budget, cap)  # prompt tokens this step may still compute
        for seq in prefilling:  # 2. running prefill chunks
            if prompt_room == 0:
                break
            if seq.status is running:  # (not preempted by a decode above)
                n = self._chunk(seq, prompt_room)
                if self.kv.allocate(seq, seq.num_computed_tokens + n):
                    out.batch.append((seq, n))
                    budget -= n
                    prompt_room -= n
        if not self.waiting:
            out.num_batched_tokens = self.config.max_num_batched_tokens - budget
            return out
        if len(self.waiting) > 1:
            self.waiting.sort(key=self._urgency)
        num_partial = self._num_partial_after(out.batch)
        while self.waiting and prompt_room > 0 and len(self.running) < self.config.max_num_seqs:  # 3. admit
            seq = self.waiting[0]
            cached = self.kv.find_cached_prefix(seq) if seq.num_computed_tokens == 0 else []
            num_cached_tokens = len(cached) * self.kv.block_size
            n = min(seq.num_tokens - num_cached_tokens, prompt_room, self._threshold())
            stays_partial = num_cached_tokens + n < seq.num_tokens
            if stays_partial and num_partial >= self.config.max_num_partial_prefills:
                break
            if not self.kv.allocate(seq, num_cached_tokens + n, cached):
                victim = self._least_urgent(set())
                if victim is None or victim.params.priority <= seq.params.priority:
                    break
                if any(s is victim for s, _ in out.batch):  # it leaves this step's batch too
                    budget += self._unschedule(victim, out)
                self._preempt(victim)  # a more urgent request takes its blocks; try again
                out.preempted.append(victim)
                self.waiting.sort(key=self._urgency)
                continue
            if not seq.was_admitted:
                seq.was_admitted = True
                seq.num_prefix_hit_tokens = num_cached_tokens
                self.kv.stats.record_lookup(seq.num_prompt_tokens, num_cached_tokens)
            seq.num_computed_tokens = num_cached_tokens
            self.waiting.pop(0)
            transition(seq, RequestStatus.RUNNING)
            self.running.append(seq)
            out.batch.append((seq, n))
            budget -= n
            prompt_room -= n
            num_partial += stays_partial
        out.num_batched_tokens = self.config.max_num_batched_tokens - budget
        return out

    def _num_partial_after(self, batch: list[tuple[Sequence, int]]) -> int:
        """Running requests still mid-prompt once this step's chunks are computed."""
        chunk = {id(seq): n for seq, n in batch}
        return sum(1 for s in self.running
                   if s.is_prefilling and s.num_computed_tokens + chunk.get(id(s), 0) < s.num_tokens)

    @property
    def prompt_slice_tokens(self) -> int:
        """One prompt's tokens per step, at most, as the prompt budget or else the config says (0: no cap)."""
        tokens = self.prompt_budget.prompt_slice() if self.prompt_budget is not None else None
        return self.config.long_prefill_token_threshold if tokens is None else tokens

    def _threshold(self) -> int:
        return self.prompt_slice_tokens or self.config.max_num_batched_tokens

    def _chunk(self, seq: Sequence, budget: int) -> int:
        return min(seq.num_tokens - seq.num_computed_tokens, budget, self._threshold())

    def _make_room(self, seq: Sequence, num_tokens: int, out: SchedulerOutput) -> bool:
        """Allocate for ``seq``, preempting less urgent unscheduled requests (then the newest of equals);
        when every other candidate is more urgent than ``seq``, ``seq`` itself goes (returns False)."""
        while not self.kv.allocate(seq, num_tokens):
            victim = self._least_urgent({id(s) for s, _ in out.batch} | {id(seq)})
            if victim is None or (victim.params.priority, victim.arrival) < (seq.params.priority, seq.arrival):
                victim = seq
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False
        return True

    @staticmethod
    def _unschedule(seq: Sequence, out: SchedulerOutput) -> int:
        """Take ``seq`` out of this step's batch; returns the tokens it had been given."""
        index = next(i for i, (s, _) in enumerate(out.batch) if s is seq)
        return out.batch.pop(index)[1]

    def _least_urgent(self, excluded: set[int]) -> Sequence | None:
        """The running request to preempt first: the highest priority value, the newest among equals."""
        candidates = [s for s in self.running if id(s) not in excluded]
        return max(candidates, key=lambda s: (s.params.priority, s.arrival), default=None)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        transition(seq, RequestStatus.PREEMPTED)
        transition(seq, RequestStatus.WAITING)
        self.waiting.insert(0, seq)
        self.num_preemptions += 1

    def advance(self, seq: Sequence, num_new_tokens: int) -> None:
        """After a forward: ``num_new_tokens`` more tokens of ``seq`` have K/V in its blocks."""
        seq.num_computed_tokens += num_new_tokens
        if seq.num_computed_tokens // self.kv.block_size > seq.num_cached_blocks:  # a block was completed
            self.kv.cache_full_blocks(seq)

    def finish(self, seq: Sequence, status: RequestStatus) -> None:
        """End a request (FINISHED, FAILED or ABORTED) wherever it is; frees its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.kv_landed:
            self.kv_landed.remove(seq)
        self.awaiting_kv.pop(seq.request_id, None)
        transition(seq, status)
        self.kv.free(seq)

    # ---- hooks for disaggregated serving ------------------------------------------------------------
    def add_awaiting_remote_kv(self, seq: Sequence) -> list[int]:
        """Allocate all prompt blocks of a request whose KV will be written by a peer.

        Local prefix hits are adopted; returns the indexes (into ``seq.block_ids``) of
        the blocks the peer must fill. Raises OutOfBlocksError (nothing allocated) when
        the pool is too full: the caller computes the request normally instead.
        """
        cached = self.kv.find_cached_prefix(seq)
        if not self.kv.allocate(seq, seq.num_prompt_tokens, cached):
            raise OutOfBlocksError(f"request {seq.request_id}: no room for {seq.num_prompt_tokens} remote tokens")
        seq.was_admitted = True
        seq.num_prefix_hit_tokens = len(cached) * self.kv.block_size
        seq.num_computed_tokens = seq.num_prefix_hit_tokens
        transition(seq, RequestStatus.WAITING_FOR_REMOTE_KV)
        self.awaiting_kv[seq.request_id] = seq
        return list(range(len(cached), len(seq.block_ids)))

    def remote_kv_ready(self, request_id: str, num_computed_tokens: int) -> Sequence:
        """The peer wrote KV for the first ``num_computed_tokens`` tokens: the request runs from the next
        step on which ``running`` has room for it (``max_num_seqs`` holds on this path too)."""
        seq = self.awaiting_kv.pop(request_id)
        seq.num_computed_tokens = min(num_computed_tokens, seq.num_tokens - 1)
        self.kv.cache_full_blocks(seq)
        self.kv_landed.append(seq)
        return seq
