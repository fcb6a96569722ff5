"""AttentionMetadata: how one forward batch maps onto the paged KV buffer.

A batch holds ``num_decodes`` decode sequences (one new token each) first, then
prefill sequences (a chunk of new tokens each, possibly on top of cached KV).
For sequence ``i`` the new tokens are ``query[query_start_loc[i]:query_start_loc[i+1]]``
and they are the *last* ``query_len`` tokens of its ``seq_lens[i]`` tokens:

    positions:   0 ........ context_len-1 | context_len ...... seq_len-1
                 KV already in the blocks | new tokens (this forward)
    KV blocks:   block_tables[i][0], [1], ... each holding block_size positions

A new token at position p attends to every key at positions 0..p. New K/V are
written first (by ``slot_mapping``, slot = block_id * block_size + offset, or -1
for "do not store"), so attention reads every key from the blocks.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32, unused entries 0
    seq_lens: torch.Tensor  # [num_seqs] int32, context + new tokens
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    num_decodes: int  # the first num_decodes sequences have exactly one new token
    max_query_len: int
    max_seq_len: int
    # Host copies, so the CPU reference path never syncs on device tensors.
    seq_lens_cpu: list[int]
    query_lens_cpu: list[int]
    # The slots split into (block id, offset) [num_tokens] int64, for paths that index blocks directly.
    slot_block_ids: torch.Tensor | None = None
    slot_offsets: torch.Tensor | None = None
    # Whatever a kernel path derives once per step and every layer reuses (e.g. the decode gather index).
    per_step: dict = field(default_factory=dict)
    # Every sequence is a prompt with nothing cached: its keys are exactly its new tokens (no decode among them).
    fresh_prompts: bool = False

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_prefills(self) -> int:
        return self.num_seqs - self.num_decodes

    @classmethod
    def build(
        cls,
        *,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Build metadata from per-sequence host lists (decodes must come first)."""
        if not (len(query_lens) == len(seq_lens) == len(block_tables)):
            raise ValueError("query_lens, seq_lens and block_tables differ in length")
        num_decodes = 0
        while num_decodes < len(query_lens) and query_lens[num_decodes] == 1:
            num_decodes += 1
        for q_len, s_len, table in zip(query_lens, seq_lens, block_tables):
            if q_len > s_len or len(table) * block_size < s_len:
                raise ValueError(f"sequence of {s_len} tokens ({q_len} new) does not fit {len(table)} blocks")
        table_lens = np.fromiter(map(len, block_tables), dtype=np.int64, count=len(block_tables))
        width = int(table_lens.max(initial=0)) or 1
        padded = np.zeros((len(block_tables), width), dtype=np.int32)
        padded[np.arange(width) < table_lens[:, None]] = np.fromiter(  # row by row, as the tables run
            itertools.chain.from_iterable(block_tables), dtype=np.int32, count=int(table_lens.sum()))
        # Every new token's position and block, in array operations (a prompt's thousands of tokens take no
        # Python loop): token j of sequence i sits at position seq_len - query_len + j.
        q_lens = np.asarray(query_lens, dtype=np.int64)
        starts = np.zeros(len(query_lens) + 1, dtype=np.int64)
        np.cumsum(q_lens, out=starts[1:])
        rows = np.repeat(np.arange(len(query_lens)), q_lens)
        positions = np.arange(starts[-1]) + np.repeat(np.asarray(seq_lens, dtype=np.int64) - q_lens - starts[:-1],
                                                      q_lens)
        block_ids_t = torch.from_numpy(padded[rows, positions // block_size].astype(np.int64)).to(device)
        offsets_t = torch.from_numpy(positions % block_size).to(device)
        return cls(
            slot_mapping=block_ids_t * block_size + offsets_t,
            block_tables=torch.from_numpy(padded).to(device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            query_start_loc=torch.from_numpy(starts.astype(np.int32)).to(device),
            num_decodes=num_decodes,
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
            seq_lens_cpu=list(seq_lens),
            query_lens_cpu=list(query_lens),
            slot_block_ids=block_ids_t,
            slot_offsets=offsets_t,
            fresh_prompts=num_decodes == 0 and len(query_lens) > 0 and list(query_lens) == list(seq_lens),
        )
