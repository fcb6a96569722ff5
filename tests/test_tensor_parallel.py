"""Tensor parallelism inside one engine (gloo on the CPU): a model split over ranks computes what it computes
whole, token for token and logit for logit, and its ranks never outlive it or hang."""
from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from kvmesh import LLM, SamplingParams
from kvmesh.errors import KvmeshError
from kvmesh.model.presets import PRESETS
from kvmesh.model.tp_shard import TensorParallelError, TPShard, check_tp_size
from tests.conftest import hf_reference
from tests.processes import still_running

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [list(range(5, 60)), list(range(100, 140)), [7, 8, 9]]


def streams(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def wait_gone(pids: list[int], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while any(still_running(p) for p in pids):
        left = [p for p in pids if still_running(p)]
        assert time.monotonic() < deadline, f"tensor-parallel ranks still running: {left}"
        time.sleep(0.05)


def test_heads_split_evenly_or_replicate_and_bad_sizes_are_refused():
    llama, qwen3 = PRESETS["tiny-llama"].config, PRESETS["tiny-qwen3"].config  # 4 heads over 2 and 1 KV heads
    assert [TPShard(llama, r, 2).kv_head_ids for r in range(2)] == [[0], [1]]
    assert [TPShard(llama, r, 4).kv_head_ids for r in range(4)] == [[0], [0], [1], [1]]  # replicated past 2
    assert [TPShard(qwen3, r, 2).kv_head_ids for r in range(2)] == [[0], [0]]
    local = TPShard(llama, 1, 2).local_config()
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size, local.vocab_size) == (2, 1, 64, 160)
    assert TPShard(llama, 1, 2).vocab_range() == (160, 320)
    with pytest.raises(TensorParallelError, match=r"attention heads \(4\)"):
        check_tp_size(llama, 3)
    with pytest.raises(TensorParallelError, match="KV heads"):
        check_tp_size(dataclasses.replace(llama, num_heads=6, num_kv_heads=3), 2)
    with pytest.raises(TensorParallelError, match="at least 1"):
        check_tp_size(llama, 0)


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen3", "tiny-qwen3-moe", "tiny-mixtral"])
def test_two_ranks_generate_the_one_rank_streams_and_logits(model):
    """tiny-qwen3 has one KV head: both ranks hold it (replicated); the MoE models split every expert's
    intermediate dimension (the router whole). Logprobs of every sampled token match transformers' on the same
    weights within float32 rounding."""
    whole = LLM(model, num_kv_blocks=64, progress=False)
    split = LLM(model, num_kv_blocks=64, progress=False, tensor_parallel_size=2)
    try:
        seqs = [split.engine.add_request(p, GREEDY) for p in PROMPTS]
        while split.engine.has_unfinished():
            split.engine.step()
        assert [s.output_token_ids for s in seqs] == streams(whole, PROMPTS)
        hf = hf_reference(whole.loaded)
        for prompt, seq in zip(PROMPTS, seqs):
            with torch.no_grad():
                logits = hf(torch.tensor([prompt + seq.output_token_ids])).logits[0].float()
            logp = torch.log_softmax(logits, dim=-1)
            want = [float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(seq.output_token_ids)]
            assert seq.output_logprobs == pytest.approx(want, abs=1e-4)
        split.engine.check_integrity()
        assert_same_kv_per_rank(split, whole, PROMPTS[0])
    finally:
        split.close()


def assert_same_kv_per_rank(split: LLM, whole: LLM, prompt: list[int]) -> None:
    """The KV oracle per rank: each rank's cached KV of ``prompt`` is exactly the whole model's KV of the heads
    that rank holds (looked up through each engine's own prefix cache)."""
    def cached_blocks(llm: LLM) -> list[int]:
        return llm.engine.kv.pool.match(llm.engine.kv.hash_prompt(prompt))

    whole_blocks, split_blocks = cached_blocks(whole), cached_blocks(split)
    assert len(whole_blocks) == len(split_blocks) == len(prompt) // 16 >= 3
    reference = whole.engine.runner.kv_buffer[torch.tensor(whole_blocks)]
    parts = split.loaded.model.read_kv(split.engine.runner.kv_buffer, split_blocks)
    assert len(parts) == 2
    for rank, part in enumerate(parts):
        heads = TPShard(whole.loaded.config, rank, 2).kv_head_ids
        assert torch.allclose(part, reference[..., heads, :], rtol=1e-5, atol=1e-5), f"rank {rank}'s KV heads"


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen3-moe"])
def test_dummy_weights_are_drawn_whole_and_cut_the_same_at_every_size(model):
    whole = LLM(model, num_kv_blocks=64, progress=False, load_format="dummy")
    split = LLM(model, num_kv_blocks=64, progress=False, load_format="dummy", tensor_parallel_size=2)
    try:
        assert split.loaded.fingerprint == whole.loaded.fingerprint  # one pool for every TP size
        assert streams(split, PROMPTS) == streams(whole, PROMPTS)
    finally:
        split.close()


def test_smollm2_over_three_ranks_and_a_size_that_does_not_divide_its_heads():
    """SmolLM2-135M has 9 query and 3 KV heads: 2 ranks are refused with the reason, 3 generate its streams."""
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    with pytest.raises(TensorParallelError, match=r"attention heads \(9\)"):
        LLM("smollm2-135m", num_kv_blocks=32, progress=False, tensor_parallel_size=2)
    whole = LLM("smollm2-135m", num_kv_blocks=32, progress=False)
    split = LLM("smollm2-135m", num_kv_blocks=32, progress=False, tensor_parallel_size=3)
    try:
        assert split.loaded.fingerprint == whole.loaded.fingerprint
        assert streams(split, prompts, params) == streams(whole, prompts, params)
    finally:
        split.close()


def test_a_killed_rank_fails_the_step_with_an_error_and_close_leaves_nothing():
    threads = torch.get_num_threads()
    llm = LLM("tiny-llama", num_kv_blocks=64, progress=False, tensor_parallel_size=2)
    assert torch.get_num_threads() == max(1, (os.cpu_count() or 1) // 2)  # the ranks split the cores
    pids = [p.pid for p in llm.ranks._procs]
    try:
        assert streams(llm, PROMPTS[:1])
        os.kill(pids[0], signal.SIGKILL)
        wait_gone(pids)
        start = time.monotonic()
        with pytest.raises(KvmeshError, match="tensor-parallel rank"):
            streams(llm, PROMPTS[:1])
        assert time.monotonic() - start < 30  # an error, not a hang
    finally:
        llm.close()
    wait_gone(pids)
    assert torch.get_num_threads() == threads  # given back


def test_ranks_die_with_their_process():
    code = ("from kvmesh import LLM\n"
            "llm = LLM('tiny-llama', num_kv_blocks=64, progress=False, tensor_parallel_size=2)\n"
            "print(*[p.pid for p in llm.ranks._procs], flush=True)\n"
            "import time; time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert pids and all(still_running(p) for p in pids)
    finally:
        proc.kill()
        proc.wait()
    wait_gone(pids)


def test_cli_generate_takes_a_tensor_parallel_size():
    from tests.test_llm_api import _cli

    args = ("generate", "--model", "tiny-llama", "--prompt", "abc", "--max-tokens", "12", "--ignore-eos")
    whole, split = _cli(*args), _cli(*args, "-tp", "2")
    assert whole.returncode == 0 and split.returncode == 0, split.stderr
    assert split.stdout == whole.stdout
    refused = _cli(*args, "--tensor-parallel-size", "3")
    assert refused.returncode == 2 and "does not divide" in refused.stderr and "Traceback" not in refused.stderr
