"""Where a ``generate`` call's time goes, step by step, and where a prompt step's device time goes, kernel by kernel.

Usage: python3 tests/gpu/step_timeline.py MODEL [--device cuda] [--batch 64] [--context 1024] [--new-tokens 64]
       [--profile-prefill N] [--json F]

Timeline: ``--batch`` prompts of ``--context`` tokens, generated to 1 token and then to ``--new-tokens`` tokens (what
``kvmesh bench model``'s decode rate subtracts), each engine step's wall time recorded with what it computed: prompt
tokens only, prompt chunks beside decode rows (mixed), decode rows alone, or a run-ahead step (its batch launched
before the step before it was read). Printed per kind: steps, seconds, median ms. ``--profile-prefill N``: one
prompt of N tokens under torch's profiler, the kernels with the most device time (CUDA only)."""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict

import torch

from kvmesh import LLM, SamplingParams
from kvmesh.bench.model import kv_blocks_for
from kvmesh.device import synchronize


def step_kind(batch) -> str:
    prompt_tokens = sum(n for _, n in batch if n > 1)
    decode_rows = sum(1 for _, n in batch if n == 1)
    if prompt_tokens and decode_rows:
        return "mixed"
    return "prompt" if prompt_tokens else "decode"


def timeline(llm, prompts: list[list[int]], new_tokens: int) -> dict:
    """Each step of one ``generate`` of ``new_tokens`` tokens: (kind, wall seconds), and the call's own wall time."""
    engine = llm.engine
    scheduled: list = []
    schedule, step = engine.scheduler.schedule, engine.step

    def recording_schedule(*args, **kw):
        out = schedule(*args, **kw)
        scheduled.append(out.batch)
        return out

    steps: list[tuple[str, float]] = []

    def timed_step():
        before = len(scheduled)
        start = time.perf_counter()
        finished = step()
        synchronize(llm.loaded.device)
        kind = step_kind(scheduled[-1]) if len(scheduled) > before and scheduled[-1] else "run-ahead"
        steps.append((kind, time.perf_counter() - start))
        return finished

    engine.scheduler.schedule, engine.step = recording_schedule, timed_step
    try:
        start = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True), use_tqdm=False)
        wall = time.perf_counter() - start
    finally:
        engine.scheduler.schedule, engine.step = schedule, step
    kinds: dict[str, list[float]] = defaultdict(list)
    for kind, seconds in steps:
        kinds[kind].append(seconds)
    return {"new_tokens": new_tokens, "wall_s": wall, "steps_s": sum(s for _, s in steps),
            "kinds": {k: {"steps": len(v), "seconds": sum(v), "median_ms": statistics.median(v) * 1e3}
                      for k, v in kinds.items()}}


def profile_prefill(llm, num_tokens: int, top: int = 12) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    vocab = llm.loaded.config.vocab_size
    one = SamplingParams(max_tokens=1, temperature=0.0)
    llm.generate([[(j * 13) % vocab for j in range(num_tokens)]], one, use_tqdm=False)  # warm-up
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate([[(j * 17 + 1) % vocab for j in range(num_tokens)]], one, use_tqdm=False)
        synchronize(llm.loaded.device)
    rows = [{"name": e.key[:90], "device_ms": e.device_time_total / 1e3, "calls": e.count}
            for e in prof.key_averages() if e.device_time_total > 0]
    return sorted(rows, key=lambda r: -r["device_ms"])[:top]


def main(argv: list[str]) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=4096)
    ap.add_argument("--profile-prefill", type=int, default=0)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    num_tokens = max(args.profile_prefill, args.batch * (args.context + args.new_tokens + 16))
    llm = LLM(args.model, device=args.device, dtype=args.dtype, num_kv_blocks=kv_blocks_for(num_tokens),
              max_num_seqs=max(args.batch, 16), max_num_batched_tokens=args.max_num_batched_tokens, progress=False)
    vocab = llm.loaded.config.vocab_size
    res: dict = {"model": args.model, "device": str(llm.loaded.device), "batch": args.batch, "context": args.context,
                 "runs": []}
    for round_, new_tokens in enumerate((1, args.new_tokens, 1, args.new_tokens)):
        prompts = [[(i * 7919 + j * 31 + round_ * 104729) % vocab for j in range(args.context)]
                   for i in range(args.batch)]  # fresh prompts each round: no prefix-cache hit
        run = timeline(llm, prompts, new_tokens)
        res["runs"].append(run)
        print(f"generate {new_tokens} tokens: {run['wall_s'] * 1e3:.1f} ms, steps {run['steps_s'] * 1e3:.1f} ms | "
              + " | ".join(f"{k}: {v['steps']} steps {v['seconds'] * 1e3:.1f} ms (median {v['median_ms']:.2f})"
                           for k, v in sorted(run["kinds"].items())), flush=True)
    if args.profile_prefill and llm.loaded.device.type == "cuda":
        res["prefill_profile"] = profile_prefill(llm, args.profile_prefill)
        for row in res["prefill_profile"]:
            print(f"{row['device_ms']:9.2f} ms {row['calls']:6d}x  {row['name']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    llm.engine.check_integrity()
    return res


if __name__ == "__main__":
    torch.manual_seed(0)
    main(sys.argv[1:])
