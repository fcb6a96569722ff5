"""Prompt-step graphs, the parts without a device: token buckets, the padded inputs, and what a replay
computes, run through ``EagerReplay`` (the captured forward called on the same persistent inputs and the
metadata built once at capture) with every kernel call on Triton (its interpreter here), as a GPU replays
them. The reference is the plain eager step through the torch kernels. tests/gpu/test_gpu_graphs.py
captures and replays on a device.
"""
from __future__ import annotations

import pytest
import torch

from kvmesh import LLM, SamplingParams
from kvmesh.engine.cuda_graphs import DecodeGraphs, EagerReplay
from kvmesh.engine.engine import PREFILL_GRAPH_MIN_AGREEMENT
from kvmesh.engine.model_runner import Replayed
from kvmesh.engine.prefill_graphs import PrefillGraphs, PrefillInputs, prefill_buckets_for
from kvmesh.kernels.attention_metadata import AttentionMetadata
from kvmesh.model.loader import load_model

BLOCK = 16


def test_token_buckets_stop_at_the_step_budget():
    assert prefill_buckets_for(2048) == [64, 128, 256, 512, 1024, 2048]
    assert prefill_buckets_for(8192) == [64, 128, 256, 512, 1024, 2048]
    assert prefill_buckets_for(300) == [64, 128, 256, 300]
    assert prefill_buckets_for(64) == [64]
    assert prefill_buckets_for(16) == [16]


def test_inputs_pad_tokens_and_sequences_and_follow_each_step():
    inputs = PrefillInputs(max_tokens=64, max_seqs=4, max_model_len=256, block_size=BLOCK, device=torch.device("cpu"))
    # Two prompts: 5 fresh tokens in block 7, then 3 new tokens over 16 cached ones in blocks [2, 9].
    inputs.fill([1, 2, 3, 4, 5, 6, 7, 8], [0, 1, 2, 3, 4, 16, 17, 18], [5, 3], [5, 19], [[7], [2, 9]])
    assert inputs.slot_mapping[:8].tolist() == [7 * 16 + p for p in range(5)] + [9 * 16, 9 * 16 + 1, 9 * 16 + 2]
    assert inputs.slot_mapping[8:].tolist() == [-1] * 56  # padding tokens store nothing
    assert inputs.query_start_loc.tolist() == [0, 5, 8, 8, 8]  # padding sequences are empty
    assert inputs.seq_lens.tolist() == [5, 19, 0, 0]
    assert inputs.block_tables[0, :1].tolist() == [7] and inputs.block_tables[1, :2].tolist() == [2, 9]
    # Smaller next steps (two: the staging sets take turns, the second reuses the first step's set): the first
    # step's tokens past them become padding again, its tables move.
    for _ in range(2):
        inputs.fill([9, 9], [3, 4], [2], [5], [[2, 9]])
        assert inputs.slot_mapping[:3].tolist() == [2 * 16 + 3, 2 * 16 + 4, -1]
        assert inputs.input_ids[:8].tolist() == [9, 9, 0, 0, 0, 0, 0, 0]
        assert inputs.query_start_loc.tolist() == [0, 2, 2, 2, 2] and inputs.seq_lens.tolist() == [5, 0, 0, 0]
    with pytest.raises(ValueError):
        inputs.fill([1] * 65, list(range(65)), [65], [65], [[1, 2, 3, 4, 5]])
    with pytest.raises(ValueError):
        inputs.fill([1, 2], [0, 1], [2], [2], [list(range(inputs.width + 1))])


def _kv(loaded, num_blocks: int) -> torch.Tensor:
    cfg = loaded.config
    gen = torch.Generator().manual_seed(0)
    return torch.randn((num_blocks, cfg.num_layers, 2, BLOCK, cfg.num_kv_heads, cfg.head_dim), generator=gen)


def test_replayed_prompt_steps_equal_the_plain_step_and_store_only_their_tokens(monkeypatch):
    """Replays of two steps of different shapes (the second smaller, so the first's inputs must not leak into it)
    against the plain forward through the torch kernels: the same hidden states for every new token, the same
    K/V at their slots, nothing else written."""
    loaded = load_model("tiny-llama", progress=False)
    model = loaded.model
    kv = _kv(loaded, 48)
    graphs = PrefillGraphs(model, kv, BLOCK, max_num_batched_tokens=128, max_num_seqs=3, max_model_len=256)
    monkeypatch.setenv("KVMESH_KERNELS", "triton")  # what a graph holds
    graphs.capture()
    assert graphs.buckets == [64, 128] and all(isinstance(r, EagerReplay) for r in graphs._replays.values())
    # (query lens, seq lens, tables): a fresh prompt past the smallest bucket, chunks over 32 and 5 cached tokens;
    # then two smaller steps (the second fills the first step's staging set again)
    steps = [
        ([70, 20, 30], [70, 52, 35], [[3, 40, 11, 12, 13], [20, 21, 22, 23], [30, 31, 32]]),
        ([10], [26], [[5, 6]]),
        ([12, 9], [12, 25], [[41], [42, 43]]),
    ]
    gen = torch.Generator().manual_seed(1)
    for query_lens, seq_lens, tables in steps:
        input_ids = torch.randint(0, loaded.config.vocab_size, (sum(query_lens),), generator=gen).tolist()
        positions = [p for q, s in zip(query_lens, seq_lens) for p in range(s - q, s)]
        before = kv.clone()
        with torch.inference_mode():
            got = graphs.run(input_ids, positions, query_lens, seq_lens, tables).clone()
        replayed = kv.clone()
        kv.copy_(before)
        monkeypatch.setenv("KVMESH_KERNELS", "torch")
        md = AttentionMetadata.build(query_lens=query_lens, seq_lens=seq_lens, block_tables=tables, block_size=BLOCK)
        with torch.inference_mode():
            want = model(torch.tensor(input_ids), torch.tensor(positions), kv, md)
        monkeypatch.setenv("KVMESH_KERNELS", "triton")
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(replayed, kv, rtol=1e-5, atol=1e-5)
        written = torch.zeros(kv.shape[0], BLOCK, dtype=torch.bool)
        for q, s, table in zip(query_lens, seq_lens, tables):
            for p in range(s - q, s):
                written[table[p // BLOCK], p % BLOCK] = True
        untouched = ~written
        assert torch.equal(replayed.permute(0, 3, 1, 2, 4, 5)[untouched], before.permute(0, 3, 1, 2, 4, 5)[untouched])
    assert graphs.num_replays == 3


def test_the_start_up_probe_agrees_with_eager_and_catches_a_replay_of_the_wrong_tokens(monkeypatch):
    loaded = load_model("tiny-llama", progress=False)
    kv = _kv(loaded, 32)
    monkeypatch.setenv("KVMESH_KERNELS", "triton")
    graphs = PrefillGraphs(loaded.model, kv, BLOCK, max_num_batched_tokens=64, max_num_seqs=2,
                           max_model_len=256).capture()
    assert graphs.agreement_with_eager(num_kv_blocks=32) > 0.9999
    assert graphs.num_replays == 0  # the probe is not counted as a served step
    assert graphs.agreement_with_eager(num_kv_blocks=4) is None  # no room for the probe: not checked
    single = PrefillGraphs(loaded.model, kv, BLOCK, max_num_batched_tokens=64, max_num_seqs=1,
                           max_model_len=256).capture()
    assert single.agreement_with_eager(num_kv_blocks=32) > 0.9999  # one prompt a replay: the one over a context

    fill = graphs.inputs.fill

    def off_by_one(input_ids, *rest):  # the classic bug: every token one row late
        fill([0] + input_ids[:-1], *rest)
    monkeypatch.setattr(graphs.inputs, "fill", off_by_one)
    assert graphs.agreement_with_eager(num_kv_blocks=32) < PREFILL_GRAPH_MIN_AGREEMENT


def test_an_engine_replaying_prompt_and_decode_steps_generates_what_the_eager_one_does(monkeypatch):
    """Both graph sets installed (replaying eagerly, every kernel on Triton) in an engine: the runner picks the
    prompt graph for prompt-only steps, the decode graph for decode-only ones, eager for mixed steps, and the
    greedy tokens equal an engine without graphs."""
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    prompts = [list(range(40, 40 + n)) for n in (30, 9, 21)] + [list(range(100, 260))]
    eager = LLM("tiny-llama", max_num_seqs=4, num_kv_blocks=64, max_num_batched_tokens=128, progress=False)
    want = [o.token_ids for o in eager.generate(prompts, params, use_tqdm=False)]  # this CPU's own kernels
    monkeypatch.setenv("KVMESH_KERNELS", "triton")  # what a graph holds

    llm = LLM("tiny-llama", max_num_seqs=4, num_kv_blocks=64, max_num_batched_tokens=128, progress=False)
    runner, engine = llm.engine.runner, llm.engine
    runner.prefill_graphs = PrefillGraphs(runner.model, runner.kv_buffer, BLOCK, 128, 4, engine.max_model_len).capture()
    runner.graphs = DecodeGraphs(runner.model, runner.kv_buffer, BLOCK, 4, engine.max_model_len).capture()
    kinds = []
    prepare = runner.prepare

    def recording(batch, drafts):
        prepared = prepare(batch, drafts)
        kinds.append(prepared.replayed)
        return prepared
    monkeypatch.setattr(runner, "prepare", recording)
    got = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    # Three prompts and the long one's first chunk (a prompt step of 128 tokens), then its next chunks beside
    # the others' decodes (mixed: eager), then decodes only (replays, launched ahead: engine.run_ahead).
    assert kinds[0] is Replayed.PREFILL_GRAPH and kinds[1] is Replayed.EAGER
    assert runner.prefill_graphs.num_replays == kinds.count(Replayed.PREFILL_GRAPH) >= 1
    assert runner.graphs.num_replays >= 2
    engine.check_integrity()
