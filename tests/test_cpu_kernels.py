"""Native CPU kernels (kernels/cpu): against the torch references and a float64 oracle, through the
dispatch, and the fallback when no compiler is there."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvmesh import LLM, SamplingParams
from kvmesh.kernels import ops
from kvmesh.kernels.cpu import library as native
from kvmesh.kernels.reference import attention as ref_attn
from kvmesh.kernels.reference import cache_ops as ref_cache
from kvmesh.kernels.reference import norm as ref_norm
from kvmesh.kernels.reference.rotary import rotate
from kvmesh.native_build import c_compiler
from tests.test_kernels import dense_oracle
from tests.test_kernels import make_case as make_device_case


def make_case(*args):
    """tests/test_kernels.py's paged case, on the CPU whatever its DEVICE (cuda on a GPU machine)."""
    case = make_device_case(*args)
    return dataclasses.replace(case, query=case.query.cpu(), k_cache=case.k_cache.cpu(), v_cache=case.v_cache.cpu(),
                               block_tables=case.block_tables.cpu())

DECODE_SHAPES = [
    # seq_lens, Hq, Hkv, D, block_size
    ([1, 16, 17, 90], 8, 2, 32, 16),  # a one-token context, exact and ragged block ends
    ([300], 9, 3, 64, 16),  # one sequence: the work is split over KV heads
    ([5, 40, 33, 64, 7, 100, 1, 19], 4, 4, 16, 8),  # more sequences than threads, no GQA
    ([70, 129], 8, 1, 128, 32),  # multi-query, head_dim 128
]


def test_the_library_builds_here_and_shares_torchs_openmp_runtime():
    """This machine has a C compiler (CI's too), so the kernels must load; their OpenMP threads must be
    torch's own pool, not a second one spinning beside it."""
    assert c_compiler() is not None, "no C compiler: the native kernels cannot be tested here"
    assert native.load() is not None
    # In a process of its own: other packages this suite imports bring their own OpenMP (sentencepiece does).
    code = ("from pathlib import Path; import torch; from kvmesh.kernels.cpu import library as native; "
            "assert native.load() is not None; "
            "print('\\n'.join(sorted({line.split()[-1] for line in Path('/proc/self/maps').read_text().splitlines() "
            "if 'libgomp' in line})))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                            timeout=120).stdout.split()
    assert len(loaded) <= 1 and all("/torch/" in path for path in loaded), loaded


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", DECODE_SHAPES)
def test_native_decode_attention_matches_the_reference_and_the_oracle(shape, dtype):
    s_lens, hq, hkv, d, bs = shape
    case = make_case(21, [1] * len(s_lens), s_lens, hq, hkv, d, bs, dtype)
    seq_lens = torch.tensor(s_lens, dtype=torch.int32)
    scale = d**-0.5
    assert native.can_attend(case.query, case.k_cache, case.v_cache)
    ours = native.decode_attention(case.query, case.k_cache, case.v_cache, case.block_tables, seq_lens, scale)
    ref = ref_attn.decode_attention(case.query, case.k_cache, case.v_cache, case.block_tables, seq_lens,
                                    max(s_lens), scale)
    oracle = dense_oracle(case, scale)
    assert ours.dtype == dtype and ours.shape == case.query.shape
    if dtype == torch.float32:
        assert (ours.double() - oracle).abs().max().item() < 1e-5
        assert (ours - ref).abs().max().item() < 1e-5
    else:  # the same roundings as the reference: at most a bf16 rounding apart, as close to the oracle
        assert (ours.float() - ref.float()).abs().max().item() <= 2**-7 * ref.float().abs().max().item()
        ours_err = (ours.double() - oracle).abs().max().item()
        assert ours_err <= 1.1 * (ref.double() - oracle).abs().max().item() + 1e-3


PREFILL_CASES = [
    # query_lens, seq_lens, Hq, Hkv, D, block_size
    ([5], [5], 2, 2, 16, 16),  # a fresh prompt shorter than a block
    ([17, 1, 40], [17, 30, 77], 4, 2, 32, 16),  # ragged: fresh, one token over a context, a chunk over one
    ([32], [2048], 9, 3, 64, 16),  # SmolLM2's heads: a 32-token suffix over a 2k cached prefix
    ([70, 33], [75, 300], 8, 2, 96, 8),  # several token tiles, head_dim past a multiple of 64, small blocks
    ([20], [52], 3, 1, 64, 12),  # blocks of 12: key tiles end at block ends, not every 16
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case_args", PREFILL_CASES)
def test_native_prefill_attention_matches_the_reference_and_the_oracle(case_args, dtype):
    q_lens, s_lens, hq, hkv, d, bs = case_args
    case = make_case(17, q_lens, s_lens, hq, hkv, d, bs, dtype)
    scale = d**-0.5
    assert native.can_attend(case.query, case.k_cache, case.v_cache)
    ours = native.prefill_attention(case.query, case.k_cache, case.v_cache, case.block_tables, q_lens, s_lens, scale)
    oracle = dense_oracle(case, scale)
    assert ours.dtype == dtype and ours.shape == case.query.shape
    if dtype == torch.float32:  # the reference is torch's SDPA: only the order of the sums differs
        ref = ref_attn.prefill_attention(case.query, case.k_cache, case.v_cache, case.block_tables, q_lens, s_lens,
                                         scale)
        assert (ours.double() - oracle).abs().max().item() < 1e-5
        assert (ours - ref).abs().max().item() < 1e-5
    else:  # the chunked reference's roundings: at most a bf16 rounding apart, as close to the oracle
        start, ref = 0, torch.empty_like(case.query)
        for i, (q_len, s_len) in enumerate(zip(q_lens, s_lens)):
            k = ref_attn.gather_kv(case.k_cache, case.block_tables[i], s_len)
            v = ref_attn.gather_kv(case.v_cache, case.block_tables[i], s_len)
            ref[start:start + q_len] = ref_attn.chunked_causal_attention(case.query[start:start + q_len], k, v,
                                                                         s_len - q_len, scale)
            start += q_len
        assert (ours.float() - ref.float()).abs().max().item() <= 2**-7 * ref.float().abs().max().item()
        assert (ours.double() - oracle).abs().max().item() <= 1.1 * (ref.double() - oracle).abs().max().item() + 1e-3


def test_prefill_dispatch_takes_the_native_kernel_where_it_is_faster(monkeypatch):
    """fp32 for a few new tokens, and past that where it measured faster on this machine; bf16 for up to 32 new
    tokens, and on AMX CPUs up to 16 over a cached context (past that, and for fresh prompts, torch's flash kernel)."""
    calls = []
    real = native.prefill_attention
    monkeypatch.setattr(native, "prefill_attention", lambda *a: calls.append(a[0].dtype) or real(*a))
    amx = {"avx512f", "amx_tile"}
    for dtype, q_len, s_len, faster, features, expected in [
            (torch.float32, 70, 100, True, {"avx512f"}, [torch.float32]),
            (torch.float32, 70, 100, False, {"avx512f"}, []),
            (torch.float32, 8, 100, False, {"avx512f"}, [torch.float32]),
            (torch.bfloat16, 32, 100, False, {"avx512f"}, [torch.bfloat16]),
            (torch.bfloat16, 33, 100, True, {"avx512f"}, []),
            (torch.bfloat16, 16, 100, True, amx, [torch.bfloat16]),
            (torch.bfloat16, 17, 100, True, amx, []),
            (torch.bfloat16, 16, 16, True, amx, []),  # a fresh prompt: no context
            (torch.bfloat16, 16, 16, True, {"avx512f"}, [torch.bfloat16])]:
        monkeypatch.setattr(ops, "cpu_features", lambda features=features: features)
        monkeypatch.setattr(ops, "native_fp32_prefill_is_faster", lambda *shape, faster=faster: faster)
        case = make_case(4, [q_len], [s_len], 4, 2, 32, 16, dtype)
        calls.clear()
        out = ops.prefill_attention(case.query, case.k_cache, case.v_cache, case.block_tables, None, None,
                                    [q_len], [s_len], q_len, 0.2)
        assert calls == expected
        assert (out.double() - dense_oracle(case, 0.2)).abs().max().item() < (1e-5 if dtype == torch.float32 else 0.05)


def test_the_fp32_prefill_choice_is_measured_once_per_shape(monkeypatch):
    """The measurement times both kernels on this machine and is kept; a native kernel that refuses loses."""
    ops.native_fp32_prefill_is_faster.cache_clear()
    timed = []
    real = native.prefill_attention
    monkeypatch.setattr(native, "prefill_attention", lambda *a: timed.append(a[0].shape) or real(*a))
    first = ops.native_fp32_prefill_is_faster(4, 2, 32, 16, 1)
    assert isinstance(first, bool) and timed == [(64, 4, 32)] * 3
    assert ops.native_fp32_prefill_is_faster(4, 2, 32, 16, 1) == first and len(timed) == 3  # kept

    def refuses(*a):
        raise native.NativeKernelError("prefill_attention returned -2")
    monkeypatch.setattr(native, "prefill_attention", refuses)
    assert ops.native_fp32_prefill_is_faster(4, 2, 32, 16, 2) is False
    ops.native_fp32_prefill_is_faster.cache_clear()


def test_native_decode_attention_refuses_what_it_cannot_take():
    case = make_case(3, [1], [20], 4, 2, 24, 16, torch.float32)  # head_dim 24: not a multiple of 16
    assert not native.can_attend(case.query, case.k_cache, case.v_cache)
    case = make_case(3, [1], [20], 4, 2, 32, 16, torch.float16)  # no fp16 kernel
    assert not native.can_attend(case.query, case.k_cache, case.v_cache)
    seq_lens = torch.tensor([20], dtype=torch.int32)
    odd = make_case(3, [1], [20], 4, 2, 24, 16, torch.float32)
    with pytest.raises(native.NativeKernelError, match="returned -2"):
        native.decode_attention(odd.query, odd.k_cache, odd.v_cache, odd.block_tables, seq_lens, 0.2)
    with pytest.raises(native.NativeKernelError, match="returned -2"):
        native.prefill_attention(odd.query, odd.k_cache, odd.v_cache, odd.block_tables, [1], [20], 0.2)
    # the dispatch falls back to the reference for it
    out = ops.decode_attention(odd.query, odd.k_cache, odd.v_cache, odd.block_tables, seq_lens, 20, 0.2)
    assert (out.double() - dense_oracle(odd, 0.2)).abs().max().item() < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 16, 300])  # 300 rows: the threaded path
def test_native_rms_norm_and_its_fused_residual_add(dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 576, generator=gen) * 3).to(dtype)
    x[:, 7] = 200.0  # an outlier channel, as real hidden states have
    residual = torch.randn(rows, 576, generator=gen).to(dtype)
    weight = (torch.rand(576, generator=gen) + 0.5).to(dtype)
    assert native.can_norm(x, weight)
    ref = ref_norm.rms_norm(x, weight, 1e-5)
    ours = native.rms_norm(x.clone(), weight, 1e-5)
    exact = (x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-5)) * weight.double()
    if dtype == torch.float32:
        assert (ours - ref).abs().max().item() < 1e-5 * exact.abs().max().item()
    else:  # a different order of the float32 sum may move a rounding, by one bf16 step at most
        assert (ours.float() - ref.float()).abs().max().item() <= 2**-7 * exact.abs().max().item()
        assert (ours != ref).float().mean().item() < 0.01
    total, want = ref_norm.add_rms_norm(x, residual, weight, 1e-5)
    stream = x.clone()
    normed = native.rms_norm(stream, weight, 1e-5, residual=residual)
    assert torch.equal(stream, total)  # the residual add is exact and in place
    assert (normed.float() - want.float()).abs().max().item() <= 2**-7 * exact.abs().max().item() + 1e-5
    with pytest.raises(ValueError, match="does not match"):
        native.rms_norm(x, weight, 1e-5, residual=residual[:, :10])


@pytest.mark.parametrize("rows, vocab", [(1, 7), (9, 300), (3, 49152)])  # short of one lane group; 3 x 49152: threads
def test_native_greedy_pick_is_each_rows_first_maximum_and_its_logprob(rows, vocab):
    """Against a float64 oracle: the first index of each row's maximum (ties: the lowest id, as argmax), its
    log_softmax there; a row holding a NaN, +inf or -inf anywhere (in the lanes or the tail) gets -1."""
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(rows, vocab, generator=gen) * 6
    if rows > 1:
        logits[1, vocab // 2] = logits[1, vocab - 1] = logits[1].max() + 1  # a tie: the first one wins
    ids, logprobs = native.greedy_pick(logits.numpy())
    oracle = torch.log_softmax(logits.double(), -1)
    for r in range(rows):
        assert ids[r] == int(logits[r].argmax()) == int(torch.nonzero(logits[r] == logits[r].max())[0])
        assert logprobs[r] == pytest.approx(oracle[r, ids[r]].item(), abs=1e-6)
    for bad in (float("nan"), float("inf"), float("-inf")):
        for where in (0, vocab - 1):  # in the first lanes, in the tail past the last whole lane group
            broken = logits.clone()
            broken[rows - 1, where] = bad
            got_ids, got_logprobs = native.greedy_pick(broken.numpy())
            assert got_ids[rows - 1] == -1 and got_logprobs[rows - 1] != got_logprobs[rows - 1], (bad, where)
            assert got_ids[: rows - 1] == ids[: rows - 1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [3, 600])  # 600 tokens: the threaded path
def test_native_rope_store_equals_rotate_then_store(dtype, num_tokens):
    """Element-wise with the same roundings: bitwise equal to the torch path, every slot it writes and
    none it does not."""
    hq, hkv, d, bs, num_blocks = 6, 2, 32, 16, 64
    gen = torch.Generator().manual_seed(num_tokens)
    qkv = torch.randn(num_tokens, (hq + 2 * hkv) * d, generator=gen).to(dtype)
    angles = torch.randn(num_tokens, 1, d, generator=gen)
    cos, signed_sin = angles.cos().to(dtype), angles.sin().to(dtype)
    slots = torch.randperm(num_blocks * bs, generator=gen)[:num_tokens]
    block_ids, offsets = slots // bs, slots % bs
    initial = torch.randn(num_blocks, 3, 2, bs, hkv, d, generator=gen).to(dtype)
    buffers = [initial.clone(), initial.clone()]
    q = native.rope_store(qkv, cos.view(num_tokens, d), signed_sin.view(num_tokens, d), buffers[0][:, 1, 0],
                          buffers[0][:, 1, 1], block_ids, offsets, hq)
    qk = rotate(qkv[:, : (hq + hkv) * d].view(num_tokens, hq + hkv, d), cos, signed_sin)
    v = qkv[:, (hq + hkv) * d:].view(num_tokens, hkv, d)
    ref_cache.store_kv_at(qk[:, hq:], v, buffers[1][:, 1, 0], buffers[1][:, 1, 1], block_ids, offsets)
    assert torch.equal(q, qk[:, :hq])
    assert torch.equal(buffers[0], buffers[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernels_take_a_tensor_parallel_ranks_heads_of_a_whole_buffer(dtype):
    """A rank's KV heads are a view of a buffer of every head (positions further apart than its heads): the
    kernels read and write through that view as the torch path does on a contiguous copy, and never touch
    the other ranks' heads."""
    hq, hkv_whole, d, bs, num_blocks = 4, 4, 32, 16, 12
    gen = torch.Generator().manual_seed(5)
    whole = torch.randn(num_blocks, 2, 2, bs, hkv_whole, d, generator=gen).to(dtype)
    mine = whole[..., 1:3, :]  # heads 1 and 2 of 4: this rank's
    k_cache, v_cache = mine[:, 1, 0], mine[:, 1, 1]
    assert native.can_attend(torch.empty(3, hq, d, dtype=dtype), k_cache, v_cache)
    tables = torch.randperm(num_blocks, generator=gen)[:8].view(2, 4).to(torch.int32)
    query = torch.randn(2, hq, d, generator=gen).to(dtype)
    seq_lens = torch.tensor([50, 37], dtype=torch.int32)
    ours = native.decode_attention(query, k_cache, v_cache, tables, seq_lens, 0.2)
    ref = ref_attn.decode_attention(query, k_cache.contiguous(), v_cache.contiguous(), tables, seq_lens, 50, 0.2)
    assert (ours.float() - ref.float()).abs().max().item() <= (1e-5 if dtype == torch.float32 else 0.02)
    prompt = torch.randn(20, hq, d, generator=gen).to(dtype)
    ours = native.prefill_attention(prompt, k_cache, v_cache, tables[:1], [20], [50], 0.2)
    ref = native.prefill_attention(prompt, k_cache.contiguous(), v_cache.contiguous(), tables[:1], [20], [50], 0.2)
    assert torch.equal(ours, ref)  # the same kernel over the same values: only the addresses differ
    qkv = torch.randn(5, (hq + 2 * 2) * d, generator=gen).to(dtype)
    angles = torch.randn(5, d, generator=gen)
    before = whole.clone()
    block_ids, offsets = torch.tensor([3, 3, 7, 0, 11]), torch.tensor([0, 1, 15, 4, 9])
    native.rope_store(qkv, angles.cos().to(dtype), angles.sin().to(dtype), k_cache, v_cache, block_ids, offsets, hq)
    contiguous = before[..., 1:3, :].contiguous()
    native.rope_store(qkv, angles.cos().to(dtype), angles.sin().to(dtype), contiguous[:, 1, 0], contiguous[:, 1, 1],
                      block_ids, offsets, hq)
    assert torch.equal(mine, contiguous)
    assert torch.equal(whole[..., [0, 3], :], before[..., [0, 3], :])  # the other ranks' heads untouched


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_streams_equal_with_and_without_the_native_kernels(dtype, monkeypatch):
    """The whole decode path (rope+store, norms with fused adds, paged decode and prefill attention, the prompts
    sharing a cached prefix) through the engine: greedy tokens equal to the torch kernels', for ragged batches
    that grow past several blocks."""
    prompts = [list(range(3, 3 + n)) for n in (5, 17, 40, 64)]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    runs = {}
    for mode in ("torch", "auto"):
        monkeypatch.setenv("KVMESH_KERNELS", mode)
        llm = LLM("tiny-llama", dtype=dtype, device="cpu", num_kv_blocks=64, progress=False)
        runs[mode] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        llm.engine.check_integrity()
    assert runs["auto"] == runs["torch"]


def test_an_unwritable_cache_dir_falls_back_with_the_reason(monkeypatch, tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("KVMESH_CACHE_DIR", str(blocker))
    native.forget()
    try:
        with caplog.at_level("WARNING"):
            assert native.load() is None
        assert "cannot write" in caplog.text
    finally:
        native.forget()


def test_without_a_compiler_the_torch_kernels_serve(tmp_path):
    """A machine with no working C compiler: load() says why once and gives None; a model still runs."""
    code = ("import logging; logging.basicConfig(level=logging.INFO)\n"
            "from kvmesh.kernels.cpu import library\n"
            "assert library.load() is None\n"
            "from kvmesh import LLM, SamplingParams\n"
            "out = LLM('tiny-llama', device='cpu', num_kv_blocks=32, progress=False).generate([[5, 6, 7]],"
            " SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)\n"
            "assert len(out[0].token_ids) == 4\n")
    env = {**os.environ, "CC": "false", "KVMESH_CACHE_DIR": str(tmp_path), "KVMESH_KERNELS": "auto"}
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "native CPU kernels off" in proc.stderr


def test_results_do_not_depend_on_the_thread_count():
    """Threads only share out whole (sequence, KV head) items and rows: one thread gives the same bits."""
    case = make_case(5, [1] * 3, [40, 300, 77], 8, 2, 64, 16, torch.bfloat16)
    seq_lens = torch.tensor([40, 300, 77], dtype=torch.int32)
    prefill = make_case(6, [70], [300], 8, 2, 64, 16, torch.bfloat16)  # 3 token tiles x 2 KV heads
    x = torch.randn(400, 576).to(torch.bfloat16)
    weight = torch.rand(576).to(torch.bfloat16)
    runs = []
    saved = torch.get_num_threads()
    try:
        for threads in (1, 2, 4):
            torch.set_num_threads(threads)
            runs.append((native.decode_attention(case.query, case.k_cache, case.v_cache, case.block_tables,
                                                 seq_lens, 0.125), native.rms_norm(x, weight, 1e-5),
                         native.prefill_attention(prefill.query, prefill.k_cache, prefill.v_cache,
                                                  prefill.block_tables, [70], [300], 0.125)))
    finally:
        torch.set_num_threads(saved)
    for attn, norm, prefill_attn in runs[1:]:
        assert torch.equal(attn, runs[0][0]) and torch.equal(norm, runs[0][1]) and torch.equal(prefill_attn, runs[0][2])


def test_the_portable_build_without_avx512_agrees(monkeypatch, tmp_path):
    """Machines without AVX-512 compile the plain C loops (here: -mno-avx512f): same answers."""
    monkeypatch.setenv("KVMESH_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(native, "FLAGS", native.FLAGS + ("-mno-avx512f",))
    native.forget()
    try:
        assert native.load() is not None
        for dtype in (torch.float32, torch.bfloat16):
            s_lens = [1, 16, 17, 90]
            case = make_case(21, [1] * 4, s_lens, 8, 2, 32, 16, dtype)
            seq_lens = torch.tensor(s_lens, dtype=torch.int32)
            ours = native.decode_attention(case.query, case.k_cache, case.v_cache, case.block_tables, seq_lens, 0.2)
            ref = ref_attn.decode_attention(case.query, case.k_cache, case.v_cache, case.block_tables, seq_lens,
                                            max(s_lens), 0.2)
            assert (ours.float() - ref.float()).abs().max().item() <= 2**-7 * ref.float().abs().max().item() + 1e-6
            case = make_case(22, [40, 3], [40, 90], 8, 2, 32, 16, dtype)
            ours = native.prefill_attention(case.query, case.k_cache, case.v_cache, case.block_tables, [40, 3],
                                            [40, 90], 0.2)
            oracle = dense_oracle(case, 0.2)
            assert (ours.double() - oracle).abs().max().item() < (1e-5 if dtype == torch.float32 else 0.05)
            x, w = torch.randn(5, 64).to(dtype), torch.rand(64).to(dtype)
            assert (native.rms_norm(x, w, 1e-5).float() - ref_norm.rms_norm(x, w, 1e-5).float()).abs().max() < 2e-2
        assert list(tmp_path.glob("native/*.so"))  # it really was a second build
    finally:
        native.forget()  # the next caller loads the default build again
