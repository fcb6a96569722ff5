"""The connector seam: KV that reaches a request from outside this engine's compute.

A connector (this node's lower tiers, a peer holding the prefix, a prefill node computing it) never sees the
pool nor a request's ``Sequence``. The engine side, ``KVLoads``, allocates a request's blocks on the engine
thread and hands its load a ``KVLease``: the block ids it may write, the hashes and tokens they are for, and a
cancel flag. The load runs off the engine thread and ends with a ``LoadReport`` (how far the blocks arrived,
which ones a stalled writer may still write); the engine learns of it between two steps, swaps the blocks a
writer may still write for fresh ones before anyone reads them, and computes the request from the first block
that did not arrive. A load that raises reports nothing: the request is computed here.

Which connector supplies which blocks, at what price, is the planner's choice (``kvmesh/node/planner.py``),
made from the connectors' offers by the role that owns them; this module only moves leases and reports.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvmesh.engine.sequence import Sequence
from kvmesh.errors import OutOfBlocksError

if TYPE_CHECKING:
    from kvmesh.engine.engine import LLMEngine

log = logging.getLogger("kvmesh.engine")


@dataclass(frozen=True, slots=True)
class KVLease:
    """Blocks ``[start, end)`` of one request's block table, which its load may write until it reports; with
    ``tail``, block ``end`` too: the prompt's last block, which only a connector computing the whole prompt can
    supply. A report's ``got`` of ``end + 1`` lands its tokens but the last, which the request computes itself,
    or, for a greedy request (``SamplingParams.argmax_only``) whose report carries the token picked after the
    prompt (``first_token``), all of them: that token is streamed as the request's first and it decodes on.

    Immutable copies of what the load needs: the engine thread may change the request meanwhile (an abort),
    never these. ``cancelled()`` turns true when the request's caller went away: a load stops writing as soon
    as it can, and still reports."""

    request_id: str
    block_ids: tuple[int, ...]  # the request's whole block table (blocks before ``start`` are its own hits)
    block_hashes: tuple[bytes, ...]  # the chained hash of each full prompt block
    prompt_token_ids: tuple[int, ...]
    start: int
    end: int
    cache_salt: str = ""
    tail: bool = False
    _cancel: threading.Event = field(default_factory=threading.Event, repr=False, compare=False)

    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def cancel(self) -> None:
        self._cancel.set()


@dataclass(slots=True)
class LoadReport:
    """How a load ended: blocks ``[lease.start, got)`` hold the KV they were leased for (``got`` past the lease's
    ``end``: its tail too)."""

    got: int
    tainted: list[int] = field(default_factory=list)  # block ids a stalled writer may still write
    load_s: float = 0.0  # the load's own time (its wait for a step boundary is the engine's)
    first_token: tuple[int, float] | None = None  # with the tail: the greedy token after the prompt, its logprob


class KVLoads:
    """The engine side of the seam: one lease per request whose KV is loaded (engine thread, except ``run``).

    ``call_soon``: runs a function on the engine thread between two steps. ``on_landed(seq, report)``: engine
    thread, after the request's blocks are ready for the scheduler and a first token that came with them streamed
    (its accounting, an abort held back; a request that token ended is finished, its blocks freed)."""

    def __init__(self, engine: LLMEngine, call_soon: Callable[[Callable[[], None]], None],
                 on_landed: Callable[[Sequence, LoadReport], None]):
        self._engine = engine
        self._scheduler = engine.scheduler
        self._call_soon = call_soon
        self._on_landed = on_landed
        self._leases: dict[str, tuple[Sequence, KVLease]] = {}
        self.num_tainted_swapped = 0

    def start(self, seq: Sequence, end: int) -> KVLease | None:
        """Allocate every prompt block of ``seq`` (its own hits adopted) and lease blocks [hits, ``end``) to a
        load, and the prompt's last block after them where ``end`` reaches it and it holds more than the last token
        or the request is greedy (``KVLease.tail``); None (nothing allocated) when the pool has no room: the caller
        computes the request instead."""
        try:
            self._scheduler.add_awaiting_remote_kv(seq)
        except OutOfBlocksError:
            return None
        bs = self._scheduler.kv.block_size
        last = seq.num_prompt_tokens - 1
        lease = KVLease(seq.request_id, tuple(seq.block_ids), tuple(seq.block_hashes), tuple(seq.prompt_token_ids),
                        seq.num_prefix_hit_tokens // bs, end, seq.params.cache_salt or "",
                        tail=end == last // bs and (last % bs > 0 or seq.params.argmax_only))
        self._leases[seq.request_id] = (seq, lease)
        return lease

    def run(self, lease: KVLease, load: Callable[[], LoadReport], nothing: LoadReport | None = None) -> None:
        """A load's thread: run ``load`` and hand its report to the engine thread. A load that raises reports
        ``nothing`` (default: no block arrived; the request is computed here, its blocks freed as the request's)."""
        started = time.perf_counter()
        try:
            report = load()
        except Exception:
            log.exception("loading KV for %s failed", lease.request_id)
            report = nothing if nothing is not None else LoadReport(lease.start)
        report.load_s = time.perf_counter() - started
        self._call_soon(lambda: self._land(lease, report))

    def loading(self, request_id: str) -> bool:
        """Whether a load may still write the request's blocks (they are freed only after it reports)."""
        return request_id in self._leases

    def cancel(self, request_id: str) -> bool:
        """Ask the request's load to stop (it still reports); False when none is in flight."""
        entry = self._leases.get(request_id)
        if entry is not None:
            entry[1].cancel()
        return entry is not None

    def cancel_all(self) -> None:
        """Stop every load (the node is leaving; the thread that stopped the engine loop calls it)."""
        for _, lease in list(self._leases.values()):
            lease.cancel()

    def _land(self, lease: KVLease, report: LoadReport) -> None:
        seq, _ = self._leases.pop(lease.request_id)
        if report.tainted:  # a stalled writer may still write these: never let this request (or anyone) use them
            self.num_tainted_swapped += len(report.tainted)
            kv = self._scheduler.kv
            try:
                kv.replace_blocks(seq, report.tainted)
            except OutOfBlocksError:  # the pool is short while they are fenced: wait for blocks, do not fail
                tainted = set(report.tainted)
                kv.release_from(seq, next((i for i, b in enumerate(seq.block_ids) if b in tainted),
                                          len(seq.block_ids)))
        self._scheduler.remote_kv_ready(seq.request_id, report.got * self._scheduler.kv.block_size)
        if report.first_token is not None and report.got > lease.end and seq.params.argmax_only and \
                not lease.cancelled():
            self._engine.accept_first_token(seq, *report.first_token)
        self._on_landed(seq, report)

    @property
    def num_loading(self) -> int:
        return len(self._leases)
