"""Kernels: torch references against a dense float64 oracle; Triton against the torch references.

On machines without CUDA, Triton runs in its interpreter (TRITON_INTERPRET=1, set in
conftest) in fp32 and fp16; bf16 ``tl.dot`` is wrong in the interpreter, so bf16 is
checked in tests/gpu only.
"""
from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass

import pytest
import torch

from kvmesh.kernels.reference import attention as ref_attn
from kvmesh.kernels.reference import cache_ops as ref_cache

if importlib.util.find_spec("triton") is None:
    pytest.skip("Triton is not installed", allow_module_level=True)
# Triton is installed: a kernel module that fails to import is a failure here, not 72 silent skips.
from kvmesh.kernels.triton import attention as triton_attn  # noqa: E402
from kvmesh.kernels.triton import cache_ops as triton_cache  # noqa: E402
from kvmesh.kernels.triton import fused as triton_fused  # noqa: E402
from kvmesh.kernels.triton import moe as triton_moe  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] if DEVICE == "cpu" else [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


@dataclass
class PagedCase:
    query: torch.Tensor  # [T, Hq, D], sequences back to back
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    query_lens: list[int]
    seq_lens: list[int]
    dense_k: list[torch.Tensor]  # per sequence [seq_len, Hkv, D]
    dense_v: list[torch.Tensor]


def make_case(seed: int, query_lens: list[int], seq_lens: list[int], num_heads: int, num_kv_heads: int,
              head_dim: int, block_size: int, dtype: torch.dtype, num_layers: int = 2) -> PagedCase:
    """Random K/V per sequence, scattered into a block-major buffer under a shuffled block table."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 5
    buffer = torch.randn(num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    k_cache, v_cache = buffer[:, 1, 0], buffer[:, 1, 1]  # a strided layer view, as the model uses
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, dense_k, dense_v = [], [], []
    for n in blocks_per_seq:
        table, order = order[:n], order[n:]
        tables.append(table + [0] * (max(blocks_per_seq) - n))
    for table, s in zip(tables, seq_lens):
        dense_k.append(torch.cat([k_cache[b] for b in table])[:s])
        dense_v.append(torch.cat([v_cache[b] for b in table])[:s])
    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen).to(dtype)
    to = lambda t: t.to(DEVICE)  # noqa: E731
    return PagedCase(to(query), to(k_cache), to(v_cache), to(torch.tensor(tables, dtype=torch.int32)),
                     query_lens, seq_lens, dense_k, dense_v)


def dense_oracle(case: PagedCase, scale: float) -> torch.Tensor:
    """Textbook causal attention in float64 on contiguous K/V."""
    outs = []
    start = 0
    group = case.query.shape[1] // case.dense_k[0].shape[1]
    for q_len, s_len, k, v in zip(case.query_lens, case.seq_lens, case.dense_k, case.dense_v):
        q = case.query[start : start + q_len].cpu().double()
        k = k.double().repeat_interleave(group, dim=1)
        v = v.double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        q_pos = torch.arange(s_len - q_len, s_len)[:, None]
        scores = scores.masked_fill(torch.arange(s_len)[None, :] > q_pos, -math.inf)
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
        start += q_len
    return torch.cat(outs)


PREFILL_SHAPES = [
    # query_lens, seq_lens, Hq, Hkv, D, block_size
    ([5], [5], 2, 2, 16, 16),
    ([17, 1, 40], [17, 30, 77], 4, 2, 32, 16),  # odd lengths, a prefill chunk on a cached prefix
    ([33, 7], [100, 7], 6, 2, 24, 16),  # head_dim not a power of two, GQA 3
    ([20], [52], 3, 1, 64, 32),
]


@pytest.mark.parametrize("shape", PREFILL_SHAPES)
def test_reference_prefill_attention_matches_dense_oracle(shape):
    q_lens, s_lens, hq, hkv, d, bs = shape
    case = make_case(11, q_lens, s_lens, hq, hkv, d, bs, torch.float32)
    scale = d**-0.5
    out = ref_attn.prefill_attention(case.query, case.k_cache, case.v_cache, case.block_tables,
                                     q_lens, s_lens, scale)
    assert (out.cpu().double() - dense_oracle(case, scale)).abs().max().item() < 1e-5
    # A step's layers share each sequence's block ids and mask: the second call (as the next layer) reads them back.
    per_step: dict = {}
    for _ in range(2):
        shared = ref_attn.prefill_attention(case.query, case.k_cache, case.v_cache, case.block_tables, q_lens, s_lens,
                                            scale, per_step)
        assert torch.equal(shared, out)
    assert len([key for key in per_step if key[0] == "prefill_mask"]) == sum(q < s for q, s in zip(q_lens, s_lens))


CHUNKED_SHAPES = [
    # query_lens, seq_lens, Hq, Hkv, D, block_size: several query chunks, with and without a cached prefix
    ([300], [300], 9, 3, 64, 16),
    ([200, 150], [1100, 150], 4, 2, 32, 16),  # long prefix: the chunk shrinks to bound the scores
    ([130], [129 + 130], 2, 1, 16, 32),
    ([5, 1], [5, 40], 2, 2, 16, 16),  # short: one chunk, one row
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", CHUNKED_SHAPES)
def test_reference_prefill_in_reduced_precision_takes_the_chunked_path_and_matches_the_oracle(shape, dtype,
                                                                                              monkeypatch):
    monkeypatch.setattr(ref_attn, "cpu_features", lambda: ["avx512_bf16", "avx512f"])  # no AMX: the chunked path
    q_lens, s_lens, hq, hkv, d, bs = shape
    case = make_case(13, q_lens, s_lens, hq, hkv, d, bs, dtype)
    scale = d**-0.5
    out = ref_attn.prefill_attention(case.query.cpu(), case.k_cache.cpu(), case.v_cache.cpu(),
                                     case.block_tables.cpu(), q_lens, s_lens, scale)
    assert out.dtype == dtype
    err = (out.double() - dense_oracle(case, scale)).abs().max().item()
    assert err < (3e-2 if dtype == torch.bfloat16 else 4e-3), err
    # The fp32 SDPA path on the same inputs agrees as closely: the chunking adds no error of its own.
    sdpa = ref_attn.prefill_attention(case.query.cpu().float(), case.k_cache.cpu().float(),
                                      case.v_cache.cpu().float(), case.block_tables.cpu(), q_lens, s_lens, scale)
    assert (out.double() - sdpa.double()).abs().max().item() < 2 * err + 1e-3


def test_reference_prefill_in_bf16_on_an_amx_cpu_takes_sdpa(monkeypatch):
    """With AMX, torch's flash kernel is the faster bf16 path (docs/benchmarks.md); it must agree as well."""
    q_lens, s_lens, hq, hkv, d, bs = CHUNKED_SHAPES[1]
    case = make_case(13, q_lens, s_lens, hq, hkv, d, bs, torch.bfloat16)
    args = (case.query.cpu(), case.k_cache.cpu(), case.v_cache.cpu(), case.block_tables.cpu(), q_lens, s_lens, d**-0.5)
    calls = []
    monkeypatch.setattr(ref_attn, "chunked_causal_attention", lambda *a: calls.append(a))
    monkeypatch.setattr(ref_attn, "cpu_features", lambda: ["amx_bf16", "amx_tile", "avx512_bf16", "avx512f"])
    out = ref_attn.prefill_attention(*args)
    assert calls == []
    assert (out.double() - dense_oracle(case, d**-0.5)).abs().max().item() < 3e-2


def test_reference_decode_attention_matches_dense_oracle():
    s_lens = [1, 16, 17, 90]
    case = make_case(12, [1] * 4, s_lens, 8, 2, 32, 16, torch.float32)
    seq_lens = torch.tensor(s_lens, dtype=torch.int32, device=DEVICE)
    out = ref_attn.decode_attention(case.query, case.k_cache, case.v_cache, case.block_tables, seq_lens,
                                    max(s_lens), 0.2)
    assert (out.cpu().double() - dense_oracle(case, 0.2)).abs().max().item() < 1e-5


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", PREFILL_SHAPES)
def test_triton_prefill_attention_matches_reference(shape, dtype):
    q_lens, s_lens, hq, hkv, d, bs = shape
    case = make_case(21, q_lens, s_lens, hq, hkv, d, bs, dtype)
    starts = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32, device=DEVICE)
    seq_lens = torch.tensor(s_lens, dtype=torch.int32, device=DEVICE)
    scale = d**-0.5
    got = triton_attn.prefill_attention(case.query, case.k_cache, case.v_cache, case.block_tables, seq_lens,
                                        starts, max(q_lens), scale)
    want = ref_attn.prefill_attention(case.query.float(), case.k_cache.float(), case.v_cache.float(),
                                      case.block_tables, q_lens, s_lens, scale)
    assert (got.float() - want).abs().max().item() < TOL[dtype]


@pytest.mark.parametrize("config", [(16, 64, 4, 3), (128, 128, 8, 2), (128, 32, 4, 3)])
def test_triton_prefill_tiles_agree_over_cached_prefixes(config):
    """Every tile shape the device sweep times (and the Hopper default, 128 x 128) over prompts on top of
    cached prefixes: keys before the diagonal unmasked, the rest masked, pages gathered across blocks."""
    q_lens, s_lens = [150, 3, 70], [300, 3, 200]
    case = make_case(24, q_lens, s_lens, 4, 2, 32, 16, torch.float16)
    starts = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32, device=DEVICE)
    got = triton_attn.prefill_attention(case.query, case.k_cache, case.v_cache, case.block_tables,
                                        torch.tensor(s_lens, dtype=torch.int32, device=DEVICE), starts, max(q_lens),
                                        32**-0.5, config=triton_attn.PrefillConfig(*config))
    assert (dense_oracle(case, 32**-0.5) - got.double().cpu()).abs().max().item() < TOL[torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("q_lens,hq,hkv,d", [([5], 2, 2, 16), ([17, 40, 1], 4, 2, 32), ([33, 7], 6, 2, 24)])
def test_fresh_prompts_attention_on_the_computed_keys_equals_the_paged_reference(q_lens, hq, hkv, d, dtype):
    """The path CUDA takes for long prompts without a cached prefix: SDPA on the keys and values as the layer
    computed them (here: views of one fused buffer, as the projection lays them out), against the reference
    reading the same keys from the blocks."""
    from kvmesh.kernels import ops
    case = make_case(23, q_lens, q_lens, hq, hkv, d, 16, dtype)
    keys, values = (torch.cat([ref_attn.gather_kv(cache, case.block_tables[i], n) for i, n in enumerate(q_lens)])
                    for cache in (case.k_cache, case.v_cache))
    fused = torch.cat([keys.flatten(1), values.flatten(1)], dim=1)
    got = ops.fresh_prompts_attention(case.query, fused[:, : hkv * d].view(-1, hkv, d),
                                      fused[:, hkv * d:].view(-1, hkv, d), q_lens, d**-0.5)
    want = ref_attn.prefill_attention(case.query.float(), case.k_cache.float(), case.v_cache.float(),
                                      case.block_tables, q_lens, q_lens, d**-0.5)
    assert (got.float() - want).abs().max().item() < TOL[dtype]
    assert (dense_oracle(case, d**-0.5) - got.double().cpu()).abs().max().item() < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("s_lens,hq,hkv,d", [([3, 16, 17, 61], 4, 4, 16), ([200, 9], 9, 3, 40),
                                             ([1000, 3], 8, 2, 32)])  # split-K with an empty split
def test_triton_decode_attention_matches_reference(s_lens, hq, hkv, d, dtype):
    """The first shape fills the device with one split per sequence (its output written directly), the others
    split their contexts and merge."""
    splits = triton_attn._num_splits(len(s_lens), hkv, max(s_lens), 64)
    assert (splits == 1) == (s_lens == [3, 16, 17, 61]) or DEVICE == "cuda"
    case = make_case(22, [1] * len(s_lens), s_lens, hq, hkv, d, 16, dtype)
    seq_lens = torch.tensor(s_lens, dtype=torch.int32, device=DEVICE)
    got = triton_attn.decode_attention(case.query, case.k_cache, case.v_cache, case.block_tables, seq_lens, 0.3)
    want = ref_attn.decode_attention(case.query.float(), case.k_cache.float(), case.v_cache.float(),
                                     case.block_tables, seq_lens, max(s_lens), 0.3)
    assert (got.float() - want).abs().max().item() < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads,head_dim", [(2, 16), (3, 24)])
def test_triton_store_kv_matches_reference(num_heads, head_dim, dtype):
    gen = torch.Generator().manual_seed(31)
    buf = torch.randn(9, 3, 2, 16, num_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    key = torch.randn(23, num_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    value = torch.randn(23, num_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    slots = torch.randperm(9 * 16, generator=gen)[:23]
    slots[[4, 11]] = -1  # padding tokens: must not be written
    slots = slots.to(DEVICE)
    want = buf.clone()
    ref_cache.store_kv(key, value, want[:, 2, 0], want[:, 2, 1], slots)
    got = buf.clone()
    triton_cache.store_kv(key, value, got[:, 2, 0], got[:, 2, 1], slots)
    assert torch.equal(got, want)
    assert not torch.equal(want, buf)  # the reference really wrote something


@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_pack_unpack_match_reference(dtype):
    gen = torch.Generator().manual_seed(41)
    buf = torch.randn(12, 2, 2, 16, 3, 20, generator=gen).to(dtype).to(DEVICE)
    ids = torch.tensor([7, 2, 3, 11, 0], device=DEVICE)
    packed = triton_cache.pack_blocks(buf, ids)
    assert torch.equal(packed, ref_cache.pack_blocks(buf, ids))
    dest_ref, dest = torch.zeros_like(buf), torch.zeros_like(buf)
    dest_ids = torch.tensor([1, 9, 4, 5, 10], device=DEVICE)
    ref_cache.unpack_blocks(dest_ref, dest_ids, packed)
    triton_cache.unpack_blocks(dest, dest_ids, packed)
    assert torch.equal(dest, dest_ref)
    assert torch.equal(dest[9], buf[2]) and dest[0].abs().sum() == 0


# Fused kernels round where the references round, so in fp32 they agree to float32 noise and in 16-bit
# types to one rounding of the activation dtype (a 16-bit value's last place).
FUSED_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 100])
def test_triton_rms_norm_and_its_residual_add_match_reference(hidden, dtype):
    from kvmesh.kernels.reference import norm as ref_norm
    gen = torch.Generator().manual_seed(51)
    x = (torch.randn(7, hidden, generator=gen) * 3).to(dtype).to(DEVICE)
    residual = torch.randn(7, hidden, generator=gen).to(dtype).to(DEVICE)
    weight = (torch.rand(hidden, generator=gen) + 0.5).to(dtype).to(DEVICE)
    want = ref_norm.rms_norm(x, weight, 1e-5)
    got = triton_fused.rms_norm(x.clone(), weight, 1e-5)
    assert (got.float() - want.float()).abs().max().item() <= FUSED_TOL[dtype] * want.float().abs().max().item()
    want_sum, want_normed = ref_norm.add_rms_norm(x, residual, weight, 1e-5)
    stream = x.clone()
    got_normed = triton_fused.rms_norm(stream, weight, 1e-5, residual=residual)
    assert torch.equal(stream, want_sum)  # the sum lands in the stream, in place, exactly
    assert (got_normed.float() - want_normed.float()).abs().max().item() <= \
        FUSED_TOL[dtype] * want_normed.float().abs().max().item()


@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_silu_mul_matches_reference(dtype):
    gen = torch.Generator().manual_seed(52)
    gate_up = (torch.randn(5, 2 * 3000, generator=gen) * 4).to(dtype).to(DEVICE)  # two column tiles, a ragged one
    gate, up = gate_up.chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    got = triton_fused.silu_mul(gate_up)
    assert got.shape == want.shape
    assert (got.float() - want.float()).abs().max().item() <= FUSED_TOL[dtype] * want.float().abs().max().item()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(4, 2, 16), (6, 2, 64), (3, 3, 32)])
def test_triton_rope_store_matches_reference(num_heads, num_kv_heads, head_dim, dtype, monkeypatch):
    from kvmesh.kernels import ops
    from kvmesh.kernels.attention_metadata import AttentionMetadata
    from kvmesh.model.rope import RotaryEmbedding
    gen = torch.Generator().manual_seed(53)
    num_tokens = 11
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(dtype).to(DEVICE)
    rope = RotaryEmbedding(head_dim, 64, 10000.0, None).to(DEVICE)
    positions = torch.randint(0, 64, (num_tokens,), generator=gen).to(DEVICE)
    cos, sin = rope.lookup(positions, dtype)
    md = AttentionMetadata.build(query_lens=[num_tokens], seq_lens=[num_tokens], block_tables=[[3, 1]],
                                 block_size=16, device=DEVICE)
    md.slot_mapping[[2, 7]] = -1  # padding rows: nothing stored for them
    buf = torch.zeros(4, 2, 2, 16, num_kv_heads, head_dim, dtype=dtype, device=DEVICE)
    monkeypatch.setenv("KVMESH_KERNELS", "torch")
    want_buf = buf.clone()
    md.slot_block_ids = md.slot_offsets = None  # the reference writes by slot, like the kernel
    want_keys = torch.full((num_tokens, num_kv_heads, head_dim), float("nan"), dtype=dtype, device=DEVICE)
    want_q = ops.rope_store(qkv, cos, sin, want_buf[:, 1, 0], want_buf[:, 1, 1], md, num_heads, keys_out=want_keys)
    got_buf = buf.clone()
    got_keys = torch.full_like(want_keys, float("nan"))
    got_q = triton_fused.rope_store(qkv, cos, sin, got_buf[:, 1, 0], got_buf[:, 1, 1], md.slot_mapping, num_heads,
                                    keys_out=got_keys)
    assert got_q.shape == want_q.shape and got_q.is_contiguous()
    tol = FUSED_TOL[dtype] * 4  # rotated values are up to ~2x the inputs
    assert (got_q.float() - want_q.float()).abs().max().item() <= tol
    # The rotated keys written out for every token (padding rows too: attention on them reads them as computed).
    assert (got_keys.float() - want_keys.float()).abs().max().item() <= tol
    stored = want_buf[:, 1, 0].reshape(-1, num_kv_heads, head_dim)[md.slot_mapping[md.slot_mapping >= 0]]
    assert torch.equal(want_keys[md.slot_mapping >= 0], stored)
    assert (got_buf.float() - want_buf.float()).abs().max().item() <= tol
    assert want_buf.abs().sum() > 0 and torch.equal(got_buf[:, 0], buf[:, 0])  # only layer 1 written
    written = (got_buf[:, 1, 0].abs().sum(dim=(-1, -2)) > 0).sum().item()
    assert written == num_tokens - 2  # the two padding rows stored nothing


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3"])
def test_fresh_prompts_take_sdpa_on_the_computed_keys_and_match_torch(preset, monkeypatch):
    """A step of prompts with nothing cached, every kernel call on Triton, its attention through SDPA on the keys
    and values as each layer computed them (the RoPE kernel writing the rotated keys out; Qwen3's normed keys):
    logits and the stored K/V as the torch reference computes them. A step with a cached prefix does not take it."""
    from kvmesh.kernels import ops
    from kvmesh.kernels.attention_metadata import AttentionMetadata
    from kvmesh.model.loader import load_model

    loaded = load_model(preset, device=DEVICE)
    model, cfg = loaded.model, loaded.config
    layout_shape = (12, cfg.num_layers, 2, 16, cfg.num_kv_heads, cfg.head_dim)
    gen = torch.Generator().manual_seed(7)
    q_lens, tables = [37, 20], [[4, 9, 2], [7, 11]]
    tokens = torch.randint(0, cfg.vocab_size, (sum(q_lens),), generator=gen).to(DEVICE)
    positions = torch.cat([torch.arange(n) for n in q_lens]).to(DEVICE)
    md = AttentionMetadata.build(query_lens=q_lens, seq_lens=q_lens, block_tables=tables, block_size=16, device=DEVICE)
    assert md.fresh_prompts
    assert not AttentionMetadata.build(query_lens=[5], seq_lens=[21], block_tables=[[1, 2]], block_size=16).fresh_prompts

    monkeypatch.setenv("KVMESH_KERNELS", "torch")
    want_kv = torch.zeros(layout_shape, device=DEVICE)
    with torch.inference_mode():
        want = model.compute_logits(model(tokens, positions, want_kv, md))
    monkeypatch.setenv("KVMESH_KERNELS", "triton")
    monkeypatch.setattr(ops, "takes_fresh_kv", lambda qkv, md: md.fresh_prompts)  # any length, any device
    calls = []
    attend = ops.fresh_prompts_attention
    monkeypatch.setattr(ops, "fresh_prompts_attention", lambda *a: calls.append(1) or attend(*a))
    got_kv = torch.zeros(layout_shape, device=DEVICE)
    with torch.inference_mode():
        got = model.compute_logits(model(tokens, positions, got_kv, md))
    assert len(calls) == cfg.num_layers
    tol = 1e-4 if DEVICE == "cpu" else 1e-3
    assert (got - want).abs().max().item() < tol
    assert (got_kv - want_kv).abs().max().item() < tol and want_kv.abs().sum() > 0


def test_model_forward_through_triton_dispatch_matches_torch(tiny_llama, monkeypatch):
    """The whole model with every kernel call dispatched to Triton (interpreter on CPU, compiled on CUDA)."""
    from kvmesh.model.loader import load_model
    from tests.conftest import run_prefill

    tokens = list(range(30, 100))
    want, _, _ = run_prefill(tiny_llama, tokens[:50])
    want_next, _, _ = run_prefill(tiny_llama, tokens)
    monkeypatch.setenv("KVMESH_KERNELS", "triton")
    model = load_model("tiny-llama", device="cuda") if DEVICE == "cuda" else tiny_llama
    got, kv, blocks = run_prefill(model, tokens[:50])
    got_next, _, _ = run_prefill(model, tokens[50:], kv=kv, block_ids=blocks, start=50)
    tol = 1e-4 if DEVICE == "cpu" else 1e-3  # a GPU sums in another order
    assert (got.cpu() - want).abs().max().item() < tol
    assert (got_next.cpu() - want_next[50:]).abs().max().item() < tol


@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_moe_experts_match_the_reference(dtype):
    """Odd token counts, experts that get no token (expert 0 never chosen below all of them), every top-k,
    an intermediate size that is not a multiple of the column block, segments of more than one tile."""
    from kvmesh.kernels.reference.moe import moe_experts

    gen = torch.Generator().manual_seed(21)
    num_experts, hidden, inter = 5, 48, 72
    gate_up = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5).to(dtype).to(DEVICE)
    down = (torch.randn(num_experts, hidden, inter, generator=gen) / inter ** 0.5).to(dtype).to(DEVICE)
    for num_tokens in (1, 3, 37):
        x = torch.randn(num_tokens, hidden, generator=gen).to(dtype).to(DEVICE)
        for top_k in range(1, num_experts + 1):
            logits = torch.randn(num_tokens, num_experts, generator=gen)
            logits[:, 0] -= 100.0
            weights, ids = torch.softmax(logits, -1).topk(top_k, -1)
            weights, ids = weights.to(DEVICE), ids.to(DEVICE)
            got = triton_moe.moe_experts(x, gate_up, down, ids, weights).float()
            want = moe_experts(x.float(), gate_up.float(), down.float(), ids, weights)
            tol = 1e-4 if dtype == torch.float32 else 2e-2
            assert torch.allclose(got, want, atol=tol, rtol=tol), (num_tokens, top_k, (got - want).abs().max())
