"""``kvmesh bench reuse``: TTFT of a request whose prefix lives on another node vs a full recompute.

A local cluster (1 prefill + 2 decode nodes). Baseline: fresh prompts of N tokens
sent to decode-0 (computed on the prefill node, pushed to decode-0). Reuse: the
same prefixes with a new suffix sent to decode-1, which pulls the prefix from the
node that holds it and computes (or has the prefill node compute) only the
suffix. Both TTFTs are measured by the client, in the same run.
"""
from __future__ import annotations

import random
import statistics
import time

from kvmesh.bench.report import machine, print_table, write_json
from kvmesh.cluster.local_launcher import LocalCluster
from kvmesh.engine.sampling_params import SamplingParams


def run(json_path: str | None, model: str = "smollm2-135m", prompt_tokens: int = 2048, suffix_tokens: int = 32,
        rounds: int = 3, num_kv_blocks: int = 1024) -> dict:
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    rng = random.Random(0)
    res: dict = {"machine": machine(), "model": model, "prompt_tokens": prompt_tokens,
                 "suffix_tokens": suffix_tokens, "rounds": []}
    args = ["--num-kv-blocks", str(num_kv_blocks), "--prefill-timeout", "120", "--local-prefill-tokens", "-1"]
    with LocalCluster(1, 2, model=model, node_args=args, cluster="bench-reuse", start_timeout_s=300) as cluster:
        d0, d1 = cluster.client("decode-0"), cluster.client("decode-1")
        warm = [rng.randrange(1000, 40000) for _ in range(64)]
        d0.generate(warm, params, timeout_s=300)  # warm-up
        for r in range(rounds):
            prefix = [rng.randrange(1000, 40000) for _ in range(prompt_tokens)]
            full = d0.generate(prefix, params, timeout_s=600)
            time.sleep(0.5)  # let the holders' blocks reach the index
            reused = d1.generate(prefix[: prompt_tokens - suffix_tokens] +
                                 [rng.randrange(1000, 40000) for _ in range(suffix_tokens)], params, timeout_s=600)
            res["rounds"].append({"ttft_full_s": full.ttft_s, "ttft_reuse_s": reused.ttft_s,
                                  "full_stats": full.stats, "reuse_stats": reused.stats})
        res["decode_1"] = d1.stats()
    full = statistics.median(x["ttft_full_s"] for x in res["rounds"])
    reuse = statistics.median(x["ttft_reuse_s"] for x in res["rounds"])
    res.update(ttft_full_s=full, ttft_reuse_s=reuse, ratio=reuse / full)
    f, u = res["rounds"][-1]["full_stats"], res["rounds"][-1]["reuse_stats"]
    print_table(f"{model}: TTFT with the prefix on another node ({prompt_tokens} tokens, new suffix {suffix_tokens})",
                ["", "TTFT (median)", "decode node: tokens received", "decode node: tokens computed"],
                [["fresh prompt: a full prefill (where the cost model chose)", f"{full * 1e3:.0f} ms",
                  str(f["tokens_reused_remote"] + f["tokens_from_prefill_node"]), str(f["tokens_computed"])],
                 ["same prefix + new suffix on another decode node", f"{reuse * 1e3:.0f} ms",
                  str(u["tokens_reused_remote"] + u["tokens_from_prefill_node"]), str(u["tokens_computed"])],
                 ["ratio", f"{res['ratio']:.3f}x", "", ""]])
    write_json(json_path, res)
    return res
