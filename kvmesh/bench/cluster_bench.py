"""``kvmesh bench cluster``: the modes compared in one run, on the same workload.

    kvmesh     prefill + decode nodes, global pool, cache-aware routing
    local-rr   prefill + decode nodes, local caches only, round-robin (vLLM-style PD)
    no-cache   prefill + decode nodes, no prefix caching, round-robin
    colocated  decode nodes only, each prefills its own requests (local caches), round-robin; on as
               many machines as the other modes (the prefill nodes' machines serve as decode nodes too)

Each mode gets a fresh local cluster and the same requests (``--repeat N``: N runs each, the
modes taking turns, metrics over the pooled requests and each run's TTFT p50 kept). Per request:
TTFT, TPOT, ITL, end-to-end latency, where its prompt's KV came from, how long it waited for remote KV.
Per mode: percentiles, throughput, goodput under TTFT/TPOT SLOs, local and global hit
rates, tokens computed (all nodes) and reused, bytes transferred, the transfer's share of TTFT,
and what the decode nodes' cost model chose (requests computed locally vs fetched).

``--hosts N`` runs etcd on simulated host 1 and each node on a host of its own
(network namespaces, ``cluster/hosts.py``; the router stays on this machine, which
reaches them over the bridge), so every byte crosses a veth link; ``--link-gbit
0.1,1,10`` caps the links and runs every mode at each cap.
"""
from __future__ import annotations

import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import NamedTuple

from tqdm import tqdm

from kvmesh.bench import workloads as wl
from kvmesh.bench.report import percentile
from kvmesh.cluster.local_launcher import LocalCluster
from kvmesh.cluster.router import Router, RouterConfig
from kvmesh.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class Mode:
    name: str
    num_prefill: int
    node_args: tuple[str, ...]
    routing: str
    num_extra_decode: int = 0  # decode nodes beyond --decode: every mode runs on the same number of machines


def modes(num_prefill: int, placement: str = "cost") -> dict[str, Mode]:
    # "cost" (default): the decode nodes' planner decides per request, as in production; "threshold:N" computes
    # uncached suffixes up to N tokens here and fetches longer ones (to exercise the remote path).
    # colocated is defined by never fetching.
    disaggregated = ("--kv-placement", placement)
    return {
        "kvmesh": Mode("kvmesh", num_prefill, disaggregated, "cache-aware"),
        "local-rr": Mode("local-rr", num_prefill, disaggregated + ("--no-global-pool",), "round-robin"),
        "no-cache": Mode("no-cache", num_prefill, disaggregated + ("--no-prefix-cache", "--host-kv-gib", "0"),
                         "round-robin"),
        "colocated": Mode("colocated", 0, ("--kv-placement", "threshold:100000000", "--no-global-pool"),
                          "round-robin", num_extra_decode=num_prefill),
    }


@dataclass
class Record:
    ttft_s: float
    e2e_s: float
    itl_s: list[float]
    num_tokens: int
    num_prompt: int
    cache: dict
    answer: list[int]


def stream_one(router: Router, prompt: list[int], max_tokens: int, session: str) -> Record:
    """One greedy request streamed through ``router``, timed (first token, gaps, end)."""
    start = time.perf_counter()
    ttft, last, itl, tokens, final = None, start, [], [], None
    for chunk in router.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                                 session_id=session):
        now = time.perf_counter()
        if chunk.token_ids:
            if ttft is None:
                ttft = now - start
            else:
                itl.append(now - last)
            last = now
            tokens += chunk.token_ids
        final = chunk
    return Record(ttft or 0.0, time.perf_counter() - start, itl, len(tokens), len(prompt), final.cache.as_dict(), tokens)


def _drive(router: Router, workload: str, requests, concurrency: int, bar: tqdm) -> list[Record]:
    records: list[Record] = []
    lock = threading.Lock()

    def keep(record: Record) -> None:
        with lock:
            records.append(record)
        bar.update(1)

    if workload == "multi-turn":
        def conversation(turns: list[wl.BenchRequest]) -> None:
            prompt: list[int] = []
            answer: list[int] = []  # the previous turn's output
            for req in turns:
                prompt = req.prompt_ids if req.turn == 0 else prompt + answer + req.follow_up
                record = stream_one(router, prompt, req.max_tokens, f"conv-{req.conversation}")
                answer = record.answer
                keep(record)

        with ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(conversation, requests))
        return records
    if workload == "multi-turn-rounds":  # every session's turn k before any session's turn k + 1 (users pause)
        prompts: dict[int, list[int]] = {}
        answers: dict[int, list[int]] = {}

        def turn(req: wl.BenchRequest) -> None:
            c = req.conversation
            prompts[c] = req.prompt_ids if req.turn == 0 else prompts[c] + answers[c] + req.follow_up
            record = stream_one(router, prompts[c], req.max_tokens, f"conv-{c}")
            answers[c] = record.answer
            keep(record)

        with ThreadPoolExecutor(concurrency) as pool:
            for k in range(max(len(c) for c in requests)):
                list(pool.map(turn, [c[k] for c in requests if k < len(c)]))
        return records
    start = time.perf_counter()

    def send(req: wl.BenchRequest) -> None:
        if req.arrival_s is not None:
            time.sleep(max(0.0, start + req.arrival_s - time.perf_counter()))
        keep(stream_one(router, req.prompt_ids, req.max_tokens, ""))

    workers = len(requests) if requests and requests[0].arrival_s is not None else concurrency
    with ThreadPoolExecutor(min(workers, 256)) as pool:
        list(pool.map(send, requests))
    return records


def _summarize(records: list[Record], seconds: float, node_delta: dict, slo_ttft_ms: float,
               slo_tpot_ms: float) -> dict:
    ttft = [r.ttft_s * 1e3 for r in records]
    tpot = [(r.e2e_s - r.ttft_s) / (r.num_tokens - 1) * 1e3 for r in records if r.num_tokens > 1]
    itl = [x * 1e3 for r in records for x in r.itl_s]
    e2e = [r.e2e_s * 1e3 for r in records]
    good = sum(1 for r in records if r.ttft_s * 1e3 <= slo_ttft_ms and (
        r.num_tokens < 2 or (r.e2e_s - r.ttft_s) / (r.num_tokens - 1) * 1e3 <= slo_tpot_ms))
    tier0 = [r.cache.get("tokens_reused_local", 0) for r in records]
    host = [r.cache.get("tokens_reused_host", 0) for r in records]  # the node's own lower tiers (docs/tiers.md)
    disk = [r.cache.get("tokens_reused_disk", 0) for r in records]
    local = [a + b + c for a, b, c in zip(tier0, host, disk)]
    remote = [r.cache.get("tokens_reused_remote", 0) for r in records]
    from_prefill = sum(r.cache.get("tokens_from_prefill_node", 0) for r in records)
    prefill_cached = sum(r.cache.get("tokens_reused_prefill_node", 0) for r in records)
    computed_here = sum(r.cache.get("tokens_computed", 0) for r in records)
    share = [min(1.0, r.cache.get("kv_wait_ms", 0.0) / (r.ttft_s * 1e3)) for r in records if r.ttft_s > 0]
    out = {"requests": len(records), "seconds": seconds,
           "throughput_tok_s": sum(r.num_tokens for r in records) / seconds,
           "goodput_req_s": good / seconds,
           "hit_rate_local": sum(1 for x in local if x > 0) / len(records),
           "hit_rate_global": sum(1 for a, b in zip(local, remote) if a + b > 0) / len(records),
           # Requests with a hit in each place (a request may hit several).
           "hit_rate_tier": {name: sum(1 for x in xs if x > 0) / len(records)
                             for name, xs in (("tier0", tier0), ("host", host), ("disk", disk), ("remote", remote))},
           "tokens_reused": sum(local) + sum(remote) + prefill_cached, "tokens_reused_remote": sum(remote),
           # Every prompt token once, by where its KV came from (the decode nodes' own accounting).
           "prompt_tokens": {"reused_local": sum(tier0), "reused_host": sum(host), "reused_disk": sum(disk),
                             "reused_remote": sum(remote), "reused_prefill_node": prefill_cached,
                             "from_prefill_node": from_prefill, "computed_here": computed_here},
           "prompt_tokens_total": sum(r.num_prompt for r in records),
           # Computed anywhere: on the decode nodes, plus what prefill nodes really computed (their own
           # cache hits excluded, so this can be less than computed_here + from_prefill_node).
           "tokens_computed": computed_here + node_delta["prefill_tokens_computed"],
           "bytes_transferred": node_delta["bytes_received"],
           "bytes_demoted": node_delta["tier_bytes_demoted"], "bytes_promoted": node_delta["tier_bytes_promoted"],
           "transfer_share_of_ttft": statistics.mean(share) if share else 0.0}
    # Requests whose KV (some of it) came from another node: what waiting for it cost them.
    def num_fetched(r: Record) -> int:
        return r.cache.get("tokens_reused_remote", 0) + r.cache.get("tokens_from_prefill_node", 0) + \
            r.cache.get("tokens_reused_prefill_node", 0)

    fetched = [r for r in records if num_fetched(r)]
    out["fetched_requests"] = {
        "requests": len(fetched),
        "ttft_p50_ms": percentile([r.ttft_s * 1e3 for r in fetched], 0.5),
        "kv_wait_p50_ms": percentile([r.cache.get("kv_wait_ms", 0.0) for r in fetched], 0.5),
        "fetch_p50_ms": percentile([r.cache.get("fetch_ms", 0.0) for r in fetched], 0.5),
        # Of the KV wait, what is not the fetch itself: the wait for the fetching node's next step boundary.
        "step_boundary_wait_p50_ms": percentile([r.cache.get("kv_wait_ms", 0.0) - r.cache.get("fetch_ms", 0.0)
                                                 for r in fetched], 0.5),
        "decode_step_mean_ms": node_delta["decode_step_s"] / max(node_delta["decode_steps"], 1) * 1e3,
        "tokens_fetched_mean": statistics.mean(num_fetched(r) for r in fetched) if fetched else 0.0}
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2e", e2e)):
        for q in (50, 90, 99):
            out[f"{name}_p{q}_ms"] = percentile(values, q / 100)
    out["ttft_ms_all"] = sorted(ttft)
    return out


def _node_totals(cluster: LocalCluster) -> dict:
    totals = {"prefill_tokens_computed": 0, "bytes_received": 0, "num_local": 0, "num_remote": 0,
              "tier_bytes_demoted": 0, "tier_bytes_promoted": 0, "decode_step_s": 0.0, "decode_steps": 0}
    for node_id, node in cluster.nodes.items():
        stats = cluster.client(node_id).stats()
        for key in ("bytes_received", "num_local", "num_remote", "tier_bytes_demoted", "tier_bytes_promoted"):
            totals[key] += stats.get(key, 0)
        if node.role == "prefill":
            totals["prefill_tokens_computed"] += stats.get("tokens_computed", 0)
        else:  # decode-only steps (one token per stream): what a landing should wait at most
            totals["decode_step_s"] += stats.get("engine_decode_step_s", 0.0)
            totals["decode_steps"] += stats.get("engine_decode_steps", 0)
    return totals


class ModeRun(NamedTuple):
    records: list[Record]
    seconds: float
    node_delta: dict  # node counters over the run (after - before)
    fetch_costs: dict  # what the router learned fetches into each decode node cost (``FetchCosts.describe``)


def run_mode(mode: Mode, model: str, num_decode: int, workload: str, requests, concurrency: int,
             routing: str | None, bar: tqdm, hosts=None, insecure: bool = False, dtype: str = "float32",
             tracing: tuple[str, float] | None = None) -> ModeRun:
    """One run of ``requests`` on a fresh cluster in ``mode`` (``insecure``: no cluster token, so no CurveZMQ
    and no etcd authentication: what the channel security costs; ``dtype``: the nodes'; ``tracing``: (OTLP
    endpoint, sample ratio) of the router and every node)."""
    cluster_name = "bench-" + mode.name.replace("+", "-")
    endpoint, ratio = tracing or ("", 1.0)
    traced = ("--otlp-endpoint", endpoint, "--trace-sample-ratio", repr(ratio)) if endpoint else ()
    with LocalCluster(mode.num_prefill, num_decode + mode.num_extra_decode, model=model, cluster=cluster_name,
                      node_args=["--transfer-backend", "auto", *mode.node_args, *traced], start_timeout_s=300,
                      hosts=hosts, cluster_token="" if insecure else None, dtype=dtype) as cluster:
        router = Router(RouterConfig(etcd=cluster.etcd_endpoint, cluster_token=cluster.token, model=model,
                                     cluster=cluster_name, routing=routing or mode.routing,
                                     max_in_flight=100_000, otlp_endpoint=endpoint, trace_sample_ratio=ratio))
        try:
            before = _node_totals(cluster)
            start = time.perf_counter()
            records = _drive(router, workload, requests, concurrency, bar)
            seconds = time.perf_counter() - start
            after = _node_totals(cluster)
            for node_id in cluster.nodes:
                cluster.client(node_id).stats(check=True)  # every pool still consistent
            fetch_costs = router.fetch_costs.describe()
        finally:
            router.close()
    return ModeRun(records, seconds, {k: after[k] - before[k] for k in before}, fetch_costs)


def summarize_runs(runs: list[ModeRun], slo_ttft_ms: float, slo_tpot_ms: float) -> dict:
    """One mode's metrics over all its runs' requests pooled, plus each run's TTFT p50 (the spread)."""
    records = [r for run in runs for r in run.records]
    delta = {k: sum(run.node_delta[k] for run in runs) for k in runs[0].node_delta}
    out = _summarize(records, sum(run.seconds for run in runs), delta, slo_ttft_ms, slo_tpot_ms)
    out["decisions"] = {"computed_locally": delta["num_local"], "fetched": delta["num_remote"]}
    out["runs"] = len(runs)
    out["router_fetch_costs"] = [run.fetch_costs for run in runs]
    out["ttft_p50_ms_per_run"] = [percentile([r.ttft_s * 1e3 for r in run.records], 0.5) for run in runs]
    return out


def build_workload(args, vocab: int, tokenize):
    if args.workload == "shared-prefix":
        return wl.shared_prefix(args.groups, args.per_group, args.system_len, args.question_len, args.output_len,
                                vocab, args.seed)
    if args.workload == "multi-turn":
        return wl.multi_turn(args.conversations, args.turns, args.system_len, args.question_len, args.output_len,
                             vocab, args.seed)
    if args.workload == "random":
        return wl.random_prompts(args.groups * args.per_group, args.question_len, args.system_len, args.output_len,
                                 vocab, args.seed)
    if args.workload == "mooncake":
        return wl.mooncake_trace(args.trace, vocab, args.max_prompt_len, args.time_scale)
    if args.workload == "sharegpt":
        return wl.sharegpt(args.trace, tokenize, args.groups * args.per_group, args.max_prompt_len, args.seed)
    raise ValueError(f"unknown workload {args.workload!r}")


def run(args) -> dict:
    from kvmesh.bench.report import machine, write_json
    from kvmesh.model.card import load_tokenizer

    if args.repeat < 1:
        raise SystemExit(f"kvmesh bench cluster: --repeat {args.repeat}: at least 1")
    card = load_tokenizer(args.model)  # the config and tokenizer only: the nodes hold the weights
    vocab = min(card.config.vocab_size, 256) if args.model.startswith("tiny") else card.config.vocab_size
    tokenize = card.tokenizer.encode
    requests = build_workload(args, vocab, tokenize)
    if args.rate and args.workload not in ("multi-turn", "mooncake"):
        wl.poisson_arrivals(requests, args.rate, args.seed)
    chosen = modes(args.prefill, args.kv_placement)
    names = [m for m in args.modes.split(",") if m] if args.modes else list(chosen)
    num = sum(len(c) for c in requests) if args.workload == "multi-turn" else len(requests)
    res: dict = {"machine": machine(), "model": args.model, "workload": args.workload, "num_requests": num,
                 "prefill_nodes": args.prefill, "decode_nodes": args.decode, "concurrency": args.concurrency,
                 "rate": args.rate, "slo": {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms},
                 "kv_placement": args.kv_placement, "dtype": args.dtype, "hosts": args.hosts, "repeat": args.repeat, "modes": {}}
    caps = [float(x) for x in args.link_gbit.split(",")] if args.link_gbit else [None]
    hosts = None
    if args.hosts:
        from kvmesh.cluster.hosts import Hosts, HostsError

        try:
            hosts = Hosts(args.hosts, prefix="kvbench", subnet="10.81.0").up()
        except HostsError as e:
            raise SystemExit(f"kvmesh bench cluster --hosts: {e}") from None
    try:
        with tqdm(total=num * len(names) * len(caps) * args.repeat, desc=f"bench cluster ({args.workload})") as bar:
            for cap in caps:
                if hosts is not None:
                    for h in hosts.hosts:
                        hosts.set_rate(h.index, cap * 1000 if cap else None)
                runs: dict[str, list[ModeRun]] = {name: [] for name in names}
                for _ in range(args.repeat):  # modes take turns, so a slow spell of the machine hits all
                    for name in names:
                        bar.set_postfix_str(f"{name}" + (f" @ {cap:g} Gbit/s" if cap else ""))
                        runs[name].append(run_mode(chosen[name], args.model, args.decode, args.workload, requests,
                                                   args.concurrency, args.routing or None, bar, hosts,
                                                   args.insecure, args.dtype))
                results = {name: summarize_runs(r, args.slo_ttft_ms, args.slo_tpot_ms) for name, r in runs.items()}
                for name, m in results.items():
                    m["nodes"] = {"prefill": chosen[name].num_prefill,
                                  "decode": args.decode + chosen[name].num_extra_decode}
                if cap is None:
                    res["modes"] = results
                else:
                    res.setdefault("links", {})[f"{cap:g}gbit"] = {"modes": results}
                _print(args, num, results, f" @ {cap:g} Gbit/s links" if cap else "")
    finally:
        if hosts is not None:
            hosts.down()
    if "links" in res:  # the top-level modes: the first cap's, for plots and older readers
        res["modes"] = next(iter(res["links"].values()))["modes"]
    if args.plots:
        from kvmesh.bench.plots import plot_cluster_results

        res["plots"] = plot_cluster_results(res, args.plots)
        print("plots: " + ", ".join(res["plots"]))
    write_json(args.json, res)
    return res


def _print(args, num: int, results: dict, suffix: str) -> None:
    from kvmesh.bench.report import print_table

    rows = []
    for name, m in results.items():
        rows.append([name, f"{m['ttft_p50_ms']:.0f}", f"{m['ttft_p99_ms']:.0f}", f"{m['tpot_p50_ms']:.1f}",
                     f"{m['e2e_p50_ms']:.0f}", f"{m['throughput_tok_s']:.0f}", f"{m['goodput_req_s']:.2f}",
                     f"{m['hit_rate_local']:.2f}", f"{m['hit_rate_global']:.2f}", m["tokens_computed"],
                     m["tokens_reused"], f"{m['bytes_transferred'] / 2**20:.1f}",
                     f"{m['transfer_share_of_ttft']:.2f}",
                     f"{m['decisions']['computed_locally']}/{m['decisions']['fetched']}"])
    header = ["mode", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms", "e2e p50 ms", "tok/s", "goodput req/s",
              "hit local", "hit global", "tokens computed", "tokens reused", "MiB moved", "transfer/TTFT",
              "local/fetched"]
    if args.repeat > 1:  # the spread the pooled p50 hides
        header.append("TTFT p50 per run ms")
        for row, m in zip(rows, results.values()):
            row.append(" / ".join(f"{x:.1f}" for x in m["ttft_p50_ms_per_run"]))
    where = f", {args.hosts} hosts" if args.hosts else ""
    runs = f" x {args.repeat} runs (requests pooled)" if args.repeat > 1 else ""
    print_table(f"{args.workload}, {args.model}: {args.prefill} prefill + {args.decode} decode nodes (colocated: "
                f"{args.prefill + args.decode} decode nodes){where}, "
                f"{num} requests{runs}{suffix}", header, rows)


def add_arguments(p) -> None:
    p.add_argument("--json", default=None)
    p.add_argument("--plots", default=None, help="folder for PNG plots")
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--dtype", default="float32",
                   help="the nodes' dtype (auto: bfloat16 where the CPU computes it natively, half float32's memory)")
    p.add_argument("--workload", default="shared-prefix",
                   choices=["shared-prefix", "multi-turn", "random", "mooncake", "sharegpt", "shifting"],
                   help="shifting: phases of prefill- and decode-heavy mixes, modes auto,2p1d,1p2d "
                        "(kvmesh/bench/shifting.py)")
    p.add_argument("--trace", default=None, help="Mooncake JSONL trace or ShareGPT JSON file")
    p.add_argument("--modes", default="", help="comma-separated subset of kvmesh,local-rr,no-cache,colocated "
                                                "(shifting: auto,2p1d,1p2d by default; 2p1d-held: 2p1d with the "
                                                "balancer running, held by its floors; 2p1d-moved: the same, "
                                                "started as 1p2d and moved before the first phase)")
    p.add_argument("--routing", default="", help="override every mode's routing policy")
    p.add_argument("--quick", action="store_true", help="a small run that finishes in a few minutes")
    p.add_argument("--insecure", action="store_true",
                   help="clusters without a cluster token (no CurveZMQ, no etcd authentication): the baseline "
                        "of what channel security costs")
    p.add_argument("--repeat", type=int, default=None,
                   help="run every mode this many times, modes taking turns; metrics over all requests pooled, "
                        "each run's TTFT p50 reported too (default 1; 3 with --quick)")
    p.add_argument("--prefill", type=int, default=1)
    p.add_argument("--decode", type=int, default=2)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--per-group", type=int, default=8)
    p.add_argument("--conversations", type=int, default=4)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-len", type=int, default=512)
    p.add_argument("--question-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--max-prompt-len", type=int, default=900)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--rate", type=float, default=0.0, help="Poisson arrivals (requests/s) instead of a concurrency")
    p.add_argument("--time-scale", type=float, default=1.0, help="Mooncake trace: multiply timestamps")
    p.add_argument("--slo-ttft-ms", type=float, default=500.0)
    p.add_argument("--slo-tpot-ms", type=float, default=100.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hosts", type=int, default=0,
                   help="run etcd and every node on simulated hosts (network namespaces; needs root)")
    p.add_argument("--link-gbit", default="", help="with --hosts: comma-separated link caps, every mode at each")
    p.add_argument("--kv-placement", default="cost", metavar="cost|threshold:N",
                   help="the decode nodes' placement policy (default cost: the planner decides, as in production; "
                        "threshold:N fetches whenever more than N uncached tokens remain)")
    from kvmesh.bench.shifting import add_arguments as add_shifting_arguments

    add_shifting_arguments(p)


QUICK_REPEAT = 3


def apply_quick(args) -> None:
    if args.repeat is None:
        # A quick run's 30 requests take ~0.2 s on the tiny preset: one run's p50 moves by more than the
        # modes differ. Three runs pooled (each on fresh clusters, so each has its cold misses) steady it.
        args.repeat = QUICK_REPEAT if args.quick else 1
    if args.quick:
        # 5 groups: an odd count, so round-robin does not keep each group on one node by accident.
        args.groups, args.per_group, args.system_len, args.output_len = 5, 6, 768, 8
        args.conversations, args.turns = 3, 3
