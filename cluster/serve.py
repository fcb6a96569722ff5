"""``kvmesh serve`` and ``kvmesh launch``: a cluster behind the gRPC and OpenAI HTTP endpoints.

``serve``: on this machine, with embedded defaults (a private etcd, 1 prefill + 1
decode node of SmolLM2-135M, gRPC on 50051, HTTP on 8000). ``launch``: the same on
a Ray cluster (etcd and node actors, restarted by Ray when they die; ``--stop``).
Both print where to connect; Ctrl-C stops the front ends.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import faulthandler
import json
import signal
import sys

from kvmesh import lifecycle
from kvmesh.auth import add_secret_arguments, generate_token, is_loopback, secret_from_args
from kvmesh.cluster.api_keys import api_keys_from_args
from kvmesh.cluster.local_launcher import LocalCluster
from kvmesh.cluster.parts import exit_now
from kvmesh.cluster.router import Router, RouterConfig
from kvmesh.errors import KvmeshError
from kvmesh.metadata.keys import DEFAULT_CLUSTER
from kvmesh.cluster.node_main import add_scheduling_arguments, host_kv_gib, scheduling_argument_error
from kvmesh.node.placement import make_placement
from kvmesh.tracing import add_tracing_arguments


MODEL_HELP = "preset (tiny-llama, tiny-qwen3, smollm2-135m, *-dummy shapes), HF directory or .gguf file"


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m", help=MODEL_HELP + " (default: %(default)s)")
    p.add_argument("--prefill", type=int, default=1, help="prefill nodes (default: %(default)s)")
    p.add_argument("--decode", type=int, default=1, help="decode nodes (default: %(default)s)")
    p.add_argument("--etcd", default=None, help="host:port of an etcd (default: start a private one)")
    p.add_argument("--cluster", default=DEFAULT_CLUSTER)
    p.add_argument("--max-restarts", type=int, default=5,
                   help="restarts of one dead process per minute before it is left down (0: never restart)")
    add_node_share_arguments(p)
    add_front_end_arguments(p)


def add_node_share_arguments(p: argparse.ArgumentParser) -> None:
    """--dtype, --device, --threads and the other per-node options of the nodes a command starts here."""
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="the nodes' model dtype (auto: bfloat16 on CUDA and on CPUs with AMX or AVX512-BF16, "
                        "else float32)")
    p.add_argument("--device", default="auto",
                   help="the nodes' device: auto (the first visible CUDA device, else the CPU), cpu, cuda or "
                        "cuda:N; every node of this machine shares it")
    p.add_argument("--threads", type=int, default=0,
                   help="compute threads per node (0: this machine's cores split evenly among the nodes)")
    p.add_argument("--no-fork-nodes", action="store_true",
                   help="start every node as a fresh process (default: fork each from one process that imported "
                        "the model stack once, so start-ups and restarts skip that import)")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="auto: the model's weights; dummy: seeded weights of its shape drawn on the device at start-up, nothing "
                        "read but the config (speed at real sizes; the *-dummy presets always load this way)")
    p.add_argument("--speculative", default="off", choices=["off", "ngram", "self-draft"],
                   help="speculative decoding on the decode nodes (prompt lookup, or the model's first layers)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="on a CUDA device: no CUDA graphs of decode or prompt steps (captured at start-up otherwise)")
    p.add_argument("--host-kv-gib", type=host_kv_gib, default="auto",
                   help="per node: host memory below the KV buffer for evicted blocks (docs/tiers.md; auto: two "
                        "KV buffers' worth, at most 5%% of this machine's memory; 0: none)")
    p.add_argument("--disk-kv-gib", type=float, default=0.0, help="per node: a local-disk tier below that (0: none)")
    p.add_argument("--disk-kv-path", default="",
                   help="folder of the nodes' disk-tier files (one per node id, re-adopted by a restart; default: "
                        "temporary folders removed at exit)")
    add_tensor_parallel_arguments(p)
    add_scheduling_arguments(p)


def add_tensor_parallel_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="split each node's model over N processes (the CPU; nodes of any sizes share KV)")
    for role in ("prefill", "decode"):
        p.add_argument(f"--{role}-tensor-parallel-size", type=int, default=0,
                       help=f"the {role} nodes' size instead (0: --tensor-parallel-size)")


def tensor_parallel_sizes(args: argparse.Namespace) -> dict[str, int]:
    """Role -> its nodes' tensor-parallel size (KvmeshError for a size below 1)."""
    sizes = {role: getattr(args, f"{role}_tensor_parallel_size") or args.tensor_parallel_size
             for role in ("prefill", "decode")}
    if min(sizes.values()) < 1:
        raise KvmeshError(f"tensor-parallel sizes must be 1 or more, got {sizes}")
    return sizes


def role_args(args: argparse.Namespace) -> dict[str, list[str]]:
    """Role -> the node arguments only that role's nodes get (their tensor-parallel size)."""
    return {role: ["--tensor-parallel-size", str(size)] for role, size in tensor_parallel_sizes(args).items()}


def node_share_args(args: argparse.Namespace) -> list[str]:
    """The node arguments ``add_node_share_arguments`` adds beyond dtype, threads and how nodes start."""
    out = ["--device", args.device, "--load-format", args.load_format, "--speculative", args.speculative,
           "--host-kv-gib", args.host_kv_gib, "--disk-kv-gib", repr(args.disk_kv_gib),
           "--kv-placement", args.kv_placement,
           "--long-prefill-token-threshold", str(args.long_prefill_token_threshold),
           "--prompt-slice-ms", repr(args.prompt_slice_ms)]
    if getattr(args, "otlp_endpoint", ""):  # the front ends' collector: the nodes' spans join the router's traces
        out += ["--otlp-endpoint", args.otlp_endpoint, "--trace-sample-ratio", repr(args.trace_sample_ratio)]
    return out + (["--disk-kv-path", args.disk_kv_path] if args.disk_kv_path else []) + \
        (["--enforce-eager"] if args.enforce_eager else []) + \
        (["--role-changes"] if getattr(args, "roles", "fixed") == "auto" else [])


def add_front_end_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1",
                   help="address the front ends listen on (0.0.0.0: every interface; default: %(default)s)")
    p.add_argument("--grpc-port", type=int, default=50051, help="gRPC port (0: any free one; default: %(default)s)")
    p.add_argument("--http-port", type=int, default=8000,
                   help="OpenAI HTTP port (0: any free one; default: %(default)s)")
    p.add_argument("--routing", default="cache-aware", choices=["cache-aware", "round-robin", "random"],
                   help="how the router picks a decode node (default: %(default)s)")
    p.add_argument("--max-in-flight", type=int, default=256,
                   help="requests served at once; past it HTTP 429 / RESOURCE_EXHAUSTED (default: %(default)s)")
    p.add_argument("--api-key-file", default=None,
                   help="file holding the bearer token every route but /health and /ready requires (gRPC and "
                        "HTTP; default: $KVMESH_API_KEY, else none)")
    p.add_argument("--api-key", default=None, help=argparse.SUPPRESS)  # visible in argv: the file or variable
    p.add_argument("--tls-cert", default=None, help="PEM certificate: serve gRPC and HTTP over TLS")
    p.add_argument("--tls-key", default=None, help="PEM private key for --tls-cert")
    add_secret_arguments(p, generated=True)
    add_tracing_arguments(p)
    add_role_arguments(p)


def add_role_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("roles that follow the load")
    g.add_argument("--roles", default="fixed", choices=["fixed", "auto"],
                   help="auto: the router moves nodes between prefill and decode, one at a time, as prompt queues "
                        "and decode steps measure against the SLOs below (default: %(default)s)")
    g.add_argument("--min-prefill", type=int, default=0, help="--roles auto keeps at least this many prefill nodes")
    g.add_argument("--min-decode", type=int, default=1, help="... and this many decode nodes")
    g.add_argument("--ttft-slo-ms", type=float, default=2000.0,
                   help="--roles auto: the first-token SLO prompt queues are weighed against (default: %(default)s)")
    g.add_argument("--tpot-slo-ms", type=float, default=100.0,
                   help="--roles auto: the per-token SLO decode steps are weighed against (default: %(default)s)")


def role_config(args: argparse.Namespace) -> dict:
    """The router's role-balancing settings from ``add_role_arguments``' flags (KvmeshError for bad bounds)."""
    if args.min_decode < 1 or args.min_prefill < 0:
        raise KvmeshError("--min-decode must be 1 or more and --min-prefill 0 or more")
    return {"roles": args.roles, "min_prefill": args.min_prefill, "min_decode": args.min_decode,
            "ttft_slo_ms": args.ttft_slo_ms, "tpot_slo_ms": args.tpot_slo_ms}


def check_front_end_ports(args: argparse.Namespace) -> None:
    """KvmeshError naming the port when a front end's port is taken: said before anything starts."""
    from kvmesh.netaddr import port_taken

    for what, port in (("--grpc-port", args.grpc_port), ("--http-port", args.http_port)):
        if (reason := port_taken(args.host, port)) is not None:
            raise KvmeshError(f"{what}: {reason}; stop what listens there or choose another port (0: any free one)")


def run_front_ends(args: argparse.Namespace, etcd: str, cluster: str, cluster_token: str, supervision=None,
                   supply=None) -> None:
    """Router + gRPC + HTTP until Ctrl-C or SIGTERM; ``supervision()``: process states for /ready and /metrics;
    ``supply``: where the router gets nodes from and gives them back to (``--max-nodes`` on Ray)."""
    from kvmesh.cluster.grpc_server import start_grpc_server
    from kvmesh.cluster.http_server import start_http_server
    from kvmesh.gc_pauses import freeze_start_up

    router = Router(RouterConfig(etcd=etcd, model=args.model, cluster=cluster, routing=args.routing,
                                 max_in_flight=args.max_in_flight, cluster_token=cluster_token,
                                 otlp_endpoint=args.otlp_endpoint, trace_sample_ratio=args.trace_sample_ratio,
                                 max_nodes=getattr(args, "max_nodes", 0), **role_config(args)), supply=supply)
    router.supervision = supervision
    tls_files = (args.tls_cert, args.tls_key) if args.tls_cert else None
    tls_pem = tuple(open(f, "rb").read() for f in (args.tls_key, args.tls_cert)) if tls_files else None
    keys = api_keys_from_args(args)
    if not keys.enabled and not is_loopback(args.host):
        print(f"kvmesh: the front ends on {args.host} take requests from anyone who reaches them (no "
              f"--api-key-file / $KVMESH_API_KEY)", file=sys.stderr)
    grpc_server, grpc_port = start_grpc_server(router, f"{args.host}:{args.grpc_port}", token=keys,
                                               tls=tls_pem)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        with _signals_set(loop, stop):
            runner, http_port = await start_http_server(router, args.host, args.http_port, token=keys,
                                                        tls=tls_files)
            freeze_start_up()  # the router's imports and tokenizer: never garbage, out of every full collection
            scheme = "https" if tls_files else "http"
            print(json.dumps({"grpc": f"{args.host}:{grpc_port}", "http": f"{scheme}://{args.host}:{http_port}/v1",
                              "model": args.model, "etcd": etcd}), flush=True)
            print(f"ready: OpenAI base_url {scheme}://{args.host}:{http_port}/v1, gRPC {args.host}:{grpc_port} "
                  "(kvmesh.v1.Router; reflection and health on). Ctrl-C stops.", file=sys.stderr)
            try:  # dead nodes are the supervisor's business: the front ends serve until a signal
                await stop.wait()
            finally:
                faulthandler.dump_traceback_later(STOP_BOUND_S, exit=True)
                await runner.cleanup()

    try:
        asyncio.run(main())
    except KeyboardInterrupt:  # during start-up, before the loop took the signals
        faulthandler.dump_traceback_later(STOP_BOUND_S, exit=True)
    finally:
        grpc_server.stop(grace=2)
        router.close()
        faulthandler.cancel_dump_traceback_later()


# How long the front ends may take to stop once signalled; past it, every thread's stack goes to stderr and the
# process exits with status 1 rather than hang (what its supervisor or the test that stops it sees).
STOP_BOUND_S = 30.0


@contextlib.contextmanager
def _signals_set(loop: asyncio.AbstractEventLoop, stop: asyncio.Event):
    """SIGINT and SIGTERM set ``stop`` (and ``lifecycle.stopping``) instead of raising KeyboardInterrupt.

    An exception raised by a signal lands wherever the main thread happens to be, inside the event loop's
    own code or a lock it holds, and the loop's teardown can then wait forever; a handler that only sets an
    event leaves the loop intact. The previous handlers come back on leaving (a later signal is ignored by
    them: ``stopping`` is set)."""
    def handle(signum, frame) -> None:
        if not lifecycle.stopping.is_set():
            lifecycle.stopping.set()
            loop.call_soon_threadsafe(stop.set)

    previous = {sig: signal.signal(sig, handle) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_serve(args: argparse.Namespace) -> int:
    from kvmesh.lifecycle import stop_on_sigterm
    from kvmesh.cluster.supervisor import Supervisor

    stop_on_sigterm()
    try:
        make_placement(args.kv_placement)  # bad settings are refused here, not by each node as it starts
    except ValueError as e:
        raise KvmeshError(f"--kv-placement: {e}") from None
    if (error := scheduling_argument_error(args)) is not None:
        raise KvmeshError(error)
    check_front_end_ports(args)
    print(f"starting etcd, {args.prefill} prefill + {args.decode} decode node(s) of {args.model} ...", file=sys.stderr)
    try:
        with LocalCluster(args.prefill, args.decode, model=args.model, etcd=args.etcd, cluster=args.cluster,
                          start_timeout_s=600, dtype=args.dtype, threads_per_node=args.threads,
                          node_args=node_share_args(args), role_args=role_args(args),
                          fork_nodes=not args.no_fork_nodes, cluster_token=secret_from_args(args) or None) as cluster, \
                Supervisor(cluster, max_restarts=args.max_restarts) as supervisor:
            run_front_ends(args, cluster.etcd_endpoint, args.cluster, cluster.token, supervisor.status)
    except KeyboardInterrupt:  # during start-up
        pass
    exit_now(0)  # every process and temp dir of ours is gone by now (the with-blocks closed them)


def add_launch_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default="auto", help="Ray cluster address for ray.init (head:6379 or auto)")
    p.add_argument("--cluster", default=DEFAULT_CLUSTER)
    p.add_argument("--etcd", default=None, help="host:port of an existing etcd (default: an etcd actor)")
    p.add_argument("--placement", action="append", default=[], metavar="ROLE=RESOURCE",
                   help="put ROLE's (prefill/decode) actors on the Ray nodes started with --resources "
                        "'{\"RESOURCE\": 1}' (default: spread over every node)")
    p.add_argument("--stop", action="store_true", help="kill the kvmesh actors of that Ray cluster")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--prefill", type=int, default=1)
    p.add_argument("--decode", type=int, default=1)
    p.add_argument("--gpus-per-node", type=float, default=0,
                   help="GPUs Ray reserves for each node actor, per tensor-parallel rank (the actor computes on "
                        "the one Ray assigns)")
    p.add_argument("--cpus-per-node", type=float, default=1, help="CPUs Ray reserves for each node actor, per rank")
    p.add_argument("--device", default="auto",
                   help="the node actors' device: auto (the GPU Ray assigned, else the CPU), cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="the node actors' model dtype (auto: bfloat16 on CUDA and on CPUs with AMX or AVX512-BF16)")
    p.add_argument("--max-nodes", type=int, default=0,
                   help="with --roles auto: add node actors up to this many while a role is short of capacity and "
                        "the Ray cluster has room, and remove idle ones (decode nodes drained first) down to "
                        "--min-prefill + --min-decode (default 0: the nodes launched, no more, no fewer)")
    add_tensor_parallel_arguments(p)
    add_front_end_arguments(p)


def run_launch(args: argparse.Namespace) -> int:
    from kvmesh.cluster.ray_launcher import RayCluster, join_ray, stop_cluster

    if not args.stop:
        if args.max_nodes and (args.roles != "auto" or args.max_nodes < args.prefill + args.decode):
            raise KvmeshError(f"--max-nodes {args.max_nodes} needs --roles auto and at least the nodes launched "
                              f"({args.prefill + args.decode})")
        check_front_end_ports(args)
    join_ray(args.address)
    if args.stop:
        print(f"stopped: {', '.join(stop_cluster()) or 'nothing to stop'}", file=sys.stderr)
        return 0
    print(f"starting etcd, {args.prefill} prefill + {args.decode} decode actor(s) of {args.model} on Ray ...",
          file=sys.stderr)
    placement = dict(p.split("=", 1) for p in args.placement)
    if not set(placement) <= {"prefill", "decode"} or "" in placement.values():
        raise KvmeshError(f"--placement takes prefill=RESOURCE or decode=RESOURCE, not {args.placement}")
    token = secret_from_args(args) or generate_token()
    cluster = RayCluster(args.prefill, args.decode, args.model, args.cluster, args.gpus_per_node,
                         args.cpus_per_node, etcd=args.etcd or "",
                         node_options={"cluster_token": token, "device": args.device, "dtype": args.dtype,
                                       "otlp_endpoint": args.otlp_endpoint, "role_changes": args.roles == "auto",
                                       "trace_sample_ratio": args.trace_sample_ratio},
                         placement=placement, tensor_parallel_sizes=tensor_parallel_sizes(args)).start()
    print(json.dumps({"etcd": cluster.etcd, "nodes": cluster.hosts()}), flush=True)
    run_front_ends(args, cluster.etcd, args.cluster, token,  # Ray restarts dead node actors
                   supply=cluster if args.max_nodes else None)
    return 0
