"""The forward over paged KV: incremental prefill == full prefill, mixed batches == separate runs."""
from __future__ import annotations

import random

import pytest
import torch

from kvmesh.kernels.attention_metadata import AttentionMetadata
from kvmesh.kv.kv_buffer import KVLayout
from tests.conftest import run_prefill

BLOCK = 16


def kv_of_positions(kv: torch.Tensor, block_ids: list[int], length: int) -> torch.Tensor:
    """[length, layers, 2, H, D]: every position's K and V read back through the block table."""
    return torch.stack([kv[block_ids[p // BLOCK], :, :, p % BLOCK] for p in range(length)])


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3"])
def test_incremental_prefill_equals_full_prefill(name, request):
    loaded = request.getfixturevalue(name.replace("-", "_"))
    rng = random.Random(3)
    tokens = [rng.randrange(256) for _ in range(150)]
    full_logits, full_kv, full_blocks = run_prefill(loaded, tokens)
    expected_kv = kv_of_positions(full_kv, full_blocks, len(tokens))
    splits = {1, 15, 16, 17, 32, 33, 64, 149} | {rng.randrange(1, 150) for _ in range(8)}
    for k in sorted(splits):
        _, kv, blocks = run_prefill(loaded, tokens[:k])
        logits, kv, blocks = run_prefill(loaded, tokens[k:], kv=kv, block_ids=blocks, start=k)
        got_kv = kv_of_positions(kv, blocks, len(tokens))
        assert (got_kv - expected_kv).abs().max().item() < 1e-5, f"split at {k}"
        assert (logits[-1] - full_logits[-1]).abs().max().item() < 1e-4, f"split at {k}"
        assert (logits - full_logits[k:]).abs().max().item() < 1e-4, f"split at {k}"


def test_three_chunks_equal_full_prefill(tiny_llama):
    tokens = list(range(40, 140))
    full_logits, full_kv, full_blocks = run_prefill(tiny_llama, tokens)
    _, kv, blocks = run_prefill(tiny_llama, tokens[:20])
    _, kv, blocks = run_prefill(tiny_llama, tokens[20:64], kv=kv, block_ids=blocks, start=20)
    logits, kv, blocks = run_prefill(tiny_llama, tokens[64:], kv=kv, block_ids=blocks, start=64)
    assert torch.allclose(kv_of_positions(kv, blocks, 100), kv_of_positions(full_kv, full_blocks, 100), atol=1e-5)
    assert torch.allclose(logits[-1], full_logits[-1], atol=1e-4)


def test_wrong_start_position_is_detected(tiny_llama):
    """Negative control: the comparison above can fail."""
    tokens = list(range(10, 90))
    full_logits, full_kv, full_blocks = run_prefill(tiny_llama, tokens)
    k = 37
    _, kv, blocks = run_prefill(tiny_llama, tokens[:k])
    # Claim the suffix starts one position later: RoPE and the causal offset are both wrong.
    logits, kv, blocks = run_prefill(tiny_llama, tokens[k:-1], kv=kv, block_ids=blocks, start=k + 1)
    assert (logits[-1] - full_logits[-2]).abs().max().item() > 1e-2
    got = kv_of_positions(kv, blocks, len(tokens))[k + 1 :]
    assert (got - kv_of_positions(full_kv, full_blocks, len(tokens))[k:-1]).abs().max().item() > 1e-2


def test_mixed_batch_of_decodes_and_prefill_chunks(tiny_qwen3):
    """One forward holding two decodes, a prefill chunk on a cached prefix and a fresh prefill."""
    loaded = tiny_qwen3
    rng = random.Random(5)
    seqs = [[rng.randrange(256) for _ in range(n)] for n in (33, 16, 70, 21)]
    # Reference: each sequence alone in one full prefill.
    refs = [run_prefill(loaded, s)[0] for s in seqs]
    layout = KVLayout.for_model(loaded.config, loaded.dtype, BLOCK, num_blocks=40)
    kv = layout.allocate()
    tables = [[3, 7, 1], [9], [20, 2, 30, 4, 11], [15, 16]]
    # Cached context already in place: all but the last token of the two decodes, 40 tokens of seq 2.
    cached = [32, 15, 40, 0]
    for s, table, c in zip(seqs, tables, cached):
        if c:
            run_prefill(loaded, s[:c], kv=kv, block_ids=table)
    query_lens = [len(s) - c for s, c in zip(seqs, cached)]
    md = AttentionMetadata.build(query_lens=query_lens, seq_lens=[len(s) for s in seqs], block_tables=tables,
                                 block_size=BLOCK)
    assert md.num_decodes == 2 and md.num_prefills == 2
    input_ids = sum((s[c:] for s, c in zip(seqs, cached)), [])
    positions = sum((list(range(c, len(s))) for s, c in zip(seqs, cached)), [])
    with torch.inference_mode():
        hidden = loaded.model(torch.tensor(input_ids), torch.tensor(positions), kv, md)
        logits = loaded.model.compute_logits(hidden)
    start = 0
    for ref, c, n in zip(refs, cached, query_lens):
        assert (logits[start : start + n] - ref[c:]).abs().max().item() < 1e-4
        start += n


def test_metadata_maps_every_new_token_to_its_slot():
    """``AttentionMetadata.build`` (array operations) against the definition, token by token: decodes and
    prefill chunks over cached prefixes, tables of different widths, an empty batch."""
    rng = random.Random(11)
    for _ in range(20):
        num_decodes, num_prefills = rng.randrange(4), rng.randrange(4)
        query_lens = [1] * num_decodes + [rng.randrange(1, 80) for _ in range(num_prefills)]
        seq_lens = [q + rng.randrange(0, 60) for q in query_lens]
        tables = [rng.sample(range(200), -(-s // BLOCK) + rng.randrange(2)) for s in seq_lens]
        md = AttentionMetadata.build(query_lens=query_lens, seq_lens=seq_lens, block_tables=tables, block_size=BLOCK)
        slots = [table[p // BLOCK] * BLOCK + p % BLOCK
                 for q, s, table in zip(query_lens, seq_lens, tables) for p in range(s - q, s)]
        assert md.slot_mapping.tolist() == slots
        assert (md.slot_block_ids * BLOCK + md.slot_offsets).tolist() == slots
        assert md.query_start_loc.tolist() == [sum(query_lens[:i]) for i in range(len(query_lens) + 1)]
        width = max((len(t) for t in tables), default=1)
        assert md.block_tables.tolist() == [t + [0] * (width - len(t)) for t in tables]
        assert md.block_tables.dtype == md.seq_lens.dtype == md.query_start_loc.dtype == torch.int32
        assert md.slot_mapping.dtype == torch.int64
        assert md.num_decodes == next((i for i, q in enumerate(query_lens) if q != 1), len(query_lens))
    with pytest.raises(ValueError):
        AttentionMetadata.build(query_lens=[5], seq_lens=[40], block_tables=[[1, 2]], block_size=BLOCK)
