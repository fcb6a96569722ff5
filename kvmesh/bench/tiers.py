"""``kvmesh bench tiers``: a multi-turn workload whose working set is several times the nodes' KV buffers.

    tier0              the KV buffer only: a conversation's earlier turns are recomputed once evicted
    tier0+host         evicted blocks move to a host-memory tier and are promoted back
    tier0+host+disk    a smaller host tier, with a local-disk tier below it

Sessions take turns in rounds (every session's turn k before any turn k + 1, as users pause
between turns), so a session's blocks have aged out of the KV buffer by its next turn.
Every mode gets a fresh local cluster (decode nodes only by default, cache-aware routing
with session stickiness, the cost model deciding) and the same conversations. The KV buffer
of each node is sized so that the working set (every conversation's final prompt and
answers) is ``--overflow`` times all nodes' KV buffers together. Reported per mode, with
the field names of ``kvmesh bench cluster``: hit rates (local, global, per tier), TTFT and
TPOT percentiles, tokens computed and reused, bytes demoted and promoted.
"""
from __future__ import annotations

import math
import tempfile

from tqdm import tqdm

from kvmesh.bench import workloads as wl
from kvmesh.bench.cluster_bench import Mode, run_mode, summarize_runs
from kvmesh.bench.report import machine, print_table, write_json

BLOCK_SIZE = 16


def working_set_blocks(args) -> int:
    """Blocks of every conversation's last prompt plus its last answer (all turns share that chain)."""
    tokens = args.first_len + (args.turns - 1) * args.turn_len + args.turns * args.output_len
    return args.sessions * math.ceil(tokens / BLOCK_SIZE)


def sizes(args, bytes_per_block: int) -> dict:
    """Blocks per node in each tier, from the working set."""
    ws = working_set_blocks(args)
    nodes = args.decode + args.prefill
    longest = math.ceil((args.first_len + (args.turns - 1) * args.turn_len + args.turns * args.output_len)
                        / BLOCK_SIZE) + 1
    running = math.ceil(args.concurrency / max(1, args.decode)) * longest  # room the running requests need
    tier0 = max(int(ws // (args.overflow * nodes)), running + 8)  # rounded down: the overflow is at least asked
    per_node = math.ceil(ws / max(1, args.decode))
    return {"working_set_blocks": ws, "tier0_blocks": tier0, "host_blocks": math.ceil(1.25 * per_node),
            "small_host_blocks": math.ceil(0.25 * per_node), "disk_blocks": math.ceil(1.25 * per_node),
            "working_set_over_tier0": ws / (tier0 * nodes), "bytes_per_block": bytes_per_block}


def modes(args, size: dict, disk_path: str) -> dict[str, Mode]:
    gib = size["bytes_per_block"] / 2**30
    base = ("--num-kv-blocks", str(size["tier0_blocks"]), "--kv-placement", "cost")
    return {
        "tier0": Mode("tier0", args.prefill, base + ("--host-kv-gib", "0"), "cache-aware"),
        "tier0+host": Mode("tier0+host", args.prefill, base + ("--host-kv-gib", repr(size["host_blocks"] * gib)),
                           "cache-aware"),
        "tier0+host+disk": Mode("tier0+host+disk", args.prefill,
                                base + ("--host-kv-gib", repr(size["small_host_blocks"] * gib),
                                        "--disk-kv-gib", repr(size["disk_blocks"] * gib), "--disk-kv-path", disk_path),
                                "cache-aware"),
    }


def run(args) -> dict:
    from kvmesh.kv.kv_buffer import KVLayout
    from kvmesh.model.config import parse_dtype
    from kvmesh.model.loader import load_model

    loaded = load_model(args.model, progress=False)
    vocab = min(loaded.config.vocab_size, 256) if args.model.startswith("tiny") else loaded.config.vocab_size
    layout = KVLayout.for_model(loaded.config, parse_dtype("float32", "cpu"), BLOCK_SIZE, num_blocks=1)
    del loaded
    size = sizes(args, layout.bytes_per_block)
    conversations = wl.multi_turn(args.sessions, args.turns, args.first_len, args.turn_len, args.output_len, vocab,
                                  args.seed)
    num = args.sessions * args.turns
    res: dict = {"machine": machine(), "model": args.model, "workload": "multi-turn", "num_requests": num,
                 "sessions": args.sessions, "turns": args.turns, "prefill_nodes": args.prefill,
                 "decode_nodes": args.decode, "concurrency": args.concurrency, "sizes": size, "modes": {}}
    names = [m for m in args.modes.split(",") if m]
    with tempfile.TemporaryDirectory(prefix="kvmesh-bench-tiers-") as disk_path, \
            tqdm(total=num * len(names), desc="bench tiers") as bar:
        chosen = modes(args, size, disk_path)
        for name in names:
            bar.set_postfix_str(name)
            run = run_mode(chosen[name], args.model, args.decode, "multi-turn-rounds", conversations,
                           args.concurrency, None, bar)
            res["modes"][name] = summarize_runs([run], args.slo_ttft_ms, args.slo_tpot_ms)
    base = res["modes"].get("tier0")
    if base:
        for m in res["modes"].values():
            m["vs_tier0"] = {"hit_rate_global": m["hit_rate_global"] / max(base["hit_rate_global"], 1e-9),
                             "ttft_p50": m["ttft_p50_ms"] / max(base["ttft_p50_ms"], 1e-9),
                             "tokens_computed": m["tokens_computed"] / max(base["tokens_computed"], 1)}
    _print(res)
    write_json(args.json, res)
    return res


def _print(res: dict) -> None:
    size = res["sizes"]
    rows = []
    for name, m in res["modes"].items():
        tiers = m["hit_rate_tier"]
        rows.append([name, f"{m['hit_rate_local']:.2f}", f"{m['hit_rate_global']:.2f}",
                     f"{tiers['tier0']:.2f}/{tiers['host']:.2f}/{tiers['disk']:.2f}/{tiers['remote']:.2f}",
                     f"{m['ttft_p50_ms']:.0f}", f"{m['ttft_p99_ms']:.0f}", f"{m['tpot_p50_ms']:.1f}",
                     m["tokens_computed"], m["tokens_reused"], f"{m['bytes_demoted'] / 2**20:.1f}",
                     f"{m['bytes_promoted'] / 2**20:.1f}",
                     f"{m.get('vs_tier0', {}).get('ttft_p50', float('nan')):.2f}"])
    print_table(f"multi-turn, {res['model']}: {res['sessions']} sessions x {res['turns']} turns, "
                f"{res['decode_nodes']} decode + {res['prefill_nodes']} prefill nodes; working set "
                f"{size['working_set_blocks']} blocks = {size['working_set_over_tier0']:.1f}x the KV buffers "
                f"({size['tier0_blocks']} blocks per node)",
                ["mode", "hit local", "hit global", "hit tier0/host/disk/remote", "TTFT p50 ms", "TTFT p99 ms",
                 "TPOT p50 ms", "tokens computed", "tokens reused", "MiB demoted", "MiB promoted",
                 "TTFT p50 vs tier0"], rows)


def add_arguments(p) -> None:
    p.add_argument("--json", default=None)
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--modes", default="tier0,tier0+host,tier0+host+disk")
    p.add_argument("--sessions", type=int, default=64)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--first-len", type=int, default=256, help="tokens of a conversation's first prompt")
    p.add_argument("--turn-len", type=int, default=32, help="tokens the user adds each turn")
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=4, help="conversations in flight")
    p.add_argument("--decode", type=int, default=2)
    p.add_argument("--prefill", type=int, default=0)
    p.add_argument("--overflow", type=float, default=5.0, help="working set / all nodes' KV buffers")
    p.add_argument("--slo-ttft-ms", type=float, default=500.0)
    p.add_argument("--slo-tpot-ms", type=float, default=100.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="16 sessions x 3 turns")


def apply_quick(args) -> None:
    if args.quick:
        args.sessions, args.turns, args.first_len = 24, 3, 192
