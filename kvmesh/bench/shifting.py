"""``kvmesh bench cluster --workload shifting``: the prefill:decode ratio against a load that shifts.

The workload alternates phases of a prefill-heavy mix (long prompts, few output tokens) and a
decode-heavy mix (short prompts, long outputs), each phase's requests sent by ``--concurrency``
clients, one phase after the other. Every mode runs the same requests on the same number of nodes:

    auto   1 prefill + N-1 decode nodes to start, the router's role balancer moving them (--roles auto)
    2p1d   2 prefill + 1 decode node, fixed        (with --nodes N: N-1 prefill + 1 decode)
    1p2d   1 prefill + 2 decode nodes, fixed       (with --nodes N: 1 prefill + N-1 decode)
    2p1d-held  2p1d's shape with the balancer running and the nodes able to change roles, held by its
           floors (--min-prefill N-1): never moves; only with --modes
    2p1d-moved  as 2p1d-held, but started as 1p2d and N-2 decode nodes moved to prefill before the first
           phase: what a move leaves behind on a node; only with --modes

Per mode and phase: SLO goodput (requests a second meeting both the TTFT and the TPOT bound), TTFT and
TPOT p50 / p99; per mode: requests lost (no answer) and failed (an error), role changes, and the roles
over time (sampled every second; a PNG beside the JSON with ``--plots``).
"""
from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from kvmesh.bench import memory_warmup
from kvmesh.bench.cluster_bench import stream_one
from kvmesh.bench.report import percentile
from kvmesh.cluster.local_launcher import LocalCluster
from kvmesh.cluster.router import Router, RouterConfig

PHASES = ("prefill-heavy", "decode-heavy")
# Each node's account at the end of a mode: prompts it computed for others and refused as busy; as a decode node,
# conversations with prefill nodes that failed or were refused, and the rate it fitted to each prefill node; the
# most requests it runs at once.
NODE_WORK_KEYS = ("num_prefills", "num_prefills_refused_busy", "prefill_tokens_per_s", "num_fallbacks",
                  "num_prefill_refusals", "prefill_node_tokens_per_s", "max_num_seqs")


@dataclass
class ShiftRequest:
    phase: int  # index into the run's phase list
    prompt_ids: list[int]
    max_tokens: int


@dataclass
class Outcome:
    phase: int
    ttft_s: float = 0.0
    tpot_s: float = 0.0
    num_tokens: int = 0
    error: str = ""


def shifting_workload(args, vocab: int) -> list[list[ShiftRequest]]:
    """``args.phases`` phases alternating prefill-heavy and decode-heavy, ``args.per_phase`` requests each."""
    rng = random.Random(args.seed)
    phases = []
    for k in range(args.phases):
        heavy_prefill = k % 2 == 0
        prompt_len, out_len = ((args.long_prompt_len, args.short_output_len) if heavy_prefill
                               else (args.short_prompt_len, args.long_output_len))
        phases.append([ShiftRequest(k, [rng.randrange(vocab) for _ in range(prompt_len)], out_len)
                       for _ in range(args.per_phase)])
    return phases


@dataclass(frozen=True)
class ShiftMode:
    num_prefill: int
    num_decode: int
    roles_auto: bool  # the router's role balancer runs (and the nodes take --role-changes)
    min_prefill: int = 0  # the balancer's floors: at num_prefill / num_decode, it can never move a node
    min_decode: int = 1
    moves_at_start: int = 0  # decode nodes moved to prefill (SetRole) before the first phase


def shifting_modes(num_nodes: int) -> dict[str, ShiftMode]:
    """The modes by name (``2p1d-held``: 2p1d's shape with everything auto runs, the balancer held by its floors
    so it never moves: what auto costs beyond the shape it chooses)."""
    return {"auto": ShiftMode(1, num_nodes - 1, True), "2p1d": ShiftMode(num_nodes - 1, 1, False),
            "1p2d": ShiftMode(1, num_nodes - 1, False),
            "2p1d-held": ShiftMode(num_nodes - 1, 1, True, min_prefill=num_nodes - 1, min_decode=1),
            "2p1d-moved": ShiftMode(1, num_nodes - 1, True, min_prefill=num_nodes - 1, min_decode=1,
                                    moves_at_start=num_nodes - 2)}


def move_at_start(cluster: LocalCluster, router: Router, num_moves: int, timeout_s: float = 60.0) -> list[str]:
    """Move ``num_moves`` decode nodes (the last by id) to prefill (SetRole; a refusal raises) and wait until the
    router lists them so; their ids. Before any request: nothing to drain."""
    if not num_moves:
        return []
    deadline = time.monotonic() + timeout_s

    def wait_until(done, what: str) -> None:
        while not done():
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} within {timeout_s:.0f} s")
            time.sleep(0.1)

    wait_until(lambda: set(router.directory.nodes) >= set(cluster.nodes), "the router did not list every node")
    decode_ids = sorted(n for n, r in router.directory.nodes.items() if r.role == "decode")
    moved = decode_ids[len(decode_ids) - num_moves:]
    for node_id in moved:
        cluster.client(node_id).set_role("prefill", 30.0)
    wait_until(lambda: all(router.directory.nodes[n].role == "prefill" for n in moved),
               f"the router did not list {moved} as prefill nodes")
    return moved


def _one(router: Router, req: ShiftRequest) -> Outcome:
    try:
        record = stream_one(router, req.prompt_ids, req.max_tokens, "")
    except Exception as e:  # noqa: BLE001 (counted as failed, the run goes on)
        return Outcome(req.phase, error=f"{type(e).__name__}: {e}")
    tpot = (record.e2e_s - record.ttft_s) / (record.num_tokens - 1) if record.num_tokens > 1 else 0.0
    return Outcome(req.phase, record.ttft_s, tpot, record.num_tokens)


def run_shifting_mode(name: str, args, phases: list[list[ShiftRequest]], bar) -> dict:
    mode = shifting_modes(args.nodes)[name]
    num_prefill, num_decode, auto = mode.num_prefill, mode.num_decode, mode.roles_auto
    cluster_name = f"shift-{name}"
    node_args = ["--transfer-backend", "auto", "--kv-placement", args.kv_placement] + \
        (["--role-changes"] if auto else []) + (["--max-num-seqs", str(args.max_num_seqs)] if args.max_num_seqs else [])
    with LocalCluster(num_prefill, num_decode, model=args.model, cluster=cluster_name, node_args=node_args,
                      start_timeout_s=300, dtype=args.dtype, threads_per_node=args.threads_per_node) as cluster:
        router = Router(RouterConfig(
            etcd=cluster.etcd_endpoint, cluster_token=cluster.token, model=args.model, cluster=cluster_name,
            max_in_flight=100_000, roles="auto" if auto else "fixed", ttft_slo_ms=args.slo_ttft_ms,
            tpot_slo_ms=args.slo_tpot_ms, role_interval_s=args.role_interval_s,
            role_cooldown_s=args.role_cooldown_s, min_prefill=mode.min_prefill, min_decode=mode.min_decode))
        move_at_start(cluster, router, mode.moves_at_start)
        timeline: list[tuple[float, dict[str, str]]] = []
        stop = threading.Event()
        start, wall_start = time.perf_counter(), time.time()  # (the balancer's history is in wall time)

        def sample_roles() -> None:  # now, every second, and once more at the end
            ended = False
            while not ended:
                ended = stop.wait(0.0 if not timeline else 1.0)
                timeline.append((time.perf_counter() - start,
                                 {n: r.role for n, r in sorted(router.directory.nodes.items())}))

        sampler = threading.Thread(target=sample_roles, daemon=True)
        sampler.start()
        outcomes: list[Outcome] = []
        phase_s = []
        node_work: dict[str, dict] = {}
        try:
            for requests in phases:
                began = time.perf_counter()
                with ThreadPoolExecutor(args.concurrency) as pool:
                    for outcome in pool.map(lambda r: _one(router, r), requests):
                        outcomes.append(outcome)
                        bar.update(1)
                phase_s.append(time.perf_counter() - began)
            for node_id in cluster.nodes:  # every pool still consistent; who computed and refused what
                stats = cluster.client(node_id).stats(check=True)
                node_work[node_id] = {key: stats.get(key, 0) for key in NODE_WORK_KEYS}
        finally:
            stop.set()
            sampler.join(5)
            moves = dict(router.roles.moves) if router.roles is not None else {}
            history = [{"t": t - wall_start, "node": n, "to": role, "reason": why} for t, n, role, why in
                       (router.roles.history if router.roles is not None else [])]
            router.close()
    return {**_summary(name, args, phases, outcomes, phase_s, timeline, moves, history), "node_work": node_work}


def _summary(name, args, phases, outcomes, phase_s, timeline, moves, history) -> dict:
    def good(o: Outcome) -> bool:
        return not o.error and o.num_tokens > 0 and o.ttft_s * 1e3 <= args.slo_ttft_ms and \
            o.tpot_s * 1e3 <= args.slo_tpot_ms

    out_phases = []
    for k, seconds in enumerate(phase_s):
        mine = [o for o in outcomes if o.phase == k]
        served = [o for o in mine if not o.error and o.num_tokens]
        out_phases.append({
            "name": PHASES[k % 2], "seconds": seconds, "requests": len(mine),
            "goodput_rps": sum(good(o) for o in mine) / seconds,
            "ttft_p50_ms": percentile([o.ttft_s * 1e3 for o in served], 0.5),
            "ttft_p99_ms": percentile([o.ttft_s * 1e3 for o in served], 0.99),
            "tpot_p50_ms": percentile([o.tpot_s * 1e3 for o in served if o.num_tokens > 1], 0.5),
            "tpot_p99_ms": percentile([o.tpot_s * 1e3 for o in served if o.num_tokens > 1], 0.99),
            # every answered request's (TTFT, TPOT) in ms: goodput under other SLOs, read from the JSON
            "requests_ms": [[round(o.ttft_s * 1e3, 1), round(o.tpot_s * 1e3, 2)] for o in served]})
    total_s = sum(phase_s)
    return {"goodput_rps": sum(good(o) for o in outcomes) / total_s if total_s else 0.0,
            "lost": sum(1 for o in outcomes if not o.error and not o.num_tokens),
            "failed": sum(1 for o in outcomes if o.error), "errors": sorted({o.error for o in outcomes if o.error})[:5],
            "role_changes": sum(moves.values()), "role_moves": history, "seconds": total_s,
            "nodes": {"prefill": shifting_modes(args.nodes)[name].num_prefill,
                      "decode": shifting_modes(args.nodes)[name].num_decode},
            "phases": out_phases, "roles_over_time": [{"t": t, "roles": roles} for t, roles in timeline],
            "phase_ends_s": [sum(phase_s[:k + 1]) for k in range(len(phase_s))]}


def plot_roles(res: dict, folder: str) -> str:
    """Prefill nodes over time, one row per mode with its own phase ends marked: roles_over_time.png in
    ``folder`` (rows apart: a mode holding another's shape would hide behind its line)."""
    from pathlib import Path

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    modes = res["modes"]
    fig, axes = plt.subplots(len(modes), 1, figsize=(8, 1.2 + 1.3 * len(modes)), sharex=True, squeeze=False)
    for ax, (name, m) in zip(axes[:, 0], modes.items()):
        points = m["roles_over_time"]
        ax.step([p["t"] for p in points], [sum(r == "prefill" for r in p["roles"].values()) for p in points],
                where="post")
        for end in m["phase_ends_s"][:-1]:
            ax.axvline(end, color="grey", linestyle=":", linewidth=1)
        ax.set_ylabel(f"{name}\nprefill nodes")
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylim(-0.2, sum(m["nodes"].values()) - 0.8)
    axes[-1, 0].set_xlabel("seconds (dotted: the mode's phase ends)")
    axes[0, 0].set_title("Roles over time")
    fig.tight_layout()
    path = out / "roles_over_time.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def run(args) -> dict:
    from tqdm import tqdm

    from kvmesh.bench.report import machine, print_table, write_json
    from kvmesh.model.card import load_tokenizer

    if args.nodes < 3:
        raise SystemExit("kvmesh bench cluster --workload shifting: --nodes 3 or more (2p1d and 1p2d need three)")
    card = load_tokenizer(args.model)
    vocab = min(card.config.vocab_size, 256) if args.model.startswith("tiny") else card.config.vocab_size
    phases = shifting_workload(args, vocab)
    names = [m for m in (args.modes or "auto,2p1d,1p2d").split(",") if m]
    unknown = set(names) - set(shifting_modes(args.nodes))
    if unknown:
        raise SystemExit(f"kvmesh bench cluster --workload shifting: unknown modes {sorted(unknown)} "
                         f"({', '.join(shifting_modes(args.nodes))})")
    res: dict = {"machine": machine(), "model": args.model, "workload": "shifting", "nodes": args.nodes,
                 "slo": {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms},
                 "phases": [{"name": PHASES[k % 2], "requests": len(p), "prompt_tokens": len(p[0].prompt_ids),
                             "output_tokens": p[0].max_tokens} for k, p in enumerate(phases)],
                 "concurrency": args.concurrency, "role_interval_s": args.role_interval_s,
                 "threads_per_node": args.threads_per_node, "kv_placement": args.kv_placement,
                 "role_cooldown_s": args.role_cooldown_s, "max_num_seqs_per_node": args.max_num_seqs or None,
                 "modes": {}}
    memory_warmup.warm_up(args.touch_memory_gib, res)  # the first mode's nodes too start on memory touched before
    with tqdm(total=sum(map(len, phases)) * len(names), desc="bench cluster (shifting)") as bar:
        for name in names:
            bar.set_postfix_str(name)
            res["modes"][name] = run_shifting_mode(name, args, phases, bar)
    rows = [[name, f"{m['goodput_rps']:.3f}", *(f"{p['goodput_rps']:.3f}" for p in m["phases"]), m["lost"],
             m["failed"], m["role_changes"]] for name, m in res["modes"].items()]
    print_table(f"shifting, {args.model}: {args.nodes} nodes, SLO TTFT {args.slo_ttft_ms:g} ms / TPOT "
                f"{args.slo_tpot_ms:g} ms; goodput in requests/s",
                ["mode", "goodput", *(f"{k + 1}: {p['name']}" for k, p in enumerate(res["phases"])), "lost",
                 "failed", "role changes"], rows)
    if args.plots:
        res["plots"] = [plot_roles(res, args.plots)]
        print("plots: " + ", ".join(res["plots"]))
    write_json(args.json, res)
    return res


def add_arguments(p) -> None:
    """The flags ``--workload shifting`` adds to ``kvmesh bench cluster``."""
    g = p.add_argument_group("--workload shifting")
    g.add_argument("--nodes", type=int, default=3, help="nodes of every mode")
    g.add_argument("--phases", type=int, default=4, help="phases, prefill-heavy first, alternating")
    g.add_argument("--per-phase", type=int, default=24, help="requests per phase")
    g.add_argument("--long-prompt-len", type=int, default=768)
    g.add_argument("--short-output-len", type=int, default=4)
    g.add_argument("--short-prompt-len", type=int, default=32)
    g.add_argument("--long-output-len", type=int, default=96)
    g.add_argument("--role-interval-s", type=float, default=1.0, help="auto: between the balancer's looks")
    g.add_argument("--role-cooldown-s", type=float, default=10.0, help="auto: after a move, before the next")
    g.add_argument("--max-num-seqs", type=int, default=0,
                   help="requests each node runs at once, at most (as a GPU's KV memory bounds its streams); 0: the "
                        "nodes' default")
    g.add_argument("--threads-per-node", type=int, default=0,
                   help="compute threads of each node, fixed (each node as on a machine of its own); 0: the nodes "
                        "divide this machine's cores among those with work at each step")
    memory_warmup.add_argument(g, "the first mode starts")
