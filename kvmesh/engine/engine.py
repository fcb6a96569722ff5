"""LLMEngine: requests in, tokens out, one batched forward per ``step``.

Owns the KV buffer, the block pool (prefix cache), the scheduler and the model
runner. ``step`` = schedule -> forward -> advance -> stop checks -> free. On CUDA decode graphs, greedy
decode steps run one ahead of the host (``engine/run_ahead.py``): a step launched ahead is read first.
"""
from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from kvmesh.engine.kv_cache_manager import KVCacheManager
from kvmesh.engine.model_runner import ModelRunner, SampledToken
from kvmesh.engine.outputs import CompletionOutput, RequestOutput
from kvmesh.engine.pinned_prefixes import PinnedPrefix, PinnedPrefixes
from kvmesh.engine.request_state import RequestStatus
from kvmesh.engine.run_ahead import RunAhead
from kvmesh.engine.sampler import NON_FINITE
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.engine.scheduler import PromptBudget, Scheduler, SchedulerConfig
from kvmesh.engine.sequence import Sequence
from kvmesh.engine.spec_decode.speculator import SpeculativeConfig, Speculator
from kvmesh.engine.stop_strings import StopStrings
from kvmesh.errors import InvalidRequestError, KvmeshError
from kvmesh.kv.block_hash import HashNamespace, hash_blocks
from kvmesh.kv.block_pool import BlockPool
from kvmesh.kv.eviction import POLICIES
from kvmesh.kv.kv_buffer import KVLayout
from kvmesh.kv.shared_buffer import SharedKVAllocator
from kvmesh.model.loader import LoadedModel

log = logging.getLogger("kvmesh.engine")


class StepFailed(KvmeshError, RuntimeError):
    """An engine step raised; ``failed`` are the requests of that batch, now FAILED and freed."""

    def __init__(self, message: str, failed: list[Sequence]):
        super().__init__(message)
        self.failed = failed


# Prompt-step graphs must reproduce the eager forward's hidden states on a probe step at least this closely
# (cosine similarity of every row; rounding alone stays far above it, a wrong input or mask far below).
PREFILL_GRAPH_MIN_AGREEMENT = 0.99


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: as many as fit kv_cache_memory_gib
    kv_cache_memory_gib: float = 0.5
    max_model_len: int | None = None  # None: the model's context length
    enable_prefix_caching: bool = True
    eviction_policy: str = "tail-first-lru"
    cache_salt: str = ""
    track_pool_changes: bool = False  # nodes that publish to the global index drain the pool's change log
    scheduler: SchedulerConfig = SchedulerConfig()
    speculative: SpeculativeConfig | None = None  # None: no speculative decoding
    enforce_eager: bool = False  # on CUDA: no CUDA graphs (kvmesh/engine/cuda_graphs.py, prefill_graphs.py)
    decode_graphs: bool = True  # on CUDA, unless eager: decode steps' graphs too (an engine that never decodes: off)
    run_ahead: bool = True  # with decode graphs: launch the next decode step before reading this one's tokens


@dataclass(frozen=True)
class EngineHooks:
    """Who hears of the engine's work, on the thread that steps it: every sampled token (``on_token(seq, token_id)``)
    and every step that computed prompt tokens (``on_prefill_step(num_tokens, seconds)``: the whole step)."""

    on_token: Callable[[Sequence, int], None] | None = None
    on_prefill_step: Callable[[int, float], None] | None = None


class LLMEngine:
    def __init__(self, loaded: LoadedModel, config: EngineConfig, kv_allocator: SharedKVAllocator | None = None,
                 prompt_budget: PromptBudget | None = None, hooks: EngineHooks = EngineHooks()):
        """``kv_allocator``: allocates the KV cache in shared memory (nodes: for same-host peers,
        ``kvmesh/kv/shared_buffer.py``); used only when the model is on the CPU. Default: ``torch.zeros``, or at
        tensor-parallel size > 1 on the CPU an allocator of the engine's own (the ranks map the buffer).
        ``prompt_budget``: the scheduler's cap on a step's prompt tokens (a node's ``LandingBound``; none: the
        step's token budget only). ``hooks``: told of tokens and prompt steps (a node's accounting; none by default),
        except inside ``unobserved``."""
        self.loaded = loaded
        self.config = config
        self.tokenizer = loaded.tokenizer
        self.max_model_len = min(config.max_model_len or loaded.config.max_position_embeddings,
                                 loaded.config.max_position_embeddings)
        # With tensor parallelism the model sizes the buffer: every KV head where its ranks share one (the CPU), else
        # rank 0's heads.
        self.layout = KVLayout.for_model(getattr(loaded.model, "kv_config", loaded.model.config), loaded.dtype,
                                         config.block_size,
                                         num_blocks=config.num_kv_blocks,
                                         memory_bytes=int(config.kv_cache_memory_gib * 2**30))
        if config.eviction_policy not in POLICIES:
            raise ValueError(f"unknown eviction policy {config.eviction_policy!r} (choose from {', '.join(POLICIES)})")
        self.pool = BlockPool(self.layout.num_blocks, POLICIES[config.eviction_policy](),
                              track_changes=config.track_pool_changes)
        self.namespace = HashNamespace.for_model(loaded.fingerprint, config.block_size,
                                                 str(loaded.dtype).removeprefix("torch."),
                                                 cache_salt=config.cache_salt)
        self.kv = KVCacheManager(self.pool, config.block_size, self.namespace.root(), config.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.kv, prompt_budget)
        on_host = torch.device(loaded.device).type == "cpu"
        shares_kv = getattr(loaded.model, "shares_kv", False)
        self._own_allocator = SharedKVAllocator() if shares_kv and kv_allocator is None else None
        kv_allocator = kv_allocator or self._own_allocator
        kv_buffer = kv_allocator.allocate(self.layout.shape, self.layout.dtype) if kv_allocator is not None and on_host \
            else self.layout.allocate(loaded.device)
        if shares_kv:
            loaded.model.attach_kv(kv_buffer, kv_allocator.region)
            if self._own_allocator is not None:  # mapped by every rank: the fd is no longer needed
                self._own_allocator.close()
        self.runner = ModelRunner(loaded.model, kv_buffer, config.block_size)
        if kv_buffer.is_cuda and not config.enforce_eager and loaded.tp_size == 1:  # tensor parallel: eager
            self._capture_graphs()
        self.pins = PinnedPrefixes(self.pool)
        self.speculator = None
        if config.speculative is not None:
            proposer = None
            if config.speculative.method == "self-draft":
                from kvmesh.engine.spec_decode.self_draft import SelfDraftProposer

                proposer = SelfDraftProposer(loaded.model, self.runner.kv_buffer, config.block_size,
                                             config.speculative.draft_layers)
            self.speculator = Speculator(config.speculative, proposer)
        self._ids = itertools.count()
        self.run_ahead = RunAhead(self.runner, self.scheduler, self.kv, self.pool, self.max_model_len,
                                  enabled=config.run_ahead and self.speculator is None)
        self.num_steps = 0
        self.hooks = hooks
        self._observed = True  # False inside ``unobserved``

    def _capture_graphs(self) -> None:
        """CUDA graphs of decode steps for every batch size up to ``max_num_seqs`` and of prompt steps per token
        bucket, in one memory pool. A capture that fails, or prompt graphs that disagree with the eager forward
        on a probe step, leave that kind of step eager (logged), never broken."""
        from kvmesh.engine.cuda_graphs import DecodeGraphs
        from kvmesh.engine.prefill_graphs import PrefillGraphs

        pool = torch.cuda.graph_pool_handle()
        sched, kv_buffer = self.config.scheduler, self.runner.kv_buffer
        try:
            if self.config.decode_graphs:
                self.runner.graphs = DecodeGraphs(self.loaded.model, kv_buffer, self.config.block_size,
                                                  sched.max_num_seqs, self.max_model_len).capture(pool)
        except Exception as e:  # an op that cannot be captured: correct, only slower
            log.warning("decode CUDA graphs could not be captured (%s: %s); decoding eagerly", type(e).__name__, e)
            self.runner.graphs = None
        try:
            graphs = PrefillGraphs(self.loaded.model, kv_buffer, self.config.block_size, sched.max_num_batched_tokens,
                                   sched.max_num_seqs, self.max_model_len).capture(pool)
            agreement = graphs.agreement_with_eager(self.layout.num_blocks)
        except Exception as e:
            log.warning("prompt-step CUDA graphs could not be captured (%s: %s); prompts run eagerly",
                        type(e).__name__, e)
            return
        if agreement is not None and agreement < PREFILL_GRAPH_MIN_AGREEMENT:
            log.warning("prompt-step CUDA graphs disagree with the eager forward on a probe step (cosine %.4f); "
                        "prompts run eagerly", agreement)
            return
        self.runner.prefill_graphs = graphs

    # ---- requests -------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None) -> Sequence:
        """Validate and queue a request; raises InvalidRequestError on bad input."""
        seq = self.prepare_request(prompt, params, request_id)
        self.scheduler.add(seq)
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
        final_len = min(seq.num_prompt_tokens + params.max_tokens, self.max_model_len)
        if -(-final_len // self.config.block_size) > self.layout.num_blocks:
            raise InvalidRequestError(
                f"request {seq.request_id} needs {-(-final_len // self.config.block_size)} KV blocks, the buffer "
                f"has {self.layout.num_blocks}: lower max_tokens or raise num_kv_blocks")
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

    def pin_prefix(self, prompt: str | list[int]) -> PinnedPrefix:
        """Keep this prompt's full blocks cached (pinned) from now on, including blocks computed later.

        Raises InvalidRequestError for a prompt shorter than one block."""
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        self._validate(token_ids + [0])  # the prompt itself may fill the context: pinning adds no token
        hashes = hash_blocks(self.kv.root_hash, token_ids, self.config.block_size)
        if not hashes:
            raise InvalidRequestError(f"a pinned prefix needs at least {self.config.block_size} tokens "
                                      f"(one full block), got {len(token_ids)}")
        return self.pins.pin(hashes)

    def unpin_prefix(self, pin_id: str) -> bool:
        return self.pins.unpin(pin_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self.run_ahead.in_flight is not None

    def abort(self, seq: Sequence) -> None:
        if not seq.is_finished:
            self.scheduler.finish(seq, RequestStatus.ABORTED)
            self.run_ahead.drop_dead()

    # ---- one step --------------------------------------------------------------------------
    @contextmanager
    def unobserved(self) -> Iterator[None]:
        """Steps inside report to no hook: a node's start-up probes (their tokens are no client's, their steps no
        measure of serving)."""
        self._observed = False
        try:
            yield
        finally:
            self._observed = True

    def step(self) -> list[Sequence]:
        """Run one forward; returns the sequences that finished in it (their blocks are freed), FAILED ones (a
        row of non-finite logits) among them with ``error`` set."""
        flight = self.run_ahead.pop()
        if flight is not None:
            batch = flight.batch
        else:
            out = self.scheduler.schedule()
            if not out.batch:
                return []
            batch = out.batch
        try:
            if flight is None and self.run_ahead.takes(batch):
                flight = self.runner.launch_decode(batch)
            if flight is not None:
                return self.run_ahead.finish(flight, self.finish_step)
            drafts = {} if self.speculator is None else self.speculator.propose(batch, self.kv, self.max_model_len)
            return self._run_batch(batch, drafts)
        except Exception as e:  # fail exactly this batch's requests; the engine goes on with the rest
            batch = batch + self.run_ahead.abandon(flight)  # the same requests may sit in two launched steps
            failed = list({id(seq): seq for seq, _ in batch if not seq.is_finished}.values())
            for seq in failed:
                seq.finish_reason = "error"
                self.scheduler.finish(seq, RequestStatus.FAILED)
            raise StepFailed(f"engine step failed: {type(e).__name__}: {e}", failed) from e

    def _run_batch(self, batch, drafts: dict | None = None) -> list[Sequence]:
        drafts = drafts or {}
        started = time.perf_counter()
        results = self.runner.execute(batch, drafts)
        on_prefill_step = self.hooks.on_prefill_step if self._observed else None
        if on_prefill_step is not None and any(n > 1 and i not in drafts for i, (_, n) in enumerate(batch)):
            on_prefill_step(sum(n for _, n in batch), time.perf_counter() - started)
        return self.finish_step(batch, drafts, results)

    def finish_step(self, batch, drafts: dict, results: list) -> list[Sequence]:
        """After a forward: emit the sampled tokens, advance and finish sequences; returns those finished.

        Called by ``step`` (and by ``kvmesh bench step``, which times the runner's phases itself)."""
        self.num_steps += 1
        finished = []
        on_token = self.hooks.on_token if self._observed else None
        advance = self.scheduler.advance
        for i, ((seq, n), sampled) in enumerate(zip(batch, results)):
            if sampled is None:  # a chunk short of the prompt's end
                advance(seq, n)
                continue
            if drafts and i in drafts:  # a verification: the kept guesses, then the target's token
                self.speculator.record(seq, len(drafts[i].token_ids), len(sampled) - 1)
                outcome = self._emit_verified(seq, sampled, on_token)
            elif sampled.token_id == NON_FINITE:
                outcome = RequestStatus.FAILED
            else:
                outcome = RequestStatus.FINISHED if self._emit(seq, sampled, on_token) else None
                advance(seq, n)
            if outcome is RequestStatus.FAILED:  # this request's logits broke: it alone fails
                seq.finish_reason, seq.error = "error", "the model produced non-finite logits for this request"
            if outcome is not None:
                self.scheduler.finish(seq, outcome)
                finished.append(seq)
        if self.speculator is not None:
            for seq in finished:
                self.speculator.forget(seq)
        self.pins.refresh()
        return finished

    def accept_first_token(self, seq: Sequence, token_id: int, logprob: float) -> bool:
        """Engine thread, between steps: ``seq``'s whole prompt's KV landed (all but its last token counted
        computed, ``Scheduler.remote_kv_ready``) with the token a prefill node picked greedily after it: stream it as
        the first token (stop checks included) and count the last token computed, so the request decodes on from
        it. True when that token ended the request (finished, its blocks freed)."""
        if seq.output_token_ids or seq.num_computed_tokens != seq.num_prompt_tokens - 1:
            raise ValueError(f"request {seq.request_id}: a first token needs the prompt's KV landed and no output")
        if self._emit(seq, SampledToken(token_id, logprob, []), self.hooks.on_token if self._observed else None):
            self.scheduler.finish(seq, RequestStatus.FINISHED)
            return True
        seq.num_computed_tokens = seq.num_prompt_tokens
        self.kv.cache_full_blocks(seq)
        return False

    def _emit_verified(self, seq: Sequence, tokens: list, on_token) -> RequestStatus | None:
        """Emit a verification's tokens until one ends ``seq``; advance it by those emitted (the step computed
        K/V for its last token and each kept guess: one per emitted token). FINISHED or FAILED when it ends."""
        if any(t.token_id == NON_FINITE for t in tokens):
            return RequestStatus.FAILED
        num_emitted, done = 0, False
        for token in tokens:
            num_emitted += 1
            if self._emit(seq, token, on_token):
                done = True
                break
        self.scheduler.advance(seq, num_emitted)
        return RequestStatus.FINISHED if done else None

    def _emit(self, seq: Sequence, sampled, on_token) -> bool:
        """Append one sampled token to ``seq`` and stream it (``on_token``, when given); True when ``seq`` is
        done, with its ``finish_reason`` set."""
        token_id, params = sampled.token_id, seq.params
        seq.output_token_ids.append(token_id)
        seq.cumulative_logprob += sampled.logprob
        seq.output_logprobs.append(sampled.logprob)
        if params.logprobs is not None:
            seq.output_top_logprobs.append(list(sampled.top))
        if on_token is not None:
            on_token(seq, token_id)
        if token_id in params.stop_token_ids or (not params.ignore_eos and token_id in self.tokenizer.eos_token_ids):
            seq.finish_reason = "stop"
            return True
        if params.stop:
            if seq.stop_strings is None:
                seq.stop_strings = StopStrings(self.tokenizer, params.stop)
            text = seq.stop_strings.text_before_stop(seq.output_token_ids)
            if text is not None:
                seq.output_text = text
                seq.finish_reason = "stop"
                return True
        num_output = len(seq.output_token_ids)
        if num_output >= params.max_tokens or len(seq.prompt_token_ids) + num_output >= self.max_model_len:
            seq.finish_reason = "length"
            return True
        return False

    def to_output(self, seq: Sequence) -> RequestOutput:
        text = seq.output_text if seq.output_text is not None else self.tokenizer.decode(seq.output_token_ids)
        completion = CompletionOutput(0, text, list(seq.output_token_ids), seq.cumulative_logprob, seq.finish_reason)
        return RequestOutput(seq.request_id, seq.prompt, list(seq.prompt_token_ids), [completion], seq.is_finished,
                             num_cached_tokens=seq.num_prefix_hit_tokens)

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        self.pins.check_integrity()
        self.kv.stats.check_integrity()
