"""RunAhead: decode steps launched one ahead of the host, on CUDA decode graphs.

A decode-only step of greedy rows is launched without waiting for its tokens (``ModelRunner.launch_decode``).
Before reading them, when the next step's batch is already known (the same requests, nothing waiting or
prefilling, each below its length limits, room in its blocks), that step is launched too, fed the first
one's tokens on the device. The device then computes step N + 1 while the host emits step N's tokens and
checks their stops. A request that stops at step N has computed one token too many in step N + 1, which is
dropped. The block each row of a step launched ahead writes is held (one more reference) until that step
is read, so a request ending meanwhile frees it only once the device is done with it: no other request,
nor a transfer landing outside the device's stream order, gets it while that write is pending.

At most one step is in flight between two engine steps (``in_flight``); the engine reads it first on its
next step, before scheduling anything.
"""
from __future__ import annotations

from collections.abc import Callable

from kvmesh.engine.kv_cache_manager import KVCacheManager
from kvmesh.engine.model_runner import InFlight, ModelRunner, SampledToken
from kvmesh.engine.request_state import RequestStatus
from kvmesh.engine.scheduler import Scheduler
from kvmesh.engine.sequence import Sequence
from kvmesh.kv.block_pool import BlockPool

Batch = list[tuple[Sequence, int]]
FinishStep = Callable[[Batch, dict, list], list[Sequence]]


class RunAhead:
    def __init__(self, runner: ModelRunner, scheduler: Scheduler, kv: KVCacheManager, pool: BlockPool,
                 max_model_len: int, enabled: bool):
        """``enabled``: the engine's choice (off with speculative decoding); without decode graphs nothing is
        ever launched."""
        self.runner, self.scheduler, self.kv, self.pool = runner, scheduler, kv, pool
        self.max_model_len = max_model_len
        self.enabled = enabled
        self.in_flight: InFlight | None = None  # a step launched ahead, not read yet

    def takes(self, batch: Batch) -> bool:
        """A scheduled batch to launch rather than run: decodes only, every row greedy without logprobs and
        sampling, a replayable size."""
        return self.enabled and self.runner.can_launch(len(batch)) and all(
            n == 1 and seq.num_computed_tokens + 1 == seq.num_tokens and seq.params.greedy and not seq.params.logprobs
            for seq, n in batch)

    def pop(self) -> InFlight | None:
        """The step in flight, now the caller's to ``finish``."""
        flight, self.in_flight = self.in_flight, None
        return flight

    def finish(self, flight: InFlight, finish_step: FinishStep) -> list[Sequence]:
        """Read a launched step and finish its live rows with ``finish_step`` (the engine's); first launch the
        step after it where that step's batch is known already. Returns the sequences that finished."""
        ahead = self._next_batch(flight)
        if ahead is not None:
            bs = self.kv.block_size
            held = [seq.block_ids[(seq.num_computed_tokens + 1) // bs] for seq, _ in ahead]
            self.pool.touch(held)
            try:
                launched = self.runner.launch_decode(ahead, ahead_of=flight)
            except Exception:
                self.pool.free(held)
                raise
            self.in_flight = launched._replace(held_block_ids=held)
        results = self._read(flight)
        live = [k for k, (seq, _) in enumerate(flight.batch) if seq.status is RequestStatus.RUNNING]
        finished = finish_step([flight.batch[k] for k in live], {}, [results[k] for k in live])
        self.drop_dead()
        return finished

    def abandon(self, flight: InFlight | None) -> Batch:
        """After a failure: give back what ``flight`` and the step in flight hold; returns the latter's rows
        (the caller fails them with the rest)."""
        rows: Batch = []
        for launched in (flight, self.in_flight):
            if launched is not None:
                self._release(launched)
        if self.in_flight is not None:
            rows, self.in_flight = self.in_flight.batch, None
        return rows

    def drop_dead(self) -> None:
        """A step in flight whose every row has ended is waited for and dropped (nothing in it to read)."""
        if self.in_flight is not None and \
                all(seq.status is not RequestStatus.RUNNING for seq, _ in self.in_flight.batch):
            self._read(self.pop())

    def _read(self, flight: InFlight) -> list[SampledToken]:
        """Wait for a launched step, read its tokens, give back the blocks held for it."""
        results = ModelRunner.collect(flight)
        self._release(flight)
        return results

    def _release(self, flight: InFlight) -> None:
        """Give back the blocks held for a launched step (once, however often called)."""
        if flight.held_block_ids:
            held = list(flight.held_block_ids)
            flight.held_block_ids.clear()
            self.pool.free(held)

    def _next_batch(self, flight: InFlight) -> Batch | None:
        """The batch of the step after ``flight`` when it can be launched before ``flight`` is read: every
        running request is a live row of it (nothing else running, nothing waiting), each can take two more
        tokens under its limits, and their blocks have room for the position after ``flight``'s."""
        if self.scheduler.waiting or self.scheduler.kv_landed:
            return None
        live = [(seq, 1) for seq, _ in flight.batch if seq.status is RequestStatus.RUNNING]
        if not live or len(live) != len(self.scheduler.running) or not self.runner.can_launch(len(live)):
            return None
        for seq, _ in live:
            if len(seq.output_token_ids) + 2 > seq.params.max_tokens or seq.num_tokens + 2 > self.max_model_len:
                return None
        if not all(self.kv.allocate(seq, seq.num_computed_tokens + 2) for seq, _ in live):
            return None
        return live
