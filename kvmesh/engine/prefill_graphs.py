"""PrefillGraphs: prompt steps captured as CUDA graphs, one per token-count bucket.

On a GPU, a prompt step of a small model is bound by launches and Python as a decode step is: every
layer's kernels are dispatched one by one whatever the prompt's length. A step whose batch is prompt
chunks only (each of more than one new token, at most ``max_seqs`` of them, their tokens within the
largest bucket) replays the graph of the smallest token bucket that holds its tokens. Its persistent
inputs (``PrefillInputs``):

    input_ids, positions, slot_mapping   [T]        int64   (padding tokens: slot -1, store nothing)
    seq_lens                             [S]        int32   (padding sequences: 0)
    query_start_loc                      [S + 1]    int32   (padding sequences: empty, at the real tokens' end)
    block_tables                         [S, W]     int32   (W: blocks of the context limit)

The paged prefill kernel's grid is the bucket's (query tiles of T tokens, every head, S sequences); a
tile past its sequence's new tokens returns at once, so padding costs a few empty programs and no
output row. Padding tokens' rows hold whatever the norms and GEMMs make of unwritten attention output;
no row depends on another outside attention, and nothing reads them. The graph ends at the final norm:
the head runs after the replay, on the rows that sample. Decodes, speculative verification, and
batches past ``max_seqs`` sequences or the largest bucket run eagerly.

The metadata's host lists (``query_lens_cpu``, ``seq_lens_cpu``) are bounds, not the step's values:
the Triton kernels a graph holds read the device tensors only. Its ``fresh_prompts`` is False whatever
the step holds, so a graph takes the paged kernel, never the SDPA path whose shapes are the step's.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch

from kvmesh.engine.cuda_graphs import CapturedForwards, StagingTurns, bucket_for, stage_tables
from kvmesh.kernels.attention_metadata import AttentionMetadata

log = logging.getLogger("kvmesh.engine")

PREFILL_BUCKETS = (64, 128, 256, 512, 1024, 2048)
MAX_PROMPTS_PER_REPLAY = 16


def prefill_buckets_for(max_num_batched_tokens: int) -> list[int]:
    """The captured token counts: PREFILL_BUCKETS below the step's token budget, then the budget (at most
    the largest bucket)."""
    cap = min(max_num_batched_tokens, PREFILL_BUCKETS[-1])
    return [b for b in PREFILL_BUCKETS if b < cap] + [cap]


class _PrefillStaging:
    """Pinned host buffers one fill writes and copies from: int64 token rows (ids, positions, slots), int32
    sequence lengths, query starts and block tables; and what each table row holds."""

    def __init__(self, max_tokens: int, max_seqs: int, width: int, pin: bool):
        self.host64 = torch.zeros((3, max_tokens), dtype=torch.int64, pin_memory=pin)
        self.host32 = torch.zeros(2 * max_seqs + 1 + max_seqs * width, dtype=torch.int32, pin_memory=pin)
        self.h64, h32 = self.host64.numpy(), self.host32.numpy()
        self.seq_lens, self.starts = h32[:max_seqs], h32[max_seqs: 2 * max_seqs + 1]
        self.tables = h32[2 * max_seqs + 1:].reshape(max_seqs, width)
        self.staged_tables: list[list[int] | None] = [None] * max_seqs
        self.h64[2] = -1  # every token padding until filled
        self.num_filled = 0


class PrefillInputs:
    """Persistent, padded inputs of a prompt step (any device) and the metadata that reads them."""

    def __init__(self, max_tokens: int, max_seqs: int, max_model_len: int, block_size: int, device: torch.device):
        self.max_tokens, self.max_seqs, self.block_size = max_tokens, max_seqs, block_size
        self.max_model_len = max_model_len
        self.width = -(-max_model_len // block_size)
        pin = device.type == "cuda"
        size32 = 2 * max_seqs + 1 + max_seqs * self.width  # seq lens, query starts, block tables
        self._staging = StagingTurns([_PrefillStaging(max_tokens, max_seqs, self.width, pin) for _ in range(2)],
                                     device)
        self._dev64 = torch.zeros((3, max_tokens), dtype=torch.int64, device=device)
        self._dev32 = torch.zeros(size32, dtype=torch.int32, device=device)
        self.input_ids, self.positions, self.slot_mapping = self._dev64[0], self._dev64[1], self._dev64[2]
        self.seq_lens = self._dev32[:max_seqs]
        self.query_start_loc = self._dev32[max_seqs: 2 * max_seqs + 1]
        self.block_tables = self._dev32[2 * max_seqs + 1:].view(max_seqs, self.width)
        self.fill([], [], [], [], [])

    def fill(self, input_ids: list[int], positions: list[int], query_lens: list[int], seq_lens: list[int],
             block_tables: list[list[int]]) -> None:
        """Write one step's tokens and sequences (padding after them) and copy them to the device
        (non-blocking on CUDA). Sequence ``i``'s new tokens are the next ``query_lens[i]`` of ``input_ids``,
        the last of its ``seq_lens[i]`` tokens. As in ``DecodeInputs.fill``, two staging sets take turns and a
        table equal to the one staged in its row last time is not rewritten."""
        n, s, bs = len(input_ids), len(query_lens), self.block_size
        if n > self.max_tokens or s > self.max_seqs:
            raise ValueError(f"{n} tokens of {s} sequences: past {self.max_tokens} tokens or {self.max_seqs} sequences")
        st = self._staging.take()
        h64 = st.h64
        if n < st.num_filled:  # tokens of the last step past this one's become padding
            h64[:2, n:st.num_filled] = 0
            h64[2, n:st.num_filled] = -1
        st.num_filled = n
        stage_tables(st.tables, st.staged_tables, block_tables)
        if n:
            h64[0, :n] = input_ids
            h64[1, :n] = positions
            rows = np.repeat(np.arange(s), query_lens)
            pos = h64[1, :n]
            h64[2, :n] = st.tables[rows, pos // bs].astype(np.int64) * bs + pos % bs
        st.seq_lens[:s] = seq_lens
        st.seq_lens[s:] = 0
        st.starts[0] = 0
        np.cumsum(query_lens, out=st.starts[1: s + 1])
        st.starts[s + 1:] = n
        self._dev64.copy_(st.host64, non_blocking=True)
        end = 2 * self.max_seqs + 1 + s * self.width  # lengths, query starts, then the real rows' tables
        self._dev32[:end].copy_(st.host32[:end], non_blocking=True)
        self._staging.copied()

    def metadata(self, num_tokens: int) -> AttentionMetadata:
        """Metadata of a ``num_tokens`` bucket over every sequence row (fixed shapes; host lists are bounds)."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:num_tokens], block_tables=self.block_tables, seq_lens=self.seq_lens,
            query_start_loc=self.query_start_loc, num_decodes=0, max_query_len=num_tokens,
            max_seq_len=self.max_model_len, seq_lens_cpu=[self.max_model_len] * self.max_seqs,
            query_lens_cpu=[num_tokens] * self.max_seqs, fresh_prompts=False)


class PrefillGraphs(CapturedForwards):
    """The prompt-step forward (embedding, layers, final norm) per token bucket; see the module docstring."""

    kind = "prefill"

    def __init__(self, model, kv_buffer: torch.Tensor, block_size: int, max_num_batched_tokens: int,
                 max_num_seqs: int, max_model_len: int):
        super().__init__(model, kv_buffer, prefill_buckets_for(max_num_batched_tokens))
        self.max_seqs = min(max_num_seqs, MAX_PROMPTS_PER_REPLAY)
        self.inputs = PrefillInputs(self.buckets[-1], self.max_seqs, max_model_len, block_size, kv_buffer.device)

    def _forward_for(self, num_tokens: int) -> Callable[[], torch.Tensor]:
        md = self.inputs.metadata(num_tokens)

        def forward() -> torch.Tensor:
            md.per_step.clear()  # a replay is a new step (an eager one reads its own inputs, not the last one's)
            return self.model(self.inputs.input_ids[:num_tokens], self.inputs.positions[:num_tokens],
                              self.kv_buffer, md)
        return forward

    def can_run(self, query_lens: list[int]) -> bool:
        """A batch of prompt chunks only, each of more than one token, that fits the largest replay."""
        return bool(self._replays) and 0 < len(query_lens) <= self.max_seqs and min(query_lens) > 1 and \
            sum(query_lens) <= self.buckets[-1]

    def run(self, input_ids: list[int], positions: list[int], query_lens: list[int], seq_lens: list[int],
            block_tables: list[list[int]]) -> torch.Tensor:
        """One prompt step by replay: final hidden states [tokens, hidden] (a view of the graph's output: read
        it before the next replay); the K/V of every new token is stored."""
        bucket = bucket_for(self.buckets, len(input_ids))
        self.inputs.fill(input_ids, positions, query_lens, seq_lens, block_tables)
        return self._replay(bucket)[: len(input_ids)]

    @torch.inference_mode()
    def agreement_with_eager(self, num_kv_blocks: int) -> float | None:
        """A start-up check of the captured graphs against the eager forward: a probe step (two prompts in the
        smallest bucket, the second over one block of context; only that one where a replay takes one prompt)
        in blocks from 0, which hold nothing yet, is replayed, then computed eagerly on the same inputs.
        Returns the lowest cosine similarity of a new token's hidden state between the two (1.0: identical),
        or None where the probe does not fit. Writes the probe's K/V into those blocks (any later owner
        overwrites them before reading)."""
        bucket, bs = self.buckets[0], self.inputs.block_size
        probe = [(bucket // 2 + 1, 0), (bucket // 4, bs)][-self.max_seqs:]  # (new tokens, context) per prompt
        query_lens = [q for q, _ in probe]
        if min(query_lens) < 2:
            return None
        seq_lens = [q + c for q, c in probe]
        tables, num_blocks = [], 0
        for length in seq_lens:
            tables.append(list(range(num_blocks, num_blocks + -(-length // bs))))
            num_blocks += len(tables[-1])
        if num_blocks > num_kv_blocks:
            return None
        gen = torch.Generator().manual_seed(0)
        input_ids = torch.randint(0, self.model.config.vocab_size, (sum(query_lens),), generator=gen).tolist()
        positions = [p for q, c in probe for p in range(c, c + q)]
        got = self.run(input_ids, positions, query_lens, seq_lens, tables).float()
        device = self.kv_buffer.device
        md = AttentionMetadata.build(query_lens=query_lens, seq_lens=seq_lens, block_tables=tables,
                                     block_size=bs, device=device)
        want = self.model(torch.tensor(input_ids, device=device), torch.tensor(positions, device=device),
                          self.kv_buffer, md).float()
        self.num_replays -= 1  # the probe is not a served step
        return float(torch.nn.functional.cosine_similarity(got, want, dim=-1).min().nan_to_num(-1.0))
