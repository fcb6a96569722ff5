"""Decode throughput on a GPU: kvmesh with CUDA graphs, kvmesh eager, transformers (default and static cache).

Run on a lent device (tests/gpu/device_run.sh style, no network): SmolLM2-135M's shape with seeded weights
(``smollm2-135m-dummy``), bf16, 32-token prompts, greedy, the same weights in transformers. Writes JSON
after every measurement (``--json``), so a run cut short still reports what it measured.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kvmesh import LLM, SamplingParams
from kvmesh.bench.model import gpu_busy


def decode_tok_s(fn, batch: int, new_tokens: int, repeat: int = 3) -> float:
    fn(4)  # warm-up
    times = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn(new_tokens)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return batch * new_tokens / statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", required=True)
    ap.add_argument("--batches", default="1,32,128")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--budget-s", type=float, default=150.0, help="skip the static-cache baseline past this")
    ap.add_argument("--no-transformers", action="store_true", help="kvmesh's rows only")
    ap.add_argument("--only-static", action="store_true",
                    help="kvmesh with graphs and transformers' static cache only (no eager rows)")
    args = ap.parse_args()
    t0 = time.monotonic()
    batches = [int(b) for b in args.batches.split(",")]
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "model": "smollm2-135m-dummy",
           "dtype": "bfloat16", "prompt_tokens": 32, "new_tokens": args.new_tokens, "decode_batches": []}

    def save():
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)

    graphed = LLM("smollm2-135m-dummy", device="cuda", dtype="bfloat16", max_num_seqs=max(batches),
                  num_kv_blocks=4096, progress=False)
    res["graphs"] = graphed.engine.runner.graphs.describe()
    eager = None if args.only_static else LLM("smollm2-135m-dummy", device="cuda", dtype="bfloat16",
                                              max_num_seqs=max(batches), num_kv_blocks=4096, progress=False,
                                              enforce_eager=True)
    vocab = graphed.loaded.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    rows = {}
    for batch in batches:
        prompts = torch.randint(0, vocab, (batch, 32), generator=gen).tolist()
        shift = iter(range(1, 1000))

        def ours(llm, n):
            k = next(shift)  # fresh prompts: no prefix-cache hits
            llm.generate([[(t + k) % vocab for t in p] for p in prompts],
                         SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), use_tqdm=False)

        row = {"batch": batch, "kvmesh_tok_s": decode_tok_s(lambda n: ours(graphed, n), batch, args.new_tokens)}
        if eager is not None:
            row["kvmesh_eager_tok_s"] = decode_tok_s(lambda n: ours(eager, n), batch, args.new_tokens)
        row["gpu_busy"], row["step_ms"] = gpu_busy(graphed, [[(t + 999) % vocab for t in p] for p in prompts])
        rows[batch] = row
        res["decode_batches"].append(row)
        save()
        print(json.dumps(row), flush=True)
    del eager
    if args.no_transformers:
        return
    try:
        from kvmesh.bench.model import _hf_twin

        hf = _hf_twin(graphed.loaded).to("cuda")
    except Exception as e:  # transformers missing or different: kvmesh's rows stand alone
        res["transformers_error"] = f"{type(e).__name__}: {e}"
        save()
        return
    for batch in [] if args.only_static else batches:
        ids = torch.randint(0, vocab, (batch, 32), generator=gen).cuda()

        def theirs(n, **kw):
            with torch.inference_mode():
                hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                            do_sample=False, pad_token_id=0, **kw)

        rows[batch]["transformers_tok_s"] = decode_tok_s(theirs, batch, args.new_tokens)
        save()
    for batch in batches:
        if time.monotonic() - t0 > args.budget_s:
            res["static_skipped"] = f"past the {args.budget_s} s budget"
            break
        ids = torch.randint(0, vocab, (batch, 32), generator=gen).cuda()

        def static(n):
            with torch.inference_mode():
                hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                            do_sample=False, pad_token_id=0, cache_implementation="static")

        try:
            rows[batch]["transformers_static_tok_s"] = decode_tok_s(static, batch, args.new_tokens)
        except Exception as e:
            rows[batch]["transformers_static_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        save()
        print(json.dumps(rows[batch]), flush=True)


if __name__ == "__main__":
    main()
