"""``kvmesh bench kernels``: the Triton attention kernels on a CUDA device, against the device and torch.

    decode   paged decode attention (one new token per sequence) over block tables:
             KV bytes read per second, as a fraction of this device's measured copy
             bandwidth (read + write of a large device-to-device copy) and of its
             datasheet HBM peak where the device is known
    prefill  paged prefill attention (causal, no cached prefix) against
             torch.nn.functional.scaled_dot_product_attention on the same q/k/v:
             TFLOP/s of both and their ratio, for the Triton kernel (default tiles and a
             sweep of others, each checked against SDPA's output) and for kvmesh's
             dispatch (which sends prompts without a cached prefix through SDPA)

Shapes are a Llama-3-8B layer (32 query heads, 8 KV heads, head dim 128), block size 16,
blocks scattered at random. Times are CUDA-event medians. Needs a CUDA device.
"""
from __future__ import annotations

import statistics

import torch

from kvmesh.bench.report import machine, print_table, write_json

HBM_PEAK_BYTES_PER_S = {"H100": 3.35e12, "H200": 4.8e12, "A100": 2.0e12}  # datasheet (SXM) figures
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16


def _time_ms(fn, warmup: int = 3, iters: int = 20) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth() -> float:
    """Bytes per second of a 1 GiB device-to-device copy (read + write counted)."""
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = _time_ms(lambda: dst.copy_(src))
    return 2 * src.numel() / (ms / 1e3)


def _paged_cache(num_tokens_total: int, dtype: torch.dtype, gen: torch.Generator):
    num_blocks = -(-num_tokens_total // BLOCK_SIZE) + 8
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k = torch.randn(shape, generator=gen, device="cuda", dtype=torch.float32).to(dtype)
    v = torch.randn(shape, generator=gen, device="cuda", dtype=torch.float32).to(dtype)
    return k, v, num_blocks


def bench_decode(batch: int, context: int, dtype: torch.dtype, gen: torch.Generator) -> dict:
    from kvmesh.kernels.triton.attention import decode_attention

    k, v, num_blocks = _paged_cache(batch * context, dtype, gen)
    per_seq = -(-context // BLOCK_SIZE)
    order = torch.randperm(num_blocks, generator=gen, device="cuda")[: batch * per_seq]
    block_tables = order.view(batch, per_seq).to(torch.int32)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, NUM_HEADS, HEAD_DIM, generator=gen, device="cuda", dtype=torch.float32).to(dtype)
    ms = _time_ms(lambda: decode_attention(q, k, v, block_tables, seq_lens, HEAD_DIM ** -0.5))
    kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * k.element_size()
    return {"batch": batch, "context": context, "dtype": str(dtype).removeprefix("torch."), "ms": ms,
            "kv_bytes_per_s": kv_bytes / (ms / 1e3)}


# Tile choices the prefill row also times (the default is kernels.triton.attention.prefill_config's).
PREFILL_SWEEP = [(64, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2), (128, 32, 4, 3), (64, 32, 4, 4)]


def bench_prefill(length: int, dtype: torch.dtype, gen: torch.Generator) -> dict:
    from kvmesh.kernels import ops
    from kvmesh.kernels.triton.attention import PrefillConfig, prefill_attention

    k, v, num_blocks = _paged_cache(length, dtype, gen)
    per_seq = -(-length // BLOCK_SIZE)
    block_tables = torch.randperm(num_blocks, generator=gen, device="cuda")[:per_seq].view(1, -1).to(torch.int32)
    q = torch.randn(length, NUM_HEADS, HEAD_DIM, generator=gen, device="cuda", dtype=torch.float32).to(dtype)
    seq_lens = torch.tensor([length], dtype=torch.int32, device="cuda")
    qsl = torch.tensor([0, length], dtype=torch.int32, device="cuda")
    scale = HEAD_DIM ** -0.5
    triton_ms = _time_ms(lambda: prefill_attention(q, k, v, block_tables, seq_lens, qsl, length, scale))
    flat = block_tables[0].long()
    keys = k[flat].reshape(-1, NUM_KV_HEADS, HEAD_DIM)[:length]
    values = v[flat].reshape(-1, NUM_KV_HEADS, HEAD_DIM)[:length]
    # A prompt with no cached prefix this long: SDPA on the keys and values as the layer computed them (views of
    # one buffer, as the fused projection lays them out), and the copy the layer's reshape of its output makes.
    kv_width = NUM_KV_HEADS * HEAD_DIM
    fused = torch.cat([keys.flatten(1), values.flatten(1)], dim=1)
    fresh_k, fresh_v = fused[:, :kv_width].view(-1, NUM_KV_HEADS, HEAD_DIM), fused[:, kv_width:].view(
        -1, NUM_KV_HEADS, HEAD_DIM)
    fresh_sdpa_ms = _time_ms(lambda: ops.fresh_prompts_attention(q, fresh_k, fresh_v, [length], scale).reshape(
        length, -1))
    takes_sdpa = length >= ops.FRESH_PROMPT_SDPA_MIN_TOKENS
    kvmesh_ms = fresh_sdpa_ms if takes_sdpa else triton_ms  # what the model runs (the dispatch in kernels/ops)
    # The same keys and values, contiguous, for SDPA (GQA by repeating KV heads, as most callers do).
    kk, vv = keys.transpose(0, 1), values.transpose(0, 1)
    rep = NUM_HEADS // NUM_KV_HEADS
    kk, vv = kk.repeat_interleave(rep, 0)[None], vv.repeat_interleave(rep, 0)[None]
    qq = q.transpose(0, 1)[None]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    sdpa_ms = _time_ms(lambda: sdpa(qq, kk, vv, is_causal=True))
    want = sdpa(qq, kk, vv, is_causal=True)[0].transpose(0, 1).float()
    sweep = []
    for cfg in map(PrefillConfig._make, PREFILL_SWEEP):
        try:
            got = prefill_attention(q, k, v, block_tables, seq_lens, qsl, length, scale, config=cfg)
            ms = _time_ms(lambda: prefill_attention(q, k, v, block_tables, seq_lens, qsl, length, scale, config=cfg))
            sweep.append({"config": list(cfg), "ms": ms, "vs_sdpa": sdpa_ms / ms,
                          "max_abs_diff": (got.float() - want).abs().max().item()})
        except Exception as exc:  # a tile that does not fit this device's shared memory
            sweep.append({"config": list(cfg), "error": str(exc)[:200]})
    flops = 2 * 2 * NUM_HEADS * HEAD_DIM * length * length / 2  # QK^T and PV, causal half
    dispatched = ops.fresh_prompts_attention(q, fresh_k, fresh_v, [length], scale) if takes_sdpa else \
        prefill_attention(q, k, v, block_tables, seq_lens, qsl, length, scale)
    return {"length": length, "dtype": str(dtype).removeprefix("torch."), "triton_ms": triton_ms,
            "sdpa_ms": sdpa_ms, "triton_tflops": flops / (triton_ms / 1e3) / 1e12,
            "sdpa_tflops": flops / (sdpa_ms / 1e3) / 1e12, "triton_vs_sdpa": sdpa_ms / triton_ms,
            "fresh_sdpa_ms": fresh_sdpa_ms, "fresh_sdpa_vs_sdpa": sdpa_ms / fresh_sdpa_ms,
            "kvmesh_path": "sdpa" if takes_sdpa else "paged",
            "kvmesh_ms": kvmesh_ms, "kvmesh_vs_sdpa": sdpa_ms / kvmesh_ms,
            "kvmesh_max_abs_diff": (dispatched.float() - want).abs().max().item(), "triton_sweep": sweep}


def _best_tile(sweep: list[dict]) -> str:
    timed = [r for r in sweep if "ms" in r]
    if not timed:
        return "-"
    best = max(timed, key=lambda r: r["vs_sdpa"])
    return f"{best['config']}: {best['vs_sdpa']:.2f}"


def run(json_path: str | None, quick: bool = False) -> dict:
    if not torch.cuda.is_available():
        raise SystemExit("kvmesh bench kernels needs a CUDA device (the CPU path is the torch reference)")
    gen = torch.Generator(device="cuda").manual_seed(0)
    name = torch.cuda.get_device_name()
    peak = next((v for k, v in HBM_PEAK_BYTES_PER_S.items() if k in name), None)
    ceiling = copy_bandwidth()
    dtypes = [torch.bfloat16] if quick else [torch.bfloat16, torch.float16]
    decode_shapes = [(16, 1024), (64, 4096)] if quick else [(1, 4096), (16, 1024), (16, 8192), (64, 4096),
                                                            (256, 2048)]
    prefill_lengths = [1024] if quick else [512, 2048, 8192]
    res = {"machine": machine(), "device": name, "copy_bytes_per_s": ceiling, "hbm_peak_bytes_per_s": peak,
           "shape": {"num_heads": NUM_HEADS, "num_kv_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM,
                     "block_size": BLOCK_SIZE},
           "decode": [bench_decode(b, c, d, gen) for d in dtypes for b, c in decode_shapes],
           "prefill": [bench_prefill(n, d, gen) for d in dtypes for n in prefill_lengths]}
    for r in res["decode"]:
        r["of_copy_bandwidth"] = r["kv_bytes_per_s"] / ceiling
        r["of_hbm_peak"] = r["kv_bytes_per_s"] / peak if peak else None
    print(f"\n{name}: device-to-device copy {ceiling / 1e12:.2f} TB/s" +
          (f", datasheet HBM peak {peak / 1e12:.2f} TB/s" if peak else ""))
    print_table("paged decode attention (Triton), KV read", ["dtype", "batch", "context", "ms", "TB/s",
                                                             "of copy", "of HBM peak"],
                [[r["dtype"], r["batch"], r["context"], f"{r['ms']:.3f}", f"{r['kv_bytes_per_s'] / 1e12:.2f}",
                  f"{r['of_copy_bandwidth']:.2f}", f"{r['of_hbm_peak']:.2f}" if peak else "-"]
                 for r in res["decode"]])
    print_table("causal prefill attention of a fresh prompt: Triton (paged), SDPA on the keys as computed (GQA, "
                "with the output copy), kvmesh's dispatch, vs torch SDPA (contiguous, KV heads repeated)",
                ["dtype", "tokens", "Triton ms", "fresh SDPA ms", "SDPA ms", "Triton TFLOP/s", "SDPA TFLOP/s",
                 "SDPA time / Triton", "SDPA time / fresh SDPA", "kvmesh takes", "SDPA time / kvmesh",
                 "best Triton tile"],
                [[r["dtype"], r["length"], f"{r['triton_ms']:.3f}", f"{r['fresh_sdpa_ms']:.3f}", f"{r['sdpa_ms']:.3f}",
                  f"{r['triton_tflops']:.1f}", f"{r['sdpa_tflops']:.1f}", f"{r['triton_vs_sdpa']:.2f}",
                  f"{r['fresh_sdpa_vs_sdpa']:.2f}", r["kvmesh_path"], f"{r['kvmesh_vs_sdpa']:.2f}",
                  _best_tile(r["triton_sweep"])]
                 for r in res["prefill"]])
    write_json(json_path, res)
    return res
