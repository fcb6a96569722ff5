"""``kvmesh bench prefix-cache``: the prefix-cache data structures on a 32K-token prompt.

Measured in one run, so ratios hold on a noisy machine:
- chain hashing of 2,048 blocks: kvmesh's blake2b fast path vs a sha256-over-pickle chain
  (the scheme of vLLM's default) as the same-run baseline;
- match of the whole cached prompt (memoised and first time), insert of 2,048 blocks, evict
  of 10 blocks (directly and by allocating from a full pool), for the engine's block pool;
- memory per cached block and per 1,000 cached prefixes (tracemalloc);
- the engine on a shared-system-prompt workload (tiny-llama): tokens computed and hit rate,
  prefix caching on vs off.
"""
from __future__ import annotations

import gc
import hashlib
import pickle
import random
import tracemalloc

from kvmesh.bench.report import machine, print_table, time_call, write_json
from kvmesh.kv.block_hash import hash_blocks, root_hash
from kvmesh.kv.block_index import make_block_index
from kvmesh.kv.block_pool import BlockPool
from kvmesh.kv.prefix_hasher import PrefixHasher

BLOCK = 16
NUM_TOKENS = 32768
# Goals set against SGLang's radix cache and vLLM's block pool on the same work, on a machine like this one
# in a quiet hour (SGLang: insert 50 us, evict 6.3 us, tokens -> matched prefix 515 us).
TARGETS_US = {"match": 16.0, "match_cold": 16.0, "insert": 25.0, "evict10": 4.5, "hash_and_match": 500.0,
              "first_sight": 258.0}
TARGET_MB_PER_1000_PREFIXES = 2.0
# The sha256-over-pickle chain of the prompt (the hash baseline below) took this long in the goals' hour: the
# verdicts scale each time by it over this run's, since this VM's speed varies ~2x from hour to hour.
GOALS_HOUR_YARDSTICK_MS = 1.69


def _sha256_pickle_chain(token_ids: list[int]) -> list[bytes]:
    out, parent = [], b"root"
    for i in range(0, len(token_ids) - BLOCK + 1, BLOCK):
        parent = hashlib.sha256(pickle.dumps((parent, tuple(token_ids[i : i + BLOCK])))).digest()
        out.append(parent)
    return out


def _scattered_blocks(pool: BlockPool, num_blocks: int) -> list[int]:
    """``num_blocks`` of a pool twice that size whose free queue was shuffled: ids with gaps, what
    allocation gives once a pool has churned (allocate sorts them, but they are no run)."""
    blocks = pool.allocate(pool.num_blocks)
    random.Random(0).shuffle(blocks)
    pool.free(blocks)
    return pool.allocate(num_blocks)


def _filled_pool(hashes: list[bytes], spare: int = 64, scattered: bool = False) -> BlockPool:
    pool = BlockPool(2 * len(hashes) if scattered else len(hashes) + spare)
    blocks = _scattered_blocks(pool, len(hashes)) if scattered else pool.allocate(len(hashes))
    pool.cache(blocks, hashes)
    pool.free(blocks)
    return pool


def bench_structures(repeat: int) -> dict:
    tokens = list(range(7, 7 + NUM_TOKENS))
    root = root_hash(b"bench")
    hashes = hash_blocks(root, tokens, BLOCK)
    res: dict = {"num_tokens": NUM_TOKENS, "num_blocks": len(hashes),
                 "index": type(make_block_index(1)).__name__}
    t_hash = time_call(lambda: hash_blocks(root, tokens, BLOCK), repeat)
    t_base = time_call(lambda: _sha256_pickle_chain(tokens), repeat)
    res["hash"] = {"kvmesh_ms": t_hash * 1e3, "tokens_per_s": NUM_TOKENS / t_hash,
                   "baseline_sha256_pickle_ms": t_base * 1e3, "speedup": t_base / t_hash}

    def cold_match(pool: BlockPool):  # the memo forgotten: what the first match of a prompt costs
        pool._chains.clear()
        return pool.match(hashes)

    scattered_pool = _filled_pool(hashes, scattered=True)
    pool = _filled_pool(hashes)
    res["match_cold_us"] = {"pool": time_call(lambda: cold_match(pool), repeat, 20) * 1e6,
                            "pool_scattered": time_call(lambda: cold_match(scattered_pool), repeat, 20) * 1e6}
    res["match_us"] = {
        "pool": time_call(lambda: pool.match(hashes), repeat, 20) * 1e6,
        "pool_hash_and_match": time_call(lambda: pool.match(hash_blocks(root, tokens, BLOCK)), repeat) * 1e6,
    }
    hasher = PrefixHasher(BLOCK)  # what the engine and the router use: this prompt was seen before
    hasher.hash(root, tokens)
    res["match_us"]["pool_repeat_hash_and_match"] = time_call(lambda: pool.match(hasher.hash(root, tokens)),
                                                               repeat) * 1e6

    state: dict = {}

    def setup_insert(scattered: bool):
        p = state["pool"] = BlockPool(2 * len(hashes) if scattered else len(hashes))
        state["blocks"] = _scattered_blocks(p, len(hashes)) if scattered else p.allocate(len(hashes))

    def do_insert():
        state["pool"].cache(state["blocks"], hashes)

    res["insert_us"] = {
        "pool": time_call(do_insert, repeat, setup=lambda: setup_insert(False)) * 1e6,
        "pool_scattered": time_call(do_insert, repeat, setup=lambda: setup_insert(True)) * 1e6,
    }

    def setup_evict_pool():
        state["pool"] = _filled_pool(hashes)

    res["evict10_us"] = {
        "pool": time_call(lambda: state["pool"].evict(10), repeat * 3, setup=setup_evict_pool) * 1e6,
        # what a full pool pays when allocation evicts: 10 LRU leaves leave the cache and are handed out
        "pool_by_allocate": time_call(lambda: state["pool"].allocate(10), repeat * 3,
                                      setup=lambda: state.update(pool=_filled_pool(hashes, spare=0))) * 1e6,
    }
    res["memory"] = bench_memory()
    return res


def _traced(build) -> tuple[int, object]:
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    obj = build()
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return after - before, obj


def bench_memory(num_prefixes: int = 1000, blocks_per_prefix: int = 4) -> dict:
    """1,000 distinct 64-token prefixes (4 blocks each), cached in each structure."""
    chains = [hash_blocks(root_hash(b"m%d" % i), list(range(blocks_per_prefix * BLOCK)), BLOCK)
              for i in range(num_prefixes)]
    num_blocks = num_prefixes * blocks_per_prefix

    def build_pool():
        pool = BlockPool(num_blocks)
        for chain in chains:
            blocks = pool.allocate(len(chain))
            pool.cache(blocks, chain)
            pool.free(blocks)
        return pool

    hash_bytes = sum(len(h) + 33 for chain in chains for h in chain)  # the digests themselves (bytes objects)
    pool_bytes, _ = _traced(build_pool)
    return {
        "num_prefixes": num_prefixes, "blocks_per_prefix": blocks_per_prefix,
        "pool_bytes_per_block": (pool_bytes - 0) / num_blocks,
        "pool_bytes_per_block_excl_digest": (pool_bytes - hash_bytes) / num_blocks,
        "pool_mb_per_1000_prefixes": pool_bytes / 2**20 * 1000 / num_prefixes,
    }


def bench_engine_workload(num_requests: int = 12) -> dict:
    """Shared system prompt, distinct questions, arriving one after another (tiny-llama)."""
    from kvmesh import LLM, SamplingParams

    system = "System: you are kvmesh's benchmark assistant; keep every answer short and exact. " * 4
    prompts = [system + f"Question {i}: what is {i} times {i + 1}?" for i in range(num_requests)]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    out = {}
    for caching in (True, False):
        llm = LLM("tiny-llama", num_kv_blocks=512, enable_prefix_caching=caching, progress=False)
        for p in prompts:
            llm.generate(p, params, use_tqdm=False)
        llm.engine.check_integrity()
        out["cache_on" if caching else "cache_off"] = llm.engine.kv.stats_dict()
    on, off = out["cache_on"], out["cache_off"]
    out["tokens_computed_drop"] = 1 - on["tokens_computed"] / off["tokens_computed"]
    return out


def _verdict(value_us: float, target_us: float, scale: float) -> str:
    """The goal judged at the goals' hour's speed: ``value_us`` times ``scale`` (its yardstick over this run's)."""
    there = value_us * scale
    return f"target <= {target_us:g} us: {'met' if there <= target_us else 'NOT met'} (~{there:.3g} us at the goals' speed)"


def run(json_path: str | None, repeat: int = 21, with_engine: bool = True) -> dict:
    res = {"machine": machine(), "structures": bench_structures(repeat)}
    if with_engine:
        res["engine_shared_prompt"] = bench_engine_workload()
    s = res["structures"]
    scale = s["goals_hour_scale"] = GOALS_HOUR_YARDSTICK_MS / s["hash"]["baseline_sha256_pickle_ms"]
    rows = [
        ["chain hash 2,048 blocks", f"{s['hash']['kvmesh_ms']:.2f} ms",
         f"{s['hash']['speedup']:.1f}x vs sha256+pickle ({s['hash']['baseline_sha256_pickle_ms']:.2f} ms)"],
        ["hash + match, prompt seen before", f"{s['match_us']['pool_repeat_hash_and_match'] / 1e3:.2f} ms",
         _verdict(s["match_us"]["pool_repeat_hash_and_match"], TARGETS_US["hash_and_match"], scale)],
        ["hash + match, first sight", f"{s['match_us']['pool_hash_and_match'] / 1e3:.2f} ms",
         _verdict(s["match_us"]["pool_hash_and_match"], TARGETS_US["first_sight"], scale)],
    ]
    for op, key in (("match 32K prompt", "match_us"), ("match, first time (no memo)", "match_cold_us"),
                    ("insert 2,048 blocks", "insert_us")):
        target = TARGETS_US[key.removesuffix("_us")]
        rows.append([op, f"{s[key]['pool']:.1f} us", _verdict(s[key]["pool"], target, scale)])
    # the goal is eviction as serving meets it: an allocation from a full pool (evict() runs after start-up probes)
    rows.append(["evict 10 by allocating (full pool)", f"{s['evict10_us']['pool_by_allocate']:.1f} us",
                 _verdict(s["evict10_us"]["pool_by_allocate"], TARGETS_US["evict10"], scale)])
    rows.append(["evict 10 (evict(), after start-up probes)", f"{s['evict10_us']['pool']:.1f} us", ""])
    for op, key in (("match, first time, scattered blocks", "match_cold_us"),
                    ("insert 2,048 scattered blocks", "insert_us")):
        rows.append([op, f"{s[key]['pool_scattered']:.1f} us", "ids with gaps (a churned pool)"])
    rows.append(["block index", s["index"], "KVMESH_BLOCK_INDEX=dict for the fallback"])
    m = s["memory"]
    rows.append(["memory / 1,000 prefixes", f"{m['pool_mb_per_1000_prefixes']:.2f} MB",
                 f"target < {TARGET_MB_PER_1000_PREFIXES} MB"])
    rows.append(["memory / cached block", f"{m['pool_bytes_per_block']:.0f} B",
                 f"{m['pool_bytes_per_block_excl_digest']:.0f} B without the 49-B digest object"])
    print_table(f"prefix cache (the engine's block pool), 32,768-token prompt, 16-token blocks; this run's yardstick "
                f"{s['hash']['baseline_sha256_pickle_ms']:.2f} ms, the goals' hour's {GOALS_HOUR_YARDSTICK_MS} ms",
                ["operation", "block pool", "note"], rows)
    if with_engine:
        e = res["engine_shared_prompt"]
        print_table("engine, shared system prompt (tiny-llama, 12 requests)", ["", "cache on", "cache off"], [
            ["tokens computed", e["cache_on"]["tokens_computed"], e["cache_off"]["tokens_computed"]],
            ["hit rate", f"{e['cache_on']['hit_rate']:.2f}", f"{e['cache_off']['hit_rate']:.2f}"],
            ["reuse rate", f"{e['cache_on']['reuse_rate']:.2f}", f"{e['cache_off']['reuse_rate']:.2f}"],
        ])
        print(f"prefill tokens computed drop: {e['tokens_computed_drop']:.0%}")
    write_json(json_path, res)
    return res
