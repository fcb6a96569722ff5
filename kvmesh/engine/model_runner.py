"""ModelRunner: turns one scheduled batch into model inputs, runs the forward, samples.

A batch is a list of ``(sequence, num_new_tokens)``: the sequence's tokens
``[num_computed_tokens, num_computed_tokens + num_new_tokens)`` are computed and
their K/V stored in its blocks (which must already cover them). Sequences whose
chunk reaches their last token get a sampled token back; mid-prompt chunks get
None. Decodes (one new token) are put first, as the kernels expect.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from kvmesh.engine.sampler import sample
from kvmesh.engine.sequence import Sequence
from kvmesh.kernels.attention_metadata import AttentionMetadata
from kvmesh.model.llama import LlamaForCausalLM


class SampledToken(NamedTuple):
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the most likely alternatives with their logprobs, if asked for


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_buffer: torch.Tensor, block_size: int):
        self.model = model
        self.kv_buffer = kv_buffer
        self.block_size = block_size
        self.device = kv_buffer.device

    @torch.inference_mode()
    def execute(self, batch: list[tuple[Sequence, int]]) -> list[SampledToken | None]:
        """Compute one step; returns one entry per batch item in the caller's order.

        Does not change the sequences: the caller advances ``num_computed_tokens``.
        """
        order = sorted(range(len(batch)), key=lambda i: batch[i][1] != 1)  # decodes first, stable
        input_ids: list[int] = []
        positions: list[int] = []
        query_lens, seq_lens, tables = [], [], []
        for i in order:
            seq, n = batch[i]
            start = seq.num_computed_tokens
            input_ids += seq.token_ids(start, start + n)
            positions += range(start, start + n)
            query_lens.append(n)
            seq_lens.append(start + n)
            tables.append(seq.block_ids)
        md = AttentionMetadata.build(query_lens=query_lens, seq_lens=seq_lens, block_tables=tables,
                                     block_size=self.block_size, device=self.device)
        hidden = self.model(torch.tensor(input_ids, device=self.device),
                            torch.tensor(positions, device=self.device), self.kv_buffer, md)
        rows, sampled_items = [], []
        end = 0
        for i, q_len in zip(order, query_lens):
            end += q_len
            seq, n = batch[i]
            if seq.num_computed_tokens + n == seq.num_tokens:
                rows.append(end - 1)
                sampled_items.append(i)
        results: list[SampledToken | None] = [None] * len(batch)
        if not rows:
            return results
        logits = self.model.compute_logits(hidden[rows])
        seqs = [batch[i][0] for i in sampled_items]
        tokens, logprobs, tops = sample(logits, [s.params for s in seqs], [s.generator for s in seqs])
        for i, tok, lp, top in zip(sampled_items, tokens, logprobs, tops):
            results[i] = SampledToken(tok, lp, top)
        return results
