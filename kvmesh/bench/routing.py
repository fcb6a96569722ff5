"""``kvmesh bench routing``: cache-aware routing against round-robin and random on a shared-prefix workload.

One local cluster (1 prefill + ``num_decode`` decode nodes) behind the router; for each policy a
fresh workload of the same shape (groups x prompts sharing a system prompt, in
interleaved order, one request at a time), so no policy inherits another's cache.
Reports the local hit rate (requests that reused their decode node's own blocks),
token reuse, and TTFT p50/p90 per policy.
"""
from __future__ import annotations

import random
import statistics
import time

from tqdm import tqdm

from kvmesh.bench.report import machine, print_table, write_json
from kvmesh.cluster.local_launcher import LocalCluster
from kvmesh.cluster.router import Router, RouterConfig
from kvmesh.cluster.routing import make_policy
from kvmesh.engine.sampling_params import SamplingParams


def _workload(seed: int, groups: int, per_group: int, system_len: int, question_len: int, vocab: int):
    rng = random.Random(seed)
    systems = [[rng.randrange(vocab) for _ in range(system_len)] for _ in range(groups)]
    order = [(g, q) for q in range(per_group) for g in range(groups)]  # interleaved arrivals
    return [systems[g] + [rng.randrange(vocab) for _ in range(question_len)] for g, _ in order]


def run(json_path: str | None, model: str = "tiny-llama", groups: int = 6, per_group: int = 6,
        system_len: int = 256, question_len: int = 16, num_decode: int = 3, policies: tuple[str, ...] = ("cache-aware", "round-robin",
                                                                                    "random")) -> dict:
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    res: dict = {"machine": machine(), "model": model, "groups": groups, "per_group": per_group,
                 "num_decode": num_decode,
                 "system_len": system_len, "policies": {}}
    with LocalCluster(1, num_decode, model=model, cluster="bench-routing", start_timeout_s=300) as cluster:
        router = Router(RouterConfig(etcd=cluster.etcd_endpoint, cluster_token=cluster.token, model=model, cluster="bench-routing"))
        vocab = min(router.vocab_size, 256) if model.startswith("tiny") else router.vocab_size
        try:
            with tqdm(total=len(policies) * groups * per_group, desc="routing", leave=False) as bar:
                for i, name in enumerate(policies):
                    router.policy = make_policy(name)
                    ttfts, hits, reused, processed = [], 0, 0, 0
                    for prompt in _workload(100 + i, groups, per_group, system_len, question_len, vocab):
                        start = time.perf_counter()
                        first_at = None
                        for chunk in router.generate(prompt, params):
                            if first_at is None and chunk.token_ids:
                                first_at = time.perf_counter() - start
                            final = chunk
                        ttfts.append(first_at)
                        local = final.cache.tokens_reused_local
                        hits += local > 0
                        reused += local + final.cache.tokens_reused_remote
                        processed += len(prompt)
                        time.sleep(0.02)  # publication to the index is asynchronous
                        bar.update(1)
                    ttfts.sort()
                    res["policies"][name] = {"hit_rate_local": hits / len(ttfts), "reuse_rate": reused / processed,
                                             "ttft_p50_ms": statistics.median(ttfts) * 1e3,
                                             "ttft_p90_ms": ttfts[int(0.9 * (len(ttfts) - 1))] * 1e3}
        finally:
            router.close()
    rows = [[name, f"{p['hit_rate_local']:.2f}", f"{p['reuse_rate']:.2f}", f"{p['ttft_p50_ms']:.0f} ms",
             f"{p['ttft_p90_ms']:.0f} ms"] for name, p in res["policies"].items()]
    print_table(f"routing, {model}, {num_decode} decode nodes: {groups} groups x {per_group} prompts, "
                f"{system_len}-token shared prefix",
                ["policy", "local hit rate", "prompt reuse (local+peer)", "TTFT p50", "TTFT p90"], rows)
    write_json(json_path, res)
    return res
