"""``kvmesh bench reuse``: TTFT of a request whose prefix lives on another node vs a full recompute.

A local cluster (1 prefill + 2 decode nodes) per transfer path. Baseline: fresh prompts
of N tokens sent to decode-0 (computed on the prefill node, pushed to decode-0). Reuse:
the same prefixes with a new suffix sent to decode-1, which pulls the prefix from the
node that holds it and computes (or has the prefill node compute) only the suffix. Both
TTFTs are measured by the client, in the same cluster. Paths: ``shared-memory`` (the
nodes share this host: pushes are one copy into the receiver's memfd KV buffer) and
``engine`` (``--no-shared-memory-transfers``: every push through the transfer engine, as
between hosts; Mooncake over TCP here). ``holder_tp`` N > 1: the prefill node and decode-0, every holder
of the prefixes, at tensor-parallel size N while decode-1 stays at 1 (KV fetched across sizes).
"""
from __future__ import annotations

import random
import statistics
import time

from kvmesh.bench.report import machine, print_table, write_json
from kvmesh.cluster.local_launcher import LocalCluster
from kvmesh.engine.sampling_params import SamplingParams

PATHS = {"shared-memory": [], "engine": ["--no-shared-memory-transfers"]}


def _token_range(model: str) -> tuple[int, int]:
    """Prompt token ids to draw from: ordinary vocabulary for real models, the tiny presets' small vocabularies."""
    return (0, 256) if model.startswith("tiny") else (1000, 40000)


def _measure(path: str, model: str, prompt_tokens: int, suffix_tokens: int, rounds: int,
             num_kv_blocks: int, dtype: str, holder_tp: int = 1) -> dict:
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    rng = random.Random(0)
    lo, hi = _token_range(model)
    args = ["--num-kv-blocks", str(num_kv_blocks), "--prefill-timeout", "120", "--kv-placement", "cost",
            *PATHS[path]]
    res: dict = {"rounds": []}
    holders = {n: ["--tensor-parallel-size", str(holder_tp)] for n in ("prefill-0", "decode-0")} if holder_tp > 1 \
        else {}
    with LocalCluster(1, 2, model=model, node_args=args, cluster=f"bench-reuse-{path}", start_timeout_s=600,
                      dtype=dtype, per_node_args=holders) as cluster:
        d0, d1 = cluster.client("decode-0"), cluster.client("decode-1")
        warm = [rng.randrange(lo, hi) for _ in range(64)]
        d0.generate(warm, params, timeout_s=300)  # warm-up
        for _ in range(rounds):
            prefix = [rng.randrange(lo, hi) for _ in range(prompt_tokens)]
            full = d0.generate(prefix, params, timeout_s=600)
            time.sleep(0.5)  # let the holders' blocks reach the index
            received = d1.stats()["bytes_received"]
            reused = d1.generate(prefix[: prompt_tokens - suffix_tokens] +
                                 [rng.randrange(lo, hi) for _ in range(suffix_tokens)], params, timeout_s=600)
            res["rounds"].append({"ttft_full_s": full.ttft_s, "ttft_reuse_s": reused.ttft_s,
                                  "full_stats": full.stats.as_dict(), "reuse_stats": reused.stats.as_dict(),
                                  "reuse_bytes_received": d1.stats()["bytes_received"] - received})
        res["decode_1"] = d1.stats()
        res["bytes_sent_shared_memory"] = sum(cluster.client(n).stats()["bytes_sent_shared_memory"]
                                              for n in cluster.nodes)
    full = statistics.median(x["ttft_full_s"] for x in res["rounds"])
    reuse = statistics.median(x["ttft_reuse_s"] for x in res["rounds"])
    res.update(ttft_full_s=full, ttft_reuse_s=reuse, ratio=reuse / full,
               kv_wait_ms=statistics.median(x["reuse_stats"].get("kv_wait_ms", 0.0) for x in res["rounds"]),
               reuse_bytes_received=statistics.median(x["reuse_bytes_received"] for x in res["rounds"]),
               link=res["decode_1"]["transfer_gib_per_s_by_link"])
    return res


def run(json_path: str | None, model: str = "smollm2-135m", prompt_tokens: int = 2048, suffix_tokens: int = 32,
        rounds: int = 3, num_kv_blocks: int = 1024, paths: tuple[str, ...] = tuple(PATHS),
        dtype: str = "float32", holder_tp: int = 1) -> dict:
    unknown = set(paths) - set(PATHS)
    if unknown or not paths:
        raise ValueError(f"unknown transfer path(s) {sorted(unknown)} (choose from {', '.join(PATHS)})")
    res: dict = {"machine": machine(), "model": model, "dtype": dtype, "prompt_tokens": prompt_tokens,
                 "suffix_tokens": suffix_tokens, "holder_tensor_parallel_size": holder_tp, "paths": {}}
    for path in paths:
        res["paths"][path] = _measure(path, model, prompt_tokens, suffix_tokens, rounds, num_kv_blocks, dtype,
                                      holder_tp)
    first = res["paths"][paths[0]]  # the headline: the first path asked for (default: shared memory)
    res.update(path=paths[0], ttft_full_s=first["ttft_full_s"], ttft_reuse_s=first["ttft_reuse_s"],
               ratio=first["ratio"])
    rows = []
    for path, r in res["paths"].items():
        u = r["rounds"][-1]["reuse_stats"]
        rows.append([path, f"{r['ttft_full_s'] * 1e3:.0f} ms", f"{r['ttft_reuse_s'] * 1e3:.0f} ms",
                     f"{r['kv_wait_ms']:.0f} ms", str(u["tokens_reused_remote"] + u["tokens_from_prefill_node"] + u.get("tokens_reused_prefill_node", 0)),
                     f"{r['reuse_bytes_received'] / 2**20:.1f} MiB", str(u["tokens_computed"]), f"{r['ratio']:.3f}x"])
    sizes = f", holders at tensor-parallel size {holder_tp}, the fetching node at 1" if holder_tp > 1 else ""
    print_table(f"{model}: TTFT with the prefix on another node ({prompt_tokens} tokens, new suffix {suffix_tokens}"
                f"{sizes})",
                ["transfer path", "full prefill (median)", "reuse (median)", "reuse: wait for KV",
                 "reuse: tokens received", "reuse: KV moved", "reuse: tokens computed", "reuse / full"], rows)
    write_json(json_path, res)
    return res
