"""Decode CUDA graphs, the parts without a device: bucket choice and the padded, fixed-shape inputs.

The padded forward is run eagerly here, on the CPU, against the plain decode forward on the same
KV: same logits for the real rows, and the padding rows write nothing. tests/gpu/test_gpu_graphs.py
captures and replays it on a GPU.
"""
from __future__ import annotations

import pytest
import torch

from kvmesh.engine.cuda_graphs import BUCKETS, DecodeInputs, bucket_for, buckets_for
from kvmesh.kernels.attention_metadata import AttentionMetadata
from kvmesh.model.loader import load_model


def test_buckets_stop_at_max_num_seqs():
    assert buckets_for(64) == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    assert buckets_for(100) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 100]
    assert buckets_for(1) == [1]
    assert buckets_for(300) == [*BUCKETS, 300]
    buckets = buckets_for(64)
    assert [bucket_for(buckets, n) for n in (1, 3, 7, 9, 33, 64)] == [1, 4, 8, 16, 48, 64]
    assert bucket_for(buckets, 65) is None  # past the largest: eager


def test_padded_decode_forward_equals_the_plain_one_and_padding_writes_nothing():
    loaded = load_model("tiny-llama", progress=False)
    model, cfg = loaded.model, loaded.config
    block_size, num_blocks = 16, 64
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn((num_blocks, cfg.num_layers, 2, block_size, cfg.num_kv_heads, cfg.head_dim), generator=gen)
    seq_lens = [5, 40, 17, 64, 33]  # the new token of each is its last position
    tables = [[3], [7, 8, 9], [20, 21], [30, 31, 32, 33], [40, 41, 42]]
    input_ids = [11, 22, 33, 44, 55]
    positions = [n - 1 for n in seq_lens]
    plain_kv, padded_kv = kv.clone(), kv.clone()
    inputs = DecodeInputs(max_batch=16, max_model_len=cfg.max_position_embeddings, block_size=block_size,
                          device=torch.device("cpu"))  # persistent: made once, outside inference mode
    with torch.inference_mode():
        md = AttentionMetadata.build(query_lens=[1] * 5, seq_lens=seq_lens, block_tables=tables, block_size=block_size)
        want = model.compute_logits(model(torch.tensor(input_ids), torch.tensor(positions), plain_kv, md))
        inputs.fill(input_ids, positions, tables, seq_lens)
        bucket = bucket_for(buckets_for(16), 5)
        assert bucket == 8
        assert inputs.slot_mapping[5:].tolist() == [-1] * 11  # padding rows store nothing
        got = model.compute_logits(model(inputs.input_ids[:bucket], inputs.positions[:bucket], padded_kv,
                                         inputs.metadata(bucket)))
    torch.testing.assert_close(got[:5], want, rtol=1e-5, atol=1e-5)
    # The same K/V stored (to the rounding of a GEMM over 8 rows instead of 5: oneDNN may block them
    # differently), and nothing else touched: every slot but the five new tokens' holds what it held.
    torch.testing.assert_close(padded_kv, plain_kv, rtol=1e-5, atol=1e-5)
    written = torch.zeros(kv.shape[0], kv.shape[3], dtype=torch.bool)
    for table, pos in zip(tables, positions):
        written[table[pos // block_size], pos % block_size] = True
    assert torch.equal(padded_kv.permute(0, 3, 1, 2, 4, 5)[~written], kv.permute(0, 3, 1, 2, 4, 5)[~written])
    assert not torch.equal(padded_kv, kv)
    inputs.fill([], [], [], [])  # an empty step leaves only padding
    assert inputs.slot_mapping.tolist() == [-1] * 16 and inputs.seq_lens.tolist() == [1] * 16
    with pytest.raises(ValueError):
        inputs.fill([1], [0], [list(range(inputs.width + 1))], [1])


def test_staged_tables_follow_every_change_between_steps():
    """fill() rewrites only rows whose table changed: grown, replaced in place, moved to another row."""
    inputs = DecodeInputs(max_batch=8, max_model_len=256, block_size=16, device=torch.device("cpu"))

    def step(tables: list[list[int]], seq_lens: list[int], num_rows: int = 8) -> None:
        positions = [n - 1 for n in seq_lens]
        inputs.fill([7] * len(tables), positions, tables, seq_lens, num_rows=num_rows)
        for row, (table, pos) in enumerate(zip(tables, positions)):
            assert inputs.block_tables[row, : len(table)].tolist() == table
            assert inputs.slot_mapping[row].item() == table[pos // 16] * 16 + pos % 16
        assert inputs.slot_mapping[len(tables):num_rows].tolist() == [-1] * (num_rows - len(tables))
        assert inputs.seq_lens[: len(tables)].tolist() == seq_lens

    a, b, c = [5, 6], [9], [11, 12, 13]
    step([a, b, c], [20, 3, 40])
    step([a, b, c], [21, 4, 41])  # unchanged tables
    b.append(10)  # grown in place (the list the sequence owns)
    step([a, b, c], [22, 17, 42])
    a[1] = 30  # a block swapped in place, same length (a tainted block replaced)
    step([a, b, c], [23, 18, 43])
    step([c, a], [44, 24], num_rows=4)  # the batch shrinks (row 2 becomes padding) and its rows move
    step([b, c, a, [1, 2, 3, 4]], [19, 45, 25, 60], num_rows=4)


def test_a_capture_owns_its_cublas_workspace(monkeypatch):
    """cuBLAS's workspaces are cleared right before a capture (its matmuls then allocate theirs from the graphs'
    pool) and after it, also when the capture fails. CUDA itself is faked here: the order is what is checked; the
    replay on a device is tests/gpu/test_gpu_graphs.py's."""
    import contextlib

    from kvmesh.engine.cuda_graphs import CudaReplay

    events: list[str] = []
    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: events.append("clear"), raising=False)

    @contextlib.contextmanager
    def capturing(graph, pool=None, stream=None):
        events.append("begin")
        yield
        events.append("end")

    monkeypatch.setattr(torch.cuda, "CUDAGraph", object)
    monkeypatch.setattr(torch.cuda, "graph", capturing)
    replay = CudaReplay(lambda: events.append("forward") or torch.zeros(1), pool=None, stream=None)
    assert events == ["clear", "begin", "forward", "end", "clear"] and replay.output.shape == (1,)

    def failing():
        raise RuntimeError("operation not permitted when stream is capturing")

    events.clear()
    with pytest.raises(RuntimeError, match="capturing"):
        CudaReplay(failing, pool=None, stream=None)
    assert events == ["clear", "begin", "clear"]
