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

from dataclasses import dataclass, field

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
        slot_block_ids: list[int] = []
        slot_offsets: list[int] = []
        for q_len, s_len, table in zip(query_lens, seq_lens, block_tables):
            if q_len > s_len or len(table) * block_size < s_len:
                raise ValueError(f"sequence of {s_len} tokens ({q_len} new) does not fit {len(table)} blocks")
            for pos in range(s_len - q_len, s_len):
                slot_block_ids.append(table[pos // block_size])
                slot_offsets.append(pos % block_size)
        block_ids_t = torch.tensor(slot_block_ids, dtype=torch.int64, device=device)
        offsets_t = torch.tensor(slot_offsets, dtype=torch.int64, device=device)
        width = max((len(t) for t in block_tables), default=0) or 1
        padded = [t + [0] * (width - len(t)) for t in block_tables]
        starts = [0]
        for q_len in query_lens:
            starts.append(starts[-1] + q_len)
        return cls(
            slot_mapping=block_ids_t * block_size + offsets_t,
            block_tables=torch.tensor(padded, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            num_decodes=num_decodes,
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
            seq_lens_cpu=list(seq_lens),
            query_lens_cpu=list(query_lens),
            slot_block_ids=block_ids_t,
            slot_offsets=offsets_t,
        )
