"""LLMEngine: requests in, tokens out, one batched forward per ``step``.

Scheduling here is deliberately simple (the continuous-batching scheduler with
prefix caching and preemption replaces it): a request is admitted only when
blocks for its whole prompt + max_tokens are free, so a running request never
runs out of blocks. Each step runs every running decode, then prompt chunks
FCFS within ``max_num_batched_tokens``.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from kvmesh.engine.block_allocator import SimpleBlockAllocator
from kvmesh.engine.model_runner import ModelRunner
from kvmesh.engine.outputs import CompletionOutput, RequestOutput
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.engine.sequence import Sequence
from kvmesh.errors import InvalidRequestError
from kvmesh.kv.kv_buffer import KVLayout
from kvmesh.model.loader import LoadedModel


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: as many as fit kv_cache_memory_gib
    kv_cache_memory_gib: float = 0.5
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_model_len: int | None = None  # None: the model's context length


class LLMEngine:
    def __init__(self, loaded: LoadedModel, config: EngineConfig):
        self.loaded = loaded
        self.config = config
        self.tokenizer = loaded.tokenizer
        self.max_model_len = min(config.max_model_len or loaded.config.max_position_embeddings,
                                 loaded.config.max_position_embeddings)
        self.layout = KVLayout.for_model(loaded.config, loaded.dtype, config.block_size,
                                         num_blocks=config.num_kv_blocks,
                                         memory_bytes=int(config.kv_cache_memory_gib * 2**30))
        self.allocator = SimpleBlockAllocator(self.layout.num_blocks)
        self.runner = ModelRunner(loaded.model, self.layout.allocate(loaded.device), config.block_size)
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self._ids = itertools.count()

    # ---- requests -------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None) -> Sequence:
        """Validate and queue a request; raises InvalidRequestError on bad input."""
        seq = self.prepare_request(prompt, params, request_id)
        self.waiting.append(seq)
        return seq

    def prepare_request(self, prompt: str | list[int], params: SamplingParams,
                        request_id: str | None = None) -> Sequence:
        """Tokenize and validate without queuing (so a batch can be checked whole first)."""
        if isinstance(prompt, str):
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, token_ids = None, [int(t) for t in prompt]
        self._validate(token_ids)
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device="cpu").manual_seed(params.seed)
        seq = Sequence(request_id or str(next(self._ids)), text, token_ids, params, generator)
        if self._blocks_needed(seq) > self.layout.num_blocks:
            raise InvalidRequestError(
                f"request {seq.request_id} needs {self._blocks_needed(seq)} KV blocks, the buffer has "
                f"{self.layout.num_blocks}: lower max_tokens or raise num_kv_blocks")
        return seq

    def _validate(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise InvalidRequestError("the prompt is empty")
        vocab = self.loaded.config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        if len(token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(token_ids)} tokens; the context is {self.max_model_len}, "
                "which leaves no room for a new token")

    def _final_length(self, seq: Sequence) -> int:
        return min(seq.num_prompt_tokens + seq.params.max_tokens, self.max_model_len)

    def _blocks_needed(self, seq: Sequence) -> int:
        return -(-self._final_length(seq) // self.config.block_size)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step --------------------------------------------------------------------------
    def _schedule(self) -> list[tuple[Sequence, int]]:
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            needed = self._blocks_needed(self.waiting[0])
            if not self.allocator.can_allocate(needed):
                break
            seq = self.waiting.pop(0)
            seq.block_ids = self.allocator.allocate(needed)
            self.running.append(seq)
        budget = self.config.max_num_batched_tokens
        batch: list[tuple[Sequence, int]] = []
        for seq in self.running:  # decodes first
            if seq.num_computed_tokens >= seq.num_prompt_tokens and budget > 0:
                batch.append((seq, 1))
                budget -= 1
        for seq in self.running:  # then prompt chunks, FCFS
            if seq.num_computed_tokens < seq.num_prompt_tokens and budget > 0:
                n = min(seq.num_uncomputed_tokens, budget)
                batch.append((seq, n))
                budget -= n
        return batch

    def step(self) -> list[Sequence]:
        """Run one forward; returns the sequences that finished in it (their blocks are freed)."""
        batch = self._schedule()
        if not batch:
            return []
        results = self.runner.execute(batch)
        finished = []
        for (seq, n), sampled in zip(batch, results):
            seq.num_computed_tokens += n
            if sampled is None:
                continue
            seq.output_token_ids.append(sampled.token_id)
            seq.cumulative_logprob += sampled.logprob
            self._check_stop(seq)
            if seq.is_finished:
                finished.append(seq)
        for seq in finished:
            self.running.remove(seq)
            self.allocator.free(seq.block_ids)
            seq.block_ids = []
        return finished

    def _check_stop(self, seq: Sequence) -> None:
        params, last = seq.params, seq.output_token_ids[-1]
        if last in params.stop_token_ids or (not params.ignore_eos and last in self.tokenizer.eos_token_ids):
            seq.finish_reason = "stop"
            return
        if params.stop:
            text = self.tokenizer.decode(seq.output_token_ids)
            cut = min((text.find(s) for s in params.stop if s in text), default=-1)
            if cut >= 0:
                seq.output_text = text[:cut]
                seq.finish_reason = "stop"
                return
        if len(seq.output_token_ids) >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            seq.finish_reason = "length"

    def to_output(self, seq: Sequence) -> RequestOutput:
        text = seq.output_text if seq.output_text is not None else self.tokenizer.decode(seq.output_token_ids)
        completion = CompletionOutput(0, text, list(seq.output_token_ids), seq.cumulative_logprob, seq.finish_reason)
        return RequestOutput(seq.request_id, seq.prompt, list(seq.prompt_token_ids), [completion], seq.is_finished)
