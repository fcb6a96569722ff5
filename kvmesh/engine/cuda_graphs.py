"""DecodeGraphs: the decode forward captured as CUDA graphs, one per batch-size bucket.

A decode step of a small model is bound by kernel launches, not by the GPU: each of
its few hundred kernels costs a Python dispatch and a launch. A CUDA graph replays
the whole forward (embedding, every layer, the final norm, the logits) with one
launch. Everything a graph reads lives in persistent device buffers that each step
overwrites before the replay:

    input_ids, positions, slot_mapping   [B]        int64   (padding rows: slot -1, stores nothing)
    block_tables                         [B, W]     int32   (W: blocks of the longest context)
    seq_lens                             [B]        int32   (padding rows: 1, reads block 0, discarded)

The host fills one pinned int64 and one pinned int32 staging buffer and copies each
with one non-blocking copy. The decode attention's grid is fixed per bucket: its
split-K is sized from the context limit, not from the batch's longest context (a split
past a sequence's end has no keys and weighs nothing in the merge). A decode-only batch
replays the graph of the smallest bucket that holds it; mixed prefill/decode batches,
speculative verification and batches past the largest bucket run eagerly.

Captured once at start-up (``capture``); graphs share one memory pool, captured
largest first. ``CapturedForwards`` is the capture and replay every graph set shares
(``engine/prefill_graphs.py`` captures prompt steps with it); on a CPU buffer it replays
eagerly (``EagerReplay``), so the padded inputs and what the replay computes are tested
without a device.
"""
from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from kvmesh.kernels.attention_metadata import AttentionMetadata

log = logging.getLogger("kvmesh.engine")

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def buckets_for(max_num_seqs: int) -> list[int]:
    """The captured batch sizes: BUCKETS up to ``max_num_seqs`` (which is always one)."""
    chosen = [b for b in BUCKETS if b < max_num_seqs]
    return chosen + [max_num_seqs]


def bucket_for(buckets: Sequence[int], num_seqs: int) -> int | None:
    """The smallest bucket holding ``num_seqs`` rows (None: past the largest)."""
    i = bisect.bisect_left(buckets, num_seqs)
    return buckets[i] if i < len(buckets) else None


class Replay(Protocol):
    """A captured forward: ``replay()`` recomputes ``output`` from the persistent inputs as they are now."""

    output: torch.Tensor

    def replay(self) -> None: ...


def release_cublas_workspaces() -> None:
    """Free cuBLAS's per-stream workspaces, so that the next matmul allocates its own.

    A matmul takes a workspace allocated by the first matmul on its stream and freed by whoever clears them
    (torch.compile's CUDA graphs do, around every recording). A graph captured while using such a workspace keeps
    its address and writes into memory that is no longer its own once it is cleared: an illegal access when the
    allocator has released it, someone's tensor when not. Cleared just before a capture, the matmuls inside it
    allocate their workspace from the graphs' pool, which keeps it; cleared after, eager matmuls do not use it."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()


class CudaReplay:
    """A CUDA graph and the output tensor each replay overwrites. The graph owns every byte it writes: its
    intermediates and its cuBLAS workspace come from ``pool`` (``release_cublas_workspaces`` before and after)."""

    def __init__(self, forward: Callable[[], torch.Tensor], pool, stream: torch.cuda.Stream):
        self.graph = torch.cuda.CUDAGraph()
        release_cublas_workspaces()
        try:
            with torch.cuda.graph(self.graph, pool=pool, stream=stream):
                self.output = forward()
        finally:
            release_cublas_workspaces()

    def replay(self) -> None:
        self.graph.replay()


class EagerReplay:
    """What a graph would replay, run eagerly on the same persistent inputs and the metadata built once at
    capture: the capture logic where no CUDA graph exists (CPU tests)."""

    def __init__(self, forward: Callable[[], torch.Tensor]):
        self.forward = forward
        self.output = forward()

    def replay(self) -> None:
        self.output = self.forward()


class CapturedForwards:
    """A forward captured once per bucket (``_forward_for``), replayed by the subclass's ``run``.

    ``capture`` records every bucket, largest first, after two warm-up runs (Triton compiles outside the
    capture), into one memory pool (the engine passes one pool to all its graph sets); on a CPU KV buffer it
    makes ``EagerReplay``s instead, for tests."""

    kind = "forward"

    def __init__(self, model, kv_buffer: torch.Tensor, buckets: list[int]):
        self.model = model
        self.kv_buffer = kv_buffer
        self.buckets = buckets
        self._replays: dict[int, Replay] = {}
        self.capture_s = 0.0
        self.memory_bytes = 0
        self.num_replays = 0

    def _forward_for(self, bucket: int) -> Callable[[], torch.Tensor]:
        raise NotImplementedError

    @torch.inference_mode()
    def capture(self, pool=None) -> CapturedForwards:
        """Capture every bucket; logs how long it took and how much device memory the graphs hold."""
        device = self.kv_buffer.device
        started = time.perf_counter()
        if device.type != "cuda":
            self._replays = {b: EagerReplay(self._forward_for(b)) for b in reversed(self.buckets)}
            self.capture_s = time.perf_counter() - started
            return self
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved(device)
        pool = torch.cuda.graph_pool_handle() if pool is None else pool
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for bucket in reversed(self.buckets):
                forward = self._forward_for(bucket)
                for _ in range(2):
                    forward()
                self._replays[bucket] = CudaReplay(forward, pool, stream)
        torch.cuda.current_stream(device).wait_stream(stream)
        torch.cuda.synchronize(device)
        self.capture_s = time.perf_counter() - started
        torch.cuda.empty_cache()  # the warm-ups' memory goes back; the graphs' pool stays
        self.memory_bytes = torch.cuda.memory_reserved(device) - before
        log.info("captured %s CUDA graphs for %s in %.1f s, holding %.0f MiB", self.kind, self.buckets,
                 self.capture_s, self.memory_bytes / 2**20)
        return self

    def _replay(self, bucket: int) -> torch.Tensor:
        replay = self._replays[bucket]
        replay.replay()
        self.num_replays += 1
        return replay.output

    def describe(self) -> dict:
        return {"buckets": self.buckets, "capture_s": self.capture_s, "memory_bytes": self.memory_bytes,
                "num_replays": self.num_replays}


def stage_tables(tables, staged: list[list[int] | None], block_tables: list[list[int]]) -> None:
    """Write each row's block table into the pinned ``tables`` [rows, width] where it differs from what
    ``staged`` says the row holds (a step mostly repeats the last one's tables); entries past a table's
    length keep earlier ids (valid ids, never read). Raises ValueError for a table past the width."""
    width = tables.shape[1]
    for row, table in enumerate(block_tables):
        if staged[row] != table:
            if len(table) > width:
                raise ValueError(f"a block table of {len(table)} blocks is past the context limit")
            tables[row, : len(table)] = table
            staged[row] = list(table)


class StagingTurns:
    """Two staging sets of pinned host buffers, taken in turn by fills. On CUDA each set's copy to the device
    is followed by an event, and a set is handed out again only once that copy has run: a fill never
    rewrites host memory a pending copy still reads, whether or not anything synchronised since (a prompt
    step that samples no row does not)."""

    def __init__(self, sets: list, device: torch.device):
        self.sets = sets
        self.device = device
        self._events = [torch.cuda.Event() for _ in sets] if device.type == "cuda" else None
        self._recorded = [False] * len(sets)
        self._turn = 0

    def take(self):
        """The next set, once the copy out of it last time has run."""
        turn = self._turn
        if self._events is not None and self._recorded[turn]:
            self._events[turn].synchronize()
        return self.sets[turn]

    def copied(self) -> None:
        """After the copies out of the set ``take`` gave: mark them, and turn to the other set."""
        if self._events is not None:
            self._events[self._turn].record(torch.cuda.current_stream(self.device))
            self._recorded[self._turn] = True
        self._turn = (self._turn + 1) % len(self.sets)


class _Staging:
    """Pinned host buffers a fill writes and copies from, and what each of their table rows holds."""

    def __init__(self, max_batch: int, width: int, pin: bool):
        # int64 rows: input ids, positions, slots; int32 rows: seq lens, then the block tables.
        self.host64 = torch.zeros((3, max_batch), dtype=torch.int64, pin_memory=pin)
        self.host32 = torch.zeros(max_batch * (1 + width), dtype=torch.int32, pin_memory=pin)
        self.h64, self.h32 = self.host64.numpy(), self.host32.numpy()  # views of the pinned buffers
        self.tables = self.h32[max_batch:].reshape(max_batch, width)
        self.staged_tables: list[list[int] | None] = [None] * max_batch
        self.h64[2] = -1  # every row padding until filled
        self.h32[:max_batch] = 1
        self.num_filled = 0


class DecodeInputs:
    """Persistent, padded inputs of a decode forward (any device) and the metadata that reads them.

    Two staging sets take turns (``StagingTurns``), so a step can be filled while the copy out of the
    previous step's set may still be pending (a step launched before the previous one's tokens are read:
    the engine's run-ahead)."""

    def __init__(self, max_batch: int, max_model_len: int, block_size: int, device: torch.device):
        self.max_batch, self.max_model_len, self.block_size = max_batch, max_model_len, block_size
        self.width = -(-max_model_len // block_size)
        self.device = device
        pin = device.type == "cuda"
        self._staging = StagingTurns([_Staging(max_batch, self.width, pin) for _ in range(2)], device)
        self._dev64 = torch.zeros((3, max_batch), dtype=torch.int64, device=device)
        self._dev32 = torch.zeros(max_batch * (1 + self.width), dtype=torch.int32, device=device)
        self.input_ids, self.positions, self.slot_mapping = self._dev64[0], self._dev64[1], self._dev64[2]
        self.seq_lens = self._dev32[:max_batch]
        self.block_tables = self._dev32[max_batch:].view(max_batch, self.width)
        self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
        self.fill([], [], [], [])

    def fill(self, input_ids: list[int] | None, positions: list[int], block_tables: list[list[int]],
             seq_lens: list[int], num_rows: int | None = None, device_input_ids: torch.Tensor | None = None) -> None:
        """Write one step's rows (padding after them: slot -1, length 1) and copy them to the device
        (non-blocking on CUDA): ids, positions, slots and lengths of every row, block tables of the first
        ``num_rows`` rows (default: all; a replay of bucket ``B`` reads rows below ``B`` only).
        ``device_input_ids``: the rows' input ids already on the device (a previous step's picks, not yet
        seen by the host; ``input_ids`` is then None), copied in after the staged rows.

        Only what a row's attention reads is written, and only where it changed: a row whose table equals
        the one staged there last time is left as it is, and entries past a table's length keep earlier
        steps' block ids (valid ids, never read), so nothing is cleared per step."""
        st = self._staging.take()
        n, bs, width = len(positions), self.block_size, self.width
        rows = self.max_batch if num_rows is None else num_rows
        h64, h32 = st.h64, st.h32
        if n < st.num_filled:  # rows of the last step past this one's become padding
            h64[:2, n:st.num_filled] = 0
            h64[2, n:st.num_filled] = -1
            h32[n:st.num_filled] = 1
        st.num_filled = n
        if n:
            stage_tables(st.tables, st.staged_tables, block_tables)
            if input_ids is not None:
                h64[0, :n] = input_ids
            h64[1, :n] = positions
            h64[2, :n] = [table[pos // bs] * bs + pos % bs for table, pos in zip(block_tables, positions)]
            h32[:n] = seq_lens
        self._dev64.copy_(st.host64, non_blocking=True)
        end = self.max_batch + rows * width  # the lengths, then the first rows' tables
        self._dev32[:end].copy_(st.host32[:end], non_blocking=True)
        self._staging.copied()
        if device_input_ids is not None:
            self.input_ids[:n].copy_(device_input_ids)

    def metadata(self, batch: int) -> AttentionMetadata:
        """Metadata of the first ``batch`` rows, with fixed shapes (the grid is the bucket's, not the step's)."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:batch], block_tables=self.block_tables[:batch],
            seq_lens=self.seq_lens[:batch], query_start_loc=self.query_start_loc[: batch + 1], num_decodes=batch,
            max_query_len=1, max_seq_len=self.max_model_len, seq_lens_cpu=[self.max_model_len] * batch,
            query_lens_cpu=[1] * batch)


class DecodeGraphs(CapturedForwards):
    """The decode forward (embedding, layers, final norm, logits) per batch-size bucket."""

    kind = "decode"

    def __init__(self, model, kv_buffer: torch.Tensor, block_size: int, max_num_seqs: int, max_model_len: int):
        super().__init__(model, kv_buffer, buckets_for(max_num_seqs))
        self.inputs = DecodeInputs(self.buckets[-1], max_model_len, block_size, kv_buffer.device)

    def _forward_for(self, batch: int) -> Callable[[], torch.Tensor]:
        md = self.inputs.metadata(batch)

        def forward() -> torch.Tensor:
            md.per_step.clear()  # a replay is a new step (an eager one reads its own inputs, not the last one's)
            hidden = self.model(self.inputs.input_ids[:batch], self.inputs.positions[:batch], self.kv_buffer, md)
            return self.model.compute_logits(hidden)
        return forward

    def can_run(self, num_seqs: int) -> bool:
        return bool(self._replays) and bucket_for(self.buckets, num_seqs) is not None

    def run(self, input_ids: list[int] | None, positions: list[int], block_tables: list[list[int]],
            seq_lens: list[int], device_input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """One decode step by replay: logits [num_seqs, vocab] (a view of the graph's output: read it before
        the next replay). The input ids come from the host or, already on the device, as ``device_input_ids``."""
        batch = bucket_for(self.buckets, len(positions))
        self.inputs.fill(input_ids, positions, block_tables, seq_lens, num_rows=batch,
                         device_input_ids=device_input_ids)
        return self._replay(batch)[: len(positions)]
