"""DecodeWorker: ``kvmesh decode-node``.

For each GenerateRequest (DESIGN §2):
1. allocate the request's blocks; its own prefix hits need no transfer;
2. the uncached part: if it is short (cost model: compute time vs transfer time),
   compute it here; otherwise, in a worker thread, ask the peer that holds the
   longest prefix to push it, then send the rest to a prefill node and ask it to
   push the blocks by hash as they are computed (retrying another prefill node
   once if one fails);
3. whatever arrived, the request runs: the scheduler computes what is missing
   (at least the prompt's last partial block) and decodes with continuous batching,
   streaming tokens back. A failed or timed-out transfer only means more local work.
"""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass

import zmq

from kvmesh.decode_node.cost_model import local_prefill_limit
from kvmesh.engine.sequence import Sequence
from kvmesh.metadata.records import NodeRecord
from kvmesh.errors import KvmeshError, OutOfBlocksError
from kvmesh.node import messages as nm
from kvmesh.node.runtime import NodeRuntime
from kvmesh.transfer.errors import TransferError
from kvmesh.transfer.kv_agent import PeerInfo
from kvmesh.wire import encode

log = logging.getLogger("kvmesh.decode")


def _leading_true(flags: list[bool]) -> int:
    return flags.index(False) if False in flags else len(flags)


@dataclass(slots=True)
class _ClientRequest:
    """What the decode node keeps about one caller's request until it ends."""

    identity: bytes  # the caller's ZMQ identity, for streaming
    seq: Sequence
    fetch_started: float = 0.0  # when peers were asked for its KV
    fetching: bool = False  # peers may still be writing its blocks
    abort_after_fetch: bool = False
    tokens_from_peers: int = 0  # reused from other nodes' caches
    tokens_from_prefill: int = 0  # pushed by a prefill node
    kv_wait_s: float = 0.0


class DecodeWorker(NodeRuntime):
    def __init__(self, cfg):
        self._requests: dict[str, _ClientRequest] = {}  # engine thread only
        self._round_robin = itertools.count()
        self.num_remote = 0
        self.num_local = 0
        self.num_fallbacks = 0
        self.num_aborted = 0
        self.rtt_s = 0.005  # side-channel round trip assumed by the cost model
        super().__init__(cfg)  # starts the threads: our state must exist first

    # ---- admission (engine thread) ------------------------------------------------------------------
    def handle(self, identity: bytes, msg) -> None:
        if isinstance(msg, nm.GenerateRequest):
            self.call_soon(lambda: self._admit(identity, msg))
        elif isinstance(msg, nm.AbortRequest):
            self.call_soon(lambda: self._abort(msg.request_id))
        else:
            super().handle(identity, msg)

    def local_prefill_limit(self) -> int:
        """Uncached tokens worth computing here rather than fetching (DESIGN §2 cost model)."""
        if self.cfg.local_prefill_tokens >= 0:
            return self.cfg.local_prefill_tokens
        return local_prefill_limit(self.prefill_tokens_per_s, self.engine.layout.bytes_per_token,
                                   self.cfg.transfer_gib_per_s * 2**30, self.rtt_s)

    def _admit(self, identity: bytes, msg: nm.GenerateRequest) -> None:
        rid = msg.request_id
        if rid in self._requests:
            self.endpoint.send(identity, encode(nm.TokenEvent(rid, [], finished=True,
                                                              error=f"request id {rid!r} is already in use")))
            return
        try:
            seq = self.engine.prepare_request(msg.prompt_token_ids, msg.sampling_params(), request_id=rid)
        except Exception as e:  # any refusal must reach the caller, never leave it waiting
            error = str(e) if isinstance(e, (KvmeshError, ValueError, TypeError)) else f"{type(e).__name__}: {e}"
            self.endpoint.send(identity, encode(nm.TokenEvent(rid, [], finished=True, error=error)))
            return
        request = self._requests[rid] = _ClientRequest(identity, seq)
        local = self.engine.kv.find_cached_prefix(seq)
        bs = self.cfg.block_size
        fetchable_end = (seq.num_prompt_tokens - 1) // bs  # the last token is always computed here
        uncached = seq.num_prompt_tokens - len(local) * bs
        if fetchable_end <= len(local) or uncached <= self.local_prefill_limit():
            self.num_local += 1
            self.engine.scheduler.add(seq)
            return
        try:
            self.engine.scheduler.add_awaiting_remote_kv(seq)
        except OutOfBlocksError:
            self.num_local += 1
            self.engine.scheduler.add(seq)
            return
        self.num_remote += 1
        request.fetching, request.fetch_started = True, time.perf_counter()
        self.workers.submit(self._fetch, seq, seq.num_prefix_hit_tokens // bs, fetchable_end, msg.prefill_node)

    # ---- fetching (worker thread) -----------------------------------------------------------------------
    def _fetch(self, seq: Sequence, num_local: int, end: int, preferred: str) -> None:
        """Holders push the prefix they have while a prefill node computes the rest (overlapped)."""
        got = from_holders = num_local
        try:
            hits = self.lookup_holders(seq.block_hashes[:end])
            tried: set[str] = set()
            prefill = None
            if max(hits.values(), default=0) < end:  # some blocks exist nowhere: start computing them now
                prefill = self._start_prefill(seq, preferred, tried)
            got = from_holders = self._fetch_from_holders(seq, got, end, hits)
            while got < end and (prefill is not None or len(tried) < 2):
                prefill = prefill or self._start_prefill(seq, preferred, tried)
                if prefill is None:
                    break
                got = self._fetch_from_prefill(seq, got, end, prefill)
                prefill = None
        except Exception:
            log.exception("%s: fetching KV for %s failed", self.cfg.node_id, seq.request_id)
        finally:
            self.call_soon(lambda: self._kv_arrived(seq, num_local, from_holders, got))

    def _fetch_from_holders(self, seq: Sequence, got: int, end: int, hits: dict[str, int]) -> int:
        """A peer (any role) already holding a longer prefix pushes it straight away."""
        for node_id, length in sorted(hits.items(), key=lambda kv: -kv[1]):
            peer = self.peer(node_id)
            if length <= got or peer is None:
                continue
            try:
                written = self.agent.request_push(peer, seq.block_ids[got:length], seq.block_hashes[got:length],
                                                  request_id=f"{seq.request_id}:hold", timeout_s=5.0)
                return got + _leading_true(written)
            except TransferError as e:
                log.warning("%s: holder %s failed: %s", self.cfg.node_id, node_id, e)
        return got

    def _start_prefill(self, seq: Sequence, preferred: str, tried: set[str]) -> NodeRecord | None:
        """Send the prompt to a prefill node not tried yet (the preferred one first); None if none is left."""
        candidates = sorted(n for n, r in self.directory.nodes.items() if r.role == "prefill" and n not in tried)
        if not candidates:
            return None
        node_id = preferred if preferred in candidates else candidates[next(self._round_robin) % len(candidates)]
        record = self.directory.nodes[node_id]
        tried.add(node_id)
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.linger = 1000
        try:
            sock.connect(f"tcp://{record.request_endpoint}")
            sock.send(encode(nm.PrefillRequest(seq.request_id, list(seq.prompt_token_ids))))
        finally:
            sock.close()
        return record

    def _fetch_from_prefill(self, seq: Sequence, got: int, end: int, record: NodeRecord) -> int:
        """Ask the prefill node to push blocks ``[got, end)`` as it computes them."""
        timeout = self.cfg.prefill_timeout_s
        try:
            written = self.agent.request_push(PeerInfo(record.node_id, record.side_channel),
                                              seq.block_ids[got:end], seq.block_hashes[got:end],
                                              request_id=f"{seq.request_id}:{record.node_id}", timeout_s=timeout,
                                              wait_ms=int(timeout * 1000))
            return got + _leading_true(written)
        except TransferError as e:
            self.num_fallbacks += 1
            log.warning("%s: prefill node %s failed for %s: %s", self.cfg.node_id, record.node_id,
                        seq.request_id, e)
            return got

    # ---- back on the engine thread --------------------------------------------------------------------------
    def _kv_arrived(self, seq: Sequence, num_local: int, from_holders: int, got: int) -> None:
        """Blocks [num_local, from_holders) came from peers' caches, [from_holders, got) from a prefill node."""
        bs = self.cfg.block_size
        request = self._requests[seq.request_id]
        request.fetching = False
        request.kv_wait_s = time.perf_counter() - request.fetch_started
        request.tokens_from_peers = (from_holders - num_local) * bs
        request.tokens_from_prefill = (got - from_holders) * bs
        self.engine.scheduler.remote_kv_ready(seq.request_id, got * bs)
        if request.abort_after_fetch:
            self._abort(seq.request_id)

    def _abort(self, request_id: str) -> None:
        """Stop a request whose caller went away; its blocks are freed (after any transfer into them)."""
        request = self._requests.get(request_id)
        if request is None:
            return
        if request.fetching:  # peers may still be writing its blocks: free them afterwards
            request.abort_after_fetch = True
            return
        del self._requests[request_id]
        if not request.seq.is_finished:
            self.engine.abort(request.seq)
            self.num_aborted += 1

    def on_token(self, seq: Sequence, token_id: int) -> None:
        request = self._requests.get(seq.request_id)
        if request is not None and not seq.is_finished:
            self.endpoint.send(request.identity, encode(nm.TokenEvent(seq.request_id, [token_id])))

    def on_finish(self, seq: Sequence) -> None:
        request = self._requests.pop(seq.request_id, None)
        if request is None:
            return
        remote, from_prefill = request.tokens_from_peers, request.tokens_from_prefill
        stats = {"tokens_reused_local": seq.num_prefix_hit_tokens, "tokens_reused_remote": remote,
                 "tokens_from_prefill_node": from_prefill,
                 "tokens_computed": seq.num_prompt_tokens - seq.num_prefix_hit_tokens - remote - from_prefill,
                 "kv_wait_ms": request.kv_wait_s * 1e3}
        self.endpoint.send(request.identity, encode(nm.TokenEvent(seq.request_id, [], finished=True,
                                                                  finish_reason=seq.finish_reason or "",
                                                                  stats=stats)))

    def role_stats(self) -> dict:
        return {"num_remote": self.num_remote, "num_local": self.num_local, "num_fallbacks": self.num_fallbacks,
                "num_aborted": self.num_aborted,
                "local_prefill_limit": self.local_prefill_limit()}

