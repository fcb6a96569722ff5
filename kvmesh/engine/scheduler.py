"""Scheduler: continuous batching with chunked prefill, prefix hits and preemption by recompute.

Each step spends a token budget (``max_num_batched_tokens``) in this order:

1. running decodes (one token each), oldest first; when blocks run out, the most
   recently admitted request is preempted (blocks freed, recomputed later; its own
   cached blocks usually make that cheap);
2. running prefills, the next chunk each (at most ``long_prefill_token_threshold``);
3. waiting requests, FCFS: prefix-cache hits are adopted and only the rest is
   scheduled, while at most ``max_num_partial_prefills`` requests are mid-prefill.

All status changes go through ``request_state.transition``.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

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

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1 or self.max_num_partial_prefills < 1:
            raise ValueError("scheduler limits must be >= 1")


@dataclass(slots=True)
class SchedulerOutput:
    batch: list[tuple[Sequence, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    num_batched_tokens: int = 0


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager):
        self.config = config
        self.kv = kv
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.awaiting_kv: dict[str, Sequence] = {}
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.awaiting_kv)

    # ---- one step ----------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled: set[int] = set()
        for seq in list(self.running):  # 1. decodes
            if budget == 0:
                break
            if seq.status is not RequestStatus.RUNNING or seq.is_prefilling:
                continue
            if self._make_room(seq, seq.num_computed_tokens + 1, scheduled, out):
                out.batch.append((seq, 1))
                scheduled.add(id(seq))
                budget -= 1
        for seq in self.running:  # 2. running prefill chunks
            if budget == 0:
                break
            if seq.is_prefilling and id(seq) not in scheduled:
                n = self._chunk(seq, budget)
                if self.kv.allocate(seq, seq.num_computed_tokens + n):
                    out.batch.append((seq, n))
                    scheduled.add(id(seq))
                    budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:  # 3. admit
            if sum(s.is_prefilling for s in self.running) >= self.config.max_num_partial_prefills:
                break
            seq = self.waiting[0]
            cached = self.kv.find_cached_prefix(seq) if seq.num_computed_tokens == 0 else []
            num_cached_tokens = len(cached) * self.kv.block_size
            n = min(seq.num_tokens - num_cached_tokens, budget, self._threshold())
            if not self.kv.allocate(seq, num_cached_tokens + n, cached):
                break
            if not seq.was_admitted:
                seq.was_admitted = True
                seq.num_prefix_hit_tokens = num_cached_tokens
                self.kv.stats.record_lookup(seq.num_prompt_tokens, num_cached_tokens)
            seq.num_computed_tokens = num_cached_tokens
            self.waiting.popleft()
            transition(seq, RequestStatus.RUNNING)
            self.running.append(seq)
            out.batch.append((seq, n))
            scheduled.add(id(seq))
            budget -= n
        out.num_batched_tokens = self.config.max_num_batched_tokens - budget
        return out

    def _threshold(self) -> int:
        return self.config.long_prefill_token_threshold or self.config.max_num_batched_tokens

    def _chunk(self, seq: Sequence, budget: int) -> int:
        return min(seq.num_tokens - seq.num_computed_tokens, budget, self._threshold())

    def _make_room(self, seq: Sequence, num_tokens: int, scheduled: set[int], out: SchedulerOutput) -> bool:
        """Allocate for ``seq``, preempting the newest unscheduled requests; False if ``seq`` itself went."""
        while not self.kv.allocate(seq, num_tokens):
            victim = next((s for s in reversed(self.running) if id(s) not in scheduled and s is not seq), None)
            self._preempt(victim or seq)
            out.preempted.append(victim or seq)
            if victim is None:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        transition(seq, RequestStatus.PREEMPTED)
        transition(seq, RequestStatus.WAITING)
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def advance(self, seq: Sequence, num_new_tokens: int) -> None:
        """After a forward: ``num_new_tokens`` more tokens of ``seq`` have K/V in its blocks."""
        seq.num_computed_tokens += num_new_tokens
        self.kv.cache_full_blocks(seq)

    def finish(self, seq: Sequence, status: RequestStatus) -> None:
        """End a request (FINISHED, FAILED or ABORTED) wherever it is; frees its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
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
        """The peer wrote KV for the first ``num_computed_tokens`` tokens: the request runs."""
        seq = self.awaiting_kv.pop(request_id)
        seq.num_computed_tokens = min(num_computed_tokens, seq.num_tokens - 1)
        self.kv.cache_full_blocks(seq)
        transition(seq, RequestStatus.RUNNING)
        self.running.append(seq)
        return seq
