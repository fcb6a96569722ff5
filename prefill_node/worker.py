"""PrefillWorker: ``kvmesh prefill-node``.

For each PrefillRequest: local prefix hits first; then the global index: a
longer prefix held by a peer is pulled into this node's pool (the peer pushes
it); then the engine computes the rest with chunked prefill. Every full block is
cached as soon as it is computed, so the decode node's push request (sent at the
same time, by hash, with a wait) is served chunk by chunk as the prefill runs.
"""
from __future__ import annotations

import logging

from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.engine.sequence import Sequence
from kvmesh.kv.block_hash import hash_blocks
from kvmesh.kv.block_pool import NO_BLOCK
from kvmesh.node import messages as nm
from kvmesh.node.runtime import NodeRuntime
from kvmesh.transfer.errors import TransferError

log = logging.getLogger("kvmesh.prefill")
_PREFILL_ONLY = SamplingParams(max_tokens=1, temperature=0.0)


class PrefillWorker(NodeRuntime):
    def __init__(self, cfg):
        self._held: dict[str, list[int]] = {}  # request -> pulled blocks we keep a reference on
        self.num_prefills = 0
        self.tokens_pulled = 0
        super().__init__(cfg)  # starts the threads: our state must exist first

    def handle(self, identity: bytes, msg) -> None:
        if isinstance(msg, nm.PrefillRequest):
            self.workers.submit(self._prepare, msg)
        else:
            super().handle(identity, msg)

    def _prepare(self, msg: nm.PrefillRequest) -> None:
        """Worker thread: pull what a peer holds beyond our own prefix, then hand the prompt to the engine."""
        bs = self.cfg.block_size
        prompt = msg.prompt_token_ids
        hashes = hash_blocks(self.engine.kv.root_hash, prompt[: (len(prompt) - 1) // bs * bs], bs)
        local = self.pool.match(hashes)
        pulled: list[int] = []
        if len(local) < len(hashes):
            hits = self.lookup_holders(hashes)
            for node_id, length in sorted(hits.items(), key=lambda kv: -kv[1]):
                peer = self.peer(node_id)
                if length <= len(local) or peer is None:
                    continue
                try:
                    pulled = self.agent.pull_prefix(peer, hashes[len(local):length],
                                                    parent_block_id=local[-1] if local else NO_BLOCK,
                                                    timeout_s=self.cfg.prefill_timeout_s)
                    self.tokens_pulled += len(pulled) * bs
                    break
                except TransferError as e:
                    log.warning("%s: pulling from %s failed (%s); computing instead", self.cfg.node_id, node_id, e)
        self.call_soon(lambda: self._admit(msg, pulled))

    def _admit(self, msg: nm.PrefillRequest, pulled: list[int]) -> None:
        try:
            seq = self.engine.add_request(msg.prompt_token_ids, _PREFILL_ONLY, request_id=f"prefill:{msg.request_id}")
        except Exception as e:  # invalid prompt: nothing to compute; the decode node's push times out or falls back
            log.warning("%s: prefill %s refused: %s", self.cfg.node_id, msg.request_id, e)
            self.pool.free(pulled)
            return
        self._held[seq.request_id] = pulled
        self.num_prefills += 1

    def on_finish(self, seq: Sequence) -> None:
        self.pool.free(self._held.pop(seq.request_id, []))

    def role_stats(self) -> dict:
        return {"num_prefills": self.num_prefills, "tokens_pulled": self.tokens_pulled}
