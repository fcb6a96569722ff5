"""The ``kvmesh`` command line.

    generate                     offline generation on this machine
    prefill-node / decode-node   one node process of a cluster
    etcd / router                the cluster's shared parts, run alone (one per machine if you like)
    serve / local-cluster        a supervised cluster on this machine (serve adds the gRPC + HTTP front ends)
    launch                       the cluster on Ray (--stop ends it)
    hosts                        simulated hosts on this machine (network namespaces)
    pin                          pin / unpin / list prefixes kept cached on every node
    status                       a live view of a cluster through its router (--once, --json)
    bench ...                    benchmarks: JSON + a readable table
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

from kvmesh.errors import KvmeshError


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate a completion offline on this machine")
    p.add_argument("--model", default="smollm2-135m",
                   help="preset (tiny-llama, tiny-qwen3, smollm2-135m, *-dummy shapes), HF directory or .gguf file")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="dummy: seeded weights of the model's shape made on the device (nothing read but its config)")
    p.add_argument("--prompt", required=True, action="append", help="prompt text (repeat for a batch)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="a stop string (repeatable): the text ends before it")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: bfloat16 on CUDA and on CPUs with AMX or AVX512-BF16, else float32")
    p.add_argument("--device", default="auto", help="auto (the first visible CUDA device, else the CPU), cpu, cuda[:N]")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="split the model over this many ranks (processes; gloo on the CPU, NCCL on CUDA): it must "
                        "divide the attention heads, the MLP and the vocabulary")
    p.add_argument("--verbose", action="store_true", help="print load time and token ids")
    p.set_defaults(func=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    from kvmesh.engine.llm import LLM
    from kvmesh.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=tuple(args.stop), ignore_eos=args.ignore_eos)
    llm = LLM(model=args.model, dtype=args.dtype, device=args.device, progress=sys.stderr.isatty(),
              load_format=args.load_format, tensor_parallel_size=args.tensor_parallel_size)
    try:
        return _generate_with(llm, args, params)
    finally:
        llm.close()


def _generate_with(llm, args: argparse.Namespace, params) -> int:
    from kvmesh.errors import InvalidRequestError

    context = llm.engine.max_model_len
    for prompt in args.prompt:  # as the HTTP API: a request that cannot fit its max_tokens is refused
        num_tokens = len(llm.tokenizer.encode(prompt))
        if num_tokens + args.max_tokens > context:
            raise InvalidRequestError(f"prompt ({num_tokens} tokens) + --max-tokens ({args.max_tokens}) exceeds "
                                      f"the context of {context}")
    start = time.perf_counter()
    outputs = llm.generate(args.prompt, params, use_tqdm=sys.stderr.isatty())
    elapsed = time.perf_counter() - start
    for prompt, out in zip(args.prompt, outputs):
        print(prompt + out.text)
        if args.verbose:
            print(f"  token_ids={out.token_ids} finish_reason={out.outputs[0].finish_reason}", file=sys.stderr)
    if args.verbose:
        num_tokens = sum(len(o.token_ids) for o in outputs)
        print(f"model loaded in {llm.loaded.load_seconds:.2f} s; {num_tokens} tokens in {elapsed:.2f} s; "
              f"fingerprint {llm.loaded.fingerprint}", file=sys.stderr)
    return 0


def _add_bench(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks (JSON + table)")
    which = p.add_subparsers(dest="bench", required=True)
    pc = which.add_parser("prefix-cache", help="hashing, match, insert, evict, memory; engine hit rates")
    pc.add_argument("--json", default=None, help="write the results here")
    pc.add_argument("--repeat", type=int, default=21, help="rounds per measurement: their median is reported")
    pc.add_argument("--no-engine", action="store_true", help="skip the engine workload")
    pc.set_defaults(func=_run_bench_prefix_cache)
    m = which.add_parser("model", help="prefill latency and batched decode throughput vs transformers")
    m.add_argument("--model", default="smollm2-135m")
    m.add_argument("--json", default=None)
    m.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="dummy: seeded weights of the model's shape (the *-dummy presets always are)")
    m.add_argument("--batches", default="16", help="comma-separated decode batch sizes (--batch: one)")
    m.add_argument("--batch", type=int, default=None, help=argparse.SUPPRESS)
    m.add_argument("--context", type=int, default=32, help="prompt tokens of each decoding sequence")
    m.add_argument("--decode-tokens", type=int, default=64)
    m.add_argument("--repeat", type=int, default=3)
    m.add_argument("--static", action=argparse.BooleanOptionalAction, default=None,
                   help="also transformers with a static cache (compiled forward; default: on CUDA only)")
    m.add_argument("--prefill-lens", default="512,2048", help="comma-separated prompt lengths")
    m.add_argument("--dtype", default="auto", help="both implementations run in this dtype (auto: see generate)")
    m.add_argument("--device", default="cpu", help="both run here: cpu, cuda or cuda:N (auto: CUDA when visible)")
    m.add_argument("--tp", type=int, default=1,
                   help="N > 1: the model at tensor-parallel size 1 against size N instead (first batch size, first "
                        "prefill length; the share of a step spent in collectives)")
    m.set_defaults(func=_run_bench_model)
    t = which.add_parser("transfer", help="KV pushes between two processes vs memcpy and TCP ceilings")
    t.add_argument("--json", default=None)
    t.add_argument("--backends", default="",
                   help="comma-separated: mooncake, zmq, shared-memory (default: mooncake if it loads, zmq and "
                        "shared-memory)")
    t.add_argument("--repeat", type=int, default=3)
    t.add_argument("--insecure", action="store_true",
                   help="no cluster token (no CurveZMQ): the baseline of what channel security costs")
    t.add_argument("--landing-chunk-mib", type=float, default=-1,
                   help="pushes into landing slots in chunks of this many MiB, each copied and checked while the "
                        "next is on the wire (0: one write; default: what a node would choose on this machine)")
    t.set_defaults(func=_run_bench_transfer)
    md = which.add_parser("metadata", help="global block index on etcd: publish, lookup, visibility, memory")
    md.add_argument("--json", default=None)
    md.add_argument("--etcd", default=None, help="host:port of an etcd to use (default: start a private one)")
    md.set_defaults(func=_run_bench_metadata)
    ix = which.add_parser("index", help="the global block index at fleet scale: etcd memory and database per "
                                        "cached block, publish and churn rates, lookups, catch-up, dead nodes")
    ix.add_argument("--json", default=None)
    ix.add_argument("--nodes", type=int, default=256, help="publishers (simulated nodes, each on its own lease)")
    ix.add_argument("--blocks", default="1000000,3000000,10000000",
                    help="comma-separated fleet sizes: cached (block, holder) pairs in all")
    ix.add_argument("--baseline-blocks", default="100000,300000",
                    help="comma-separated sizes for the one-key-per-block baseline ('' for none)")
    ix.add_argument("--mirrors", type=int, default=2, help="mirror processes following the index")
    ix.add_argument("--churn", type=float, default=0.25, help="share of each node's chains replaced after the fill")
    ix.add_argument("--lookups", type=int, default=1000, help="lookups of 2,048-block chains timed")
    ix.add_argument("--lease-ttl", type=int, default=5, help="the lease of the publisher that dies (seconds)")
    ix.add_argument("--extrapolate-to", type=int, default=100_000_000,
                    help="per-block costs fitted to this many blocks past the largest size measured")
    ix.set_defaults(func=_run_bench_index)
    ru = which.add_parser("reuse", help="TTFT with the prefix on another node vs a full recompute (local cluster)")
    ru.add_argument("--json", default=None)
    ru.add_argument("--model", default="smollm2-135m")
    ru.add_argument("--prompt-tokens", type=int, default=2048)
    ru.add_argument("--suffix-tokens", type=int, default=32)
    ru.add_argument("--rounds", type=int, default=3)
    ru.add_argument("--dtype", default="float32", help="the nodes' dtype (auto: bfloat16 where the CPU has it)")
    ru.add_argument("--holder-tp", type=int, default=1,
                    help="the prefill node and decode-0 (every holder) at this tensor-parallel size, the fetching "
                         "decode node at 1: reuse across sizes")
    ru.add_argument("--paths", default="shared-memory,engine",
                    help="transfer paths to measure, each on its own cluster: shared-memory (same-host copies), "
                         "engine (every push through the transfer engine, as between hosts); the first is the "
                         "headline ratio")
    ru.set_defaults(func=_run_bench_reuse)
    sp = which.add_parser("spec", help="decode tokens/s with and without speculative decoding (copy, chat)")
    sp.add_argument("--json", default=None)
    sp.add_argument("--model", default="smollm2-135m")
    sp.add_argument("--method", default="ngram", choices=["ngram", "self-draft"])
    sp.add_argument("--num-speculative-tokens", type=int, default=4)
    sp.add_argument("--max-tokens", type=int, default=96)
    sp.add_argument("--dtype", default="float32", help="float32: greedy output stays bitwise identical")
    sp.set_defaults(func=_run_bench_spec)
    rt = which.add_parser("routing", help="cache-aware vs round-robin vs random routing, shared-prefix workload")
    rt.add_argument("--json", default=None)
    rt.add_argument("--model", default="tiny-llama")
    rt.add_argument("--groups", type=int, default=6)
    rt.add_argument("--per-group", type=int, default=6)
    rt.add_argument("--system-len", type=int, default=256)
    rt.add_argument("--decode", type=int, default=3, help="decode nodes")
    rt.set_defaults(func=_run_bench_routing)
    kn = which.add_parser("kernels", help="Triton attention on a CUDA device: decode KV bandwidth vs the device, "
                                          "prefill vs torch SDPA")
    kn.add_argument("--json", default=None)
    kn.add_argument("--quick", action="store_true")
    kn.set_defaults(func=_run_bench_kernels)
    ch = which.add_parser("chaos", help="faults during serving: stalls, kills, aborts, forged and flooding "
                                        "requests; counts lost, corrupted, leaked, forged-accepted")
    ch.add_argument("--json", default=None)
    ch.add_argument("--requests", type=int, default=240, help="requests per backend")
    ch.add_argument("--backend", action="append", choices=["mooncake", "zmq"], help="default: both (when available)")
    ch.add_argument("--hosts", action="store_true",
                    help="nodes on simulated hosts (network namespaces; root) with slow and flapping links")
    ch.set_defaults(func=_run_bench_chaos)
    at = which.add_parser("attack", help="each attack of docs/security.md against a real cluster: attempts, "
                                         "successes (must be 0), whether other clients were still answered")
    at.add_argument("--json", default=None)
    at.set_defaults(func=_run_bench_attack)
    from kvmesh.bench.cluster_bench import add_arguments as add_cluster_arguments

    cl = which.add_parser("cluster", help="the serving modes compared on one workload (TTFT, TPOT, hit rates, ...)")
    add_cluster_arguments(cl)
    cl.set_defaults(func=_run_bench_cluster)
    tr = which.add_parser("traces", help="what request tracing costs: tracing off against on at sample ratios, "
                                         "same run (TTFT, TPOT, requests/s, spans received)")
    tr.add_argument("--json", default=None)
    tr.add_argument("--model", default="tiny-llama")
    tr.add_argument("--ratios", default="0.01,1", help="sample ratios to run beside tracing off")
    tr.add_argument("--repeat", type=int, default=3)
    tr.add_argument("--dtype", default="float32")
    tr.set_defaults(func=_run_bench_traces)
    st = which.add_parser("step", help="host time of one decode step by phase (schedule, prepare, forward, sample, "
                                       "outputs) and torch ops per layer; no GPU needed")
    st.add_argument("--json", default=None)
    st.add_argument("--model", default="tiny-llama")
    st.add_argument("--batches", default="32,128")
    st.add_argument("--steps", type=int, default=50)
    st.set_defaults(func=_run_bench_step)
    rs = which.add_parser("router-stream", help="the router's CPU per streamed token (detokenizing, stop strings) "
                                                "against the output's length")
    rs.add_argument("--json", default=None)
    rs.add_argument("--model", default="smollm2-135m")
    rs.add_argument("--lengths", default="1024,8192")
    rs.add_argument("--repeat", type=int, default=3)
    rs.set_defaults(func=_run_bench_router_stream)
    from kvmesh.bench.late_writes import add_arguments as add_late_writes_arguments

    lw = which.add_parser("late-writes", help="pushes given up on slow links between simulated hosts: later "
                                             "answers against the single-node engine (root, ip netns)")
    add_late_writes_arguments(lw)
    lw.set_defaults(func=_run_bench_late_writes)
    from kvmesh.bench.tiers import add_arguments as add_tiers_arguments

    ti = which.add_parser("tiers", help="multi-turn sessions overflowing the KV buffers: tier 0 alone vs host and "
                                        "disk tiers (hit rates, TTFT, bytes demoted / promoted)")
    add_tiers_arguments(ti)
    ti.set_defaults(func=_run_bench_tiers)
    from kvmesh.bench.serve_bench import add_arguments as add_serve_bench_arguments

    sv = which.add_parser("serve", help="OpenAI endpoints side by side under one streaming client: kvmesh serve, "
                                        "llama.cpp's server, running URLs (TTFT, ITL, TPOT, tokens/s)")
    add_serve_bench_arguments(sv)
    sv.set_defaults(func=_run_bench_serve)


def _run_bench_serve(args: argparse.Namespace) -> int:
    from kvmesh.bench import serve_bench

    serve_bench.run(args)
    return 0


def _run_bench_kernels(args: argparse.Namespace) -> int:
    from kvmesh.bench import kernels

    kernels.run(args.json, quick=args.quick)
    return 0


def _run_bench_chaos(args: argparse.Namespace) -> int:
    from kvmesh.bench import chaos

    out = chaos.run(args.json, args.backend, args.requests, hosts=args.hosts)
    bad = [b for b, r in out["backends"].items()
           if r["lost"] or r["corrupted"] or r["leaked_blocks"] or r["forged_accepted"]]
    return 1 if bad else 0


def _run_bench_attack(args: argparse.Namespace) -> int:
    from kvmesh.bench import attack

    out = attack.run(args.json)
    return 1 if any(r["succeeded"] or not r["service_answered"] for r in out["attacks"].values()) else 0


def _run_bench_traces(args: argparse.Namespace) -> int:
    from kvmesh.bench import traces

    ratios = tuple(float(r) for r in args.ratios.split(",") if r.strip())
    if not ratios or any(not 0 < r <= 1 for r in ratios) or args.repeat < 1:
        raise SystemExit("kvmesh bench traces: --ratios takes ratios within (0, 1]; --repeat at least 1")
    traces.run(args.json, args.model, ratios, args.repeat, args.dtype)
    return 0


def _run_bench_step(args: argparse.Namespace) -> int:
    from kvmesh.bench import step

    step.run(args.json, args.model, tuple(int(b) for b in args.batches.split(",") if b), args.steps)
    return 0


def _run_bench_router_stream(args: argparse.Namespace) -> int:
    from kvmesh.bench import router_stream

    router_stream.run(args.model, [int(n) for n in args.lengths.split(",") if n], args.repeat, args.json)
    return 0


def _run_bench_late_writes(args: argparse.Namespace) -> int:
    from kvmesh.bench import late_writes

    return late_writes.main(args)


def _run_bench_tiers(args: argparse.Namespace) -> int:
    from kvmesh.bench import tiers

    tiers.apply_quick(args)
    tiers.run(args)
    return 0


def _run_bench_cluster(args: argparse.Namespace) -> int:
    from kvmesh.bench import cluster_bench

    if args.workload == "shifting":
        from kvmesh.bench import shifting

        shifting.run(args)
        return 0
    cluster_bench.apply_quick(args)
    cluster_bench.run(args)
    return 0


def _run_bench_routing(args: argparse.Namespace) -> int:
    from kvmesh.bench import routing

    routing.run(args.json, args.model, args.groups, args.per_group, args.system_len, num_decode=args.decode)
    return 0


def _run_bench_spec(args: argparse.Namespace) -> int:
    from kvmesh.bench import spec

    spec.run(args.json, args.model, args.method, args.max_tokens, args.num_speculative_tokens, args.dtype)
    return 0


def _run_bench_reuse(args: argparse.Namespace) -> int:
    from kvmesh.bench import reuse

    try:
        reuse.run(args.json, args.model, args.prompt_tokens, args.suffix_tokens, args.rounds,
                  paths=tuple(p.strip() for p in args.paths.split(",") if p.strip()), dtype=args.dtype,
                  holder_tp=args.holder_tp)
    except ValueError as e:
        raise SystemExit(f"kvmesh bench reuse: {e}") from None
    return 0


def _run_bench_metadata(args: argparse.Namespace) -> int:
    from kvmesh.bench import metadata

    metadata.run(args.json, args.etcd)
    return 0


def _run_bench_index(args: argparse.Namespace) -> int:
    from kvmesh.bench import index

    def sizes(text: str) -> list[int]:
        return [int(float(x)) for x in text.split(",") if x.strip()]

    blocks = sizes(args.blocks)
    if not blocks or args.nodes < 1 or args.mirrors < 1 or args.lookups < 1:
        raise SystemExit("kvmesh bench index: --blocks needs a size; --nodes, --mirrors and --lookups at least 1")
    index.run(args.json, args.nodes, blocks, sizes(args.baseline_blocks), num_mirrors=args.mirrors,
              churn=args.churn, num_lookups=args.lookups, lease_ttl_s=args.lease_ttl,
              extrapolate_to=args.extrapolate_to)
    return 0


def _run_bench_transfer(args: argparse.Namespace) -> int:
    from kvmesh.bench import transfer

    transfer.run(args.json, [b for b in args.backends.split(",") if b] or None, repeat=args.repeat,
                 insecure=args.insecure,
                 landing_chunk_bytes=-1 if args.landing_chunk_mib < 0 else int(args.landing_chunk_mib * 2**20))
    return 0


def _run_bench_model(args: argparse.Namespace) -> int:
    from kvmesh.bench import model

    lens = tuple(int(x) for x in args.prefill_lens.split(",") if x)
    batches = (args.batch,) if args.batch else tuple(int(x) for x in args.batches.split(",") if x)
    if args.tp > 1:
        from kvmesh.bench import tensor_parallel

        tensor_parallel.run(args.model, args.tp, args.json, batch=batches[0], context=args.context,
                            decode_tokens=args.decode_tokens, prefill_len=lens[0] if lens else 512, repeat=args.repeat,
                            dtype=args.dtype, device=args.device,
                            load_format=args.load_format)
        return 0
    model.run(args.model, args.json, prefill_lens=lens, batches=batches, context=args.context,
              decode_tokens=args.decode_tokens, repeat=args.repeat, dtype=args.dtype, device=args.device,
              load_format=args.load_format, static=args.static)
    return 0


def _run_bench_prefix_cache(args: argparse.Namespace) -> int:
    from kvmesh.bench import prefix_cache

    prefix_cache.run(args.json, repeat=args.repeat, with_engine=not args.no_engine)
    return 0


def _add_nodes(sub) -> None:
    from kvmesh.cluster.node_main import add_node_arguments, run_node

    for role in ("prefill", "decode"):
        p = sub.add_parser(f"{role}-node", help=f"run a {role} node (until stdin closes)")
        add_node_arguments(p)
        p.set_defaults(func=lambda args, role=role: run_node(role, args))


def _add_local_cluster(sub) -> None:
    p = sub.add_parser("local-cluster", help="etcd + prefill and decode nodes on this machine, until Ctrl-C")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--prefill", type=int, default=1)
    p.add_argument("--decode", type=int, default=1)
    p.add_argument("--etcd", default=None, help="use this etcd instead of starting one")
    p.add_argument("--max-restarts", type=int, default=5, help="restarts of one dead process per minute")
    from kvmesh.cluster.serve import add_node_share_arguments
    from kvmesh.tracing import add_tracing_arguments

    add_node_share_arguments(p)
    add_tracing_arguments(p)
    p.set_defaults(func=_run_local_cluster)


def _run_local_cluster(args: argparse.Namespace) -> int:
    import json as _json
    import shutil
    import tempfile

    from kvmesh.auth import token_from_env
    from kvmesh.cluster.local_launcher import LocalCluster
    from kvmesh.cluster.serve import node_share_args, role_args
    from kvmesh.cluster.supervisor import Supervisor
    from kvmesh.lifecycle import stop_on_sigterm

    stop_on_sigterm()
    token_dir = ""
    print(f"starting etcd, {args.prefill} prefill and {args.decode} decode node(s) of {args.model} ...",
          file=sys.stderr)
    try:
        with LocalCluster(args.prefill, args.decode, model=args.model, etcd=args.etcd, start_timeout_s=600,
                          dtype=args.dtype, threads_per_node=args.threads, fork_nodes=not args.no_fork_nodes,
                          node_args=node_share_args(args), role_args=role_args(args)) as cluster, \
                Supervisor(cluster, max_restarts=args.max_restarts):
            generated = not token_from_env()
            if generated:  # a secret never goes to stdout (logs): a file only this user can read, removed at exit
                token_dir = tempfile.mkdtemp(prefix="kvmesh-local-")
                token_file = os.path.join(token_dir, "cluster-token")
                with open(os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
                    f.write(cluster.token)
            print(_json.dumps({"etcd": cluster.etcd_endpoint, "nodes": {n: p.info for n, p in cluster.nodes.items()},
                               **({"cluster_token_file": token_file} if generated else {})}, indent=2))
            print("serving; send GenerateRequests to a decode node's 'requests' endpoint "
                  "(kvmesh.cluster.client.NodeClient with ClusterAuth(token)"
                  + (", the token in cluster_token_file above: set $KVMESH_CLUSTER_TOKEN to choose your own"
                     if generated else "")
                  + "). Dead nodes are restarted. Ctrl-C stops everything.", file=sys.stderr)
            while True:
                time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        if token_dir:
            shutil.rmtree(token_dir, ignore_errors=True)
    return 0


def _add_status(sub) -> None:
    from kvmesh.cluster.status_cli import add_status_arguments, run_status

    p = sub.add_parser("status", help="a live view of a cluster through its router (nodes, load, KV, sources)")
    add_status_arguments(p)
    p.set_defaults(func=run_status)


def _add_pin(sub) -> None:
    from kvmesh.cluster.pin_cli import add_pin_arguments, run_pin

    p = sub.add_parser("pin", help="pin a prefix on every node (or --unpin ID, --list) through a router")
    add_pin_arguments(p)
    p.set_defaults(func=run_pin)


def _add_serve(sub) -> None:
    from kvmesh.cluster.serve import add_launch_arguments, add_serve_arguments, run_launch, run_serve

    p = sub.add_parser("serve", help="a cluster on this machine behind gRPC and OpenAI HTTP endpoints")
    add_serve_arguments(p)
    p.set_defaults(func=run_serve)
    launch = sub.add_parser("launch", help="the same cluster on a Ray cluster (kvmesh launch --stop ends it)")
    add_launch_arguments(launch)
    launch.set_defaults(func=run_launch)


def _add_parts(sub) -> None:
    from kvmesh.cluster.parts import add_etcd_arguments, add_router_arguments, run_etcd, run_router

    p = sub.add_parser("etcd", help="run the embedded etcd alone, in the foreground (one host of a cluster)")
    add_etcd_arguments(p)
    p.set_defaults(func=run_etcd)
    p = sub.add_parser("router", help="run the router (gRPC + OpenAI HTTP) against an existing cluster")
    add_router_arguments(p)
    p.set_defaults(func=run_router)


def _add_hosts(sub) -> None:
    from kvmesh.cluster.hosts import add_hosts_arguments

    add_hosts_arguments(sub.add_parser("hosts", help="simulated hosts on this machine (network namespaces)"))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvmesh", description="kvmesh: disaggregated LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_bench(sub)
    _add_nodes(sub)
    _add_local_cluster(sub)
    _add_serve(sub)
    _add_pin(sub)
    _add_status(sub)
    _add_parts(sub)
    _add_hosts(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KvmeshError as e:
        if os.environ.get("KVMESH_TRACEBACK"):  # the whole chain, the device error that caused it included
            traceback.print_exc()
        print(f"kvmesh: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
