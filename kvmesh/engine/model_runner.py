"""ModelRunner: turns one scheduled batch into model inputs, runs the forward, samples.

A batch is a list of ``(sequence, num_new_tokens)``: the sequence's tokens
``[num_computed_tokens, num_computed_tokens + num_new_tokens)`` are computed and
their K/V stored in its blocks (which must already cover them). Sequences whose
chunk reaches their last token get a sampled token back; mid-prompt chunks get
None. Decodes (one new token) are put first, as the kernels expect.

On CUDA, a decode-only batch (no drafts) replays a captured graph of the forward when one is
given (``graphs``, ``kvmesh/engine/cuda_graphs.py``), a batch of prompt chunks only one of the
prompt-step graphs (``prefill_graphs``, ``kvmesh/engine/prefill_graphs.py``); everything else runs eagerly.

Run-ahead (``launch_decode`` / ``collect``): a decode-only greedy step can be launched without waiting for
its tokens, which stay on the device (``InFlight``); the next step can be launched from them before the host
reads them (``ahead_of``), so the device computes one step while the host finishes the one before.

Speculative decoding: ``drafts[i]`` turns batch item i (a decode) into a verification
of ``[last token, d1 .. dk]`` (num_new_tokens = k + 1); it gets back the list of
tokens the rejection sampler emits (accepted drafts, then one from the target).
"""
from __future__ import annotations

from enum import Enum
from typing import NamedTuple

import torch

from kvmesh.engine.cuda_graphs import DecodeGraphs
from kvmesh.engine.prefill_graphs import PrefillGraphs
from kvmesh.engine.sampler import greedy_on_device, greedy_results, sample, top_logprobs
from kvmesh.engine.sequence import Sequence
from kvmesh.engine.spec_decode.proposers import Proposal
from kvmesh.engine.spec_decode.rejection import verify_drafts
from kvmesh.kernels.attention_metadata import AttentionMetadata
from kvmesh.model.llama import LlamaForCausalLM


class Replayed(Enum):
    """How a step's forward runs."""

    EAGER = "eager"
    DECODE_GRAPH = "decode-graph"  # the output is logits of every row
    PREFILL_GRAPH = "prefill-graph"  # the output is hidden states, like an eager step's


class StepInputs(NamedTuple):
    """One step's model inputs as host lists (``ModelRunner.prepare``), in the order the kernels want."""

    order: list[int]  # batch item indexes, decodes first
    input_ids: list[int]
    positions: list[int]
    query_lens: list[int]
    seq_lens: list[int]
    tables: list[list[int]]
    replayed: Replayed


class SampledToken(NamedTuple):
    token_id: int
    logprob: float
    top: list[tuple[int, float]] | tuple  # the likeliest alternatives and their logprobs (else NO_ALTERNATIVES)


class InFlight(NamedTuple):
    """A decode step launched and not read yet (``ModelRunner.launch_decode``)."""

    batch: list[tuple[Sequence, int]]
    picks: torch.Tensor  # [3, rows] on the device: greedy token ids, logprobs, finite flags (greedy_on_device)
    host: torch.Tensor | None  # on CUDA: the pinned buffer the picks are being copied into
    ready: object | None  # on CUDA: the event recorded after that copy
    held_block_ids: list[int] | None = None  # blocks its rows write, held by the engine until it is read


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_buffer: torch.Tensor, block_size: int):
        self.model = model
        self.kv_buffer = kv_buffer
        self.block_size = block_size
        self.device = kv_buffer.device
        self.graphs: DecodeGraphs | None = None  # set once captured (the engine, on CUDA)
        self.prefill_graphs: PrefillGraphs | None = None
        self._pick_buffers: list[torch.Tensor] = []  # two pinned buffers, taken in turn by launched steps
        self._pick_turn = 0

    @torch.inference_mode()
    def execute(self, batch: list[tuple[Sequence, int]], drafts: dict[int, Proposal] | None = None
                ) -> list[SampledToken | list[SampledToken] | None]:
        """Compute one step; returns one entry per batch item in the caller's order.

        Does not change the sequences: the caller advances ``num_computed_tokens``. The three phases
        (``prepare``, ``forward``, ``sample``) are public so that ``kvmesh bench step`` can time them.
        """
        drafts = drafts or {}
        prepared = self.prepare(batch, drafts)
        return self.sample(batch, drafts, prepared, self.forward(prepared))

    def prepare(self, batch: list[tuple[Sequence, int]], drafts: dict[int, Proposal]) -> StepInputs:
        """The step's model inputs in host lists, decodes first (as the kernels expect)."""
        if not drafts and all(n == 1 for _, n in batch):  # one token a row (decode-only steps): no reordering
            positions = [seq.num_computed_tokens for seq, _ in batch]
            return StepInputs(list(range(len(batch))), [seq.token_at(p) for (seq, _), p in zip(batch, positions)],
                              positions, [1] * len(batch), [p + 1 for p in positions],
                              [seq.block_ids for seq, _ in batch], self._replay_for(len(batch), None))
        order = sorted(range(len(batch)), key=lambda i: batch[i][1] != 1)  # decodes first, stable
        input_ids: list[int] = []
        positions: list[int] = []
        query_lens, seq_lens, tables = [], [], []
        for i in order:
            seq, n = batch[i]
            start = seq.num_computed_tokens
            if i in drafts:  # the last token (no K/V yet), then the guesses after it
                input_ids += seq.token_ids(start, start + 1) + drafts[i].token_ids
            else:
                input_ids += seq.token_ids(start, start + n)
            positions += range(start, start + n)
            query_lens.append(n)
            seq_lens.append(start + n)
            tables.append(seq.block_ids)
        replayed = Replayed.EAGER if drafts else self._replay_for(0, query_lens)  # some row has several tokens
        return StepInputs(order, input_ids, positions, query_lens, seq_lens, tables, replayed)

    def _replay_for(self, num_decode_rows: int, query_lens: list[int] | None) -> Replayed:
        """How a step without drafts runs: a decode graph for ``num_decode_rows`` (> 0: one token a row), else a
        prompt-step graph for ``query_lens`` (None: a decode-only step), else eagerly."""
        if num_decode_rows and self.graphs is not None and self.graphs.can_run(num_decode_rows):
            return Replayed.DECODE_GRAPH
        if query_lens is not None and self.prefill_graphs is not None and self.prefill_graphs.can_run(query_lens):
            return Replayed.PREFILL_GRAPH
        return Replayed.EAGER

    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """Hidden states [tokens, hidden] of the step, or for a decode graph's replay its logits [rows, vocab].
        Called in inference mode (``execute`` enters it once for the step)."""
        if inputs.replayed is Replayed.DECODE_GRAPH:
            return self.graphs.run(inputs.input_ids, inputs.positions, inputs.tables, inputs.seq_lens)
        if inputs.replayed is Replayed.PREFILL_GRAPH:
            return self.prefill_graphs.run(inputs.input_ids, inputs.positions, inputs.query_lens, inputs.seq_lens,
                                           inputs.tables)
        md = AttentionMetadata.build(query_lens=inputs.query_lens, seq_lens=inputs.seq_lens,
                                     block_tables=inputs.tables, block_size=self.block_size, device=self.device)
        return self.model(torch.tensor(inputs.input_ids, device=self.device),
                          torch.tensor(inputs.positions, device=self.device), self.kv_buffer, md)

    def sample(self, batch: list[tuple[Sequence, int]], drafts: dict[int, Proposal], inputs: StepInputs,
               out: torch.Tensor) -> list[SampledToken | list[SampledToken] | None]:
        """Tokens of the items whose chunk reaches their last token, verifications of the drafted ones. Called in
        inference mode, as ``forward``."""
        verify_rows = {}
        in_order = not drafts and len(inputs.input_ids) == len(batch)  # one token a row, in the batch's order
        if in_order:
            rows = sampled_items = [i for i, (seq, _) in enumerate(batch) if seq.num_computed_tokens + 1 ==
                                    len(seq.prompt_token_ids) + len(seq.output_token_ids)]  # its last token
        else:
            rows, sampled_items, end = [], [], 0
            for i, q_len in zip(inputs.order, inputs.query_lens):
                end += q_len
                seq, n = batch[i]
                if i in drafts:
                    verify_rows[i] = range(end - q_len, end)
                elif seq.num_computed_tokens + n == seq.num_tokens:
                    rows.append(end - 1)
                    sampled_items.append(i)
        results: list[SampledToken | list[SampledToken] | None] = [None] * len(batch)
        if rows:
            # rows rise, so ending at len(rows) - 1 means every row from 0: a view instead of a gather
            picked = out if len(rows) == len(out) else out[: len(rows)] if rows[-1] == len(rows) - 1 else out[rows]
            logits = picked if inputs.replayed is Replayed.DECODE_GRAPH else self.model.compute_logits(picked)
            seqs = [batch[i][0] for i in sampled_items]
            tokens, logprobs, tops = sample(logits, [s.params for s in seqs], [s.generator for s in seqs])
            if in_order and len(sampled_items) == len(batch):  # every row
                results = list(map(SampledToken._make, zip(tokens, logprobs, tops)))
            else:
                for i, tok, lp, top in zip(sampled_items, tokens, logprobs, tops):
                    results[i] = SampledToken(tok, lp, top)
        for i, item_rows in verify_rows.items():
            logits = self.model.compute_logits(out[item_rows.start:item_rows.stop])
            results[i] = self._verify(batch[i][0], drafts[i], logits.float().cpu())  # k + 1 rows, CPU generators
        return results

    def can_launch(self, num_seqs: int) -> bool:
        """Whether a decode-only step of ``num_seqs`` rows can be launched by replay (``launch_decode``)."""
        return self.graphs is not None and self.graphs.can_run(num_seqs)

    @torch.inference_mode()
    def launch_decode(self, batch: list[tuple[Sequence, int]], ahead_of: InFlight | None = None) -> InFlight:
        """Start a decode step of greedy rows (one new token each, every row sampling) by graph replay and return
        without waiting for it. Without ``ahead_of``, row ``i`` computes the last token the host holds. With it,
        each row computes the token ``ahead_of`` picked for it (still on the device): one position further,
        in blocks the caller allocated. The caller reads the step with ``collect``; two steps at most are
        unread at a time (their copies back take two buffers in turn)."""
        if ahead_of is None:
            positions = [seq.num_computed_tokens for seq, _ in batch]
            input_ids = [seq.token_at(p) for (seq, _), p in zip(batch, positions)]
            device_ids = None
        else:
            positions = [seq.num_computed_tokens + 1 for seq, _ in batch]
            rows = {id(seq): k for k, (seq, _) in enumerate(ahead_of.batch)}
            picked = [rows[id(seq)] for seq, _ in batch]
            device_ids = ahead_of.picks[0].long()
            if picked != list(range(len(ahead_of.batch))):
                device_ids = device_ids[torch.tensor(picked, device=device_ids.device)]
            input_ids = None
        logits = self.graphs.run(input_ids, positions, [seq.block_ids for seq, _ in batch],
                                 [p + 1 for p in positions], device_input_ids=device_ids)
        picks = greedy_on_device(logits)
        if picks.device.type != "cuda":
            return InFlight(batch, picks, None, None)
        if not self._pick_buffers:
            self._pick_buffers = [torch.empty(3 * self.graphs.buckets[-1], dtype=torch.float64, pin_memory=True)
                                  for _ in range(2)]
        host = self._pick_buffers[self._pick_turn][: picks.numel()].view(picks.shape)
        self._pick_turn ^= 1
        host.copy_(picks, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(picks.device))
        return InFlight(batch, picks, host, ready)

    @staticmethod
    def collect(flight: InFlight) -> list[SampledToken]:
        """Wait for a launched step's picks (only for them, not for a step launched after it) and read them."""
        if flight.ready is not None:
            flight.ready.synchronize()
            rows = flight.host.tolist()
        else:
            rows = flight.picks.tolist()
        token_ids, logprobs = greedy_results(rows)
        return [SampledToken(t, lp, []) for t, lp in zip(token_ids, logprobs)]

    @staticmethod
    def _verify(seq: Sequence, draft: Proposal, logits: torch.Tensor) -> list[SampledToken]:
        verdict = verify_drafts(logits, draft.token_ids, seq.params, seq.generator, draft.probs)
        logprobs = torch.log_softmax(logits[: len(verdict.token_ids)], dim=-1)
        return [SampledToken(tok, float(logprobs[j, tok]), top_logprobs(logprobs[j], seq.params))
                for j, tok in enumerate(verdict.token_ids)]
