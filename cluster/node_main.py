"""``kvmesh prefill-node`` / ``kvmesh decode-node``: run one node process until stdin closes."""
from __future__ import annotations

import argparse
import faulthandler
import logging
import signal

from kvmesh.auth import InsecureClusterError, add_secret_arguments, secret_from_args
from kvmesh.lifecycle import stop_on_sigterm
from kvmesh.metadata.keys import DEFAULT_CLUSTER
from kvmesh.node.landing_bound import PROMPT_SLICE_S
from kvmesh.tracing import add_tracing_arguments


def add_scheduling_arguments(p: argparse.ArgumentParser) -> None:
    """How a node slices prompts and where its requests' KV comes from (``kvmesh serve`` passes them through)."""
    p.add_argument("--long-prefill-token-threshold", type=int, default=-1,
                   help="a prompt's tokens in one engine step, at most: a long prompt computed over several steps "
                        "lets the streams decoding beside it keep going (0: the step's whole budget; -1: decode "
                        "nodes take what they compute in --prompt-slice-ms per step beside streams, all prompts "
                        "together; prefill nodes the whole budget)")
    p.add_argument("--prompt-slice-ms", type=float, default=PROMPT_SLICE_S * 1e3,
                   help="with --long-prefill-token-threshold -1: a node with streams decoding beside its prompts "
                        "computes the prompt tokens of this many milliseconds (at its measured rate) per step, so "
                        "those streams' next token waits at most that much more (default: %(default)s)")
    p.add_argument("--kv-placement", default="cost", metavar="cost|cost:request|threshold:N",
                   help="where a request's uncached KV comes from: 'cost' takes the cheapest plan by measured rates, "
                        "a prompt computed here counting once for itself and once for each stream decoding here that "
                        "it holds up (never costlier than computing here); 'cost:request' counts the request alone; "
                        "'threshold:N' fetches from holders and prefill nodes whenever more than N uncached tokens "
                        "remain (0: always disaggregate)")


def scheduling_argument_error(args: argparse.Namespace) -> str | None:
    """What is wrong with ``add_scheduling_arguments``' values that the parser cannot see, or None."""
    if args.long_prefill_token_threshold < -1:
        return "--long-prefill-token-threshold must be -1 (auto), 0 (a whole step) or more"
    if not 0 < args.prompt_slice_ms < float("inf"):
        return f"--prompt-slice-ms must be more than 0 and finite, not {args.prompt_slice_ms}"
    return None


def add_node_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--node-id", required=True)
    p.add_argument("--etcd", required=True, help="host:port of the cluster's etcd")
    p.add_argument("--cluster", default=DEFAULT_CLUSTER, help="cluster name (the same default in every command)")
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--dtype", default="auto",
                   help="auto (bfloat16 on CPUs with AMX or AVX512-BF16, else float32), float32, bfloat16, float16; "
                        "every node of a cluster must resolve to the same dtype")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="auto: the model's weights; dummy: seeded weights of its shape drawn on the device at start-up, nothing "
                        "read but the config (speed at real sizes; the *-dummy presets always load this way)")
    p.add_argument("--device", default="auto",
                   help="auto (the first visible CUDA device, else the CPU), cpu, cuda or cuda:N: where the model "
                        "and the KV buffer live (dtype auto is bfloat16 there)")
    p.add_argument("--kv-transfer-memory", default="auto", choices=["auto", "direct", "host-staging"],
                   help="what the transfer engine registers: the KV buffer itself (direct: host memory, or GPU "
                        "memory with GPUDirect RDMA) or a pinned host mirror copied per transfer (host-staging); "
                        "auto picks and logs why")
    p.add_argument("--threads", type=int, default=0,
                   help="compute threads of this node, its tensor-parallel ranks together (0: torch's default, every "
                        "core, or with --core-share the cores the machine's other nodes leave)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="split the model over N processes of this node (the CPU; a size that does not divide the "
                        "model's heads is refused; peers of any size share its KV)")
    p.add_argument("--core-share", default="", metavar="FD:SLOT:CORES",
                   help="set by serve and local-cluster: the inherited table through which the nodes of one machine "
                        "divide its cores among those with work (kvmesh/node/core_share.py)")
    p.add_argument("--num-kv-blocks", type=int, default=1024)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget of one engine step")
    add_tracing_arguments(p)
    add_scheduling_arguments(p)
    p.add_argument("--host", default="127.0.0.1", help="bind every listener here (0.0.0.0: all interfaces)")
    p.add_argument("--advertise-host", default="",
                   help="the address other hosts reach this node at (default: --host, or for 0.0.0.0 the "
                        "address of the interface that routes to etcd)")
    p.add_argument("--transfer-backend", default="auto", choices=["auto", "mooncake", "zmq"],
                   help="auto: Mooncake where it loads, except on a node bound to loopback (Mooncake's ports listen "
                        "on every interface: docs/security.md), else zmq (CurveZMQ-encrypted)")
    p.add_argument("--shared-memory-transfers", action=argparse.BooleanOptionalAction, default=True,
                   help="keep the KV buffer (on the CPU) in shared memory so that peers on this host push into it "
                        "with one copy, and push that way to such peers; off: every push goes through the engine")
    p.add_argument("--lease-ttl", type=int, default=10)
    p.add_argument("--prefill-timeout", type=float, default=10.0,
                   help="decode nodes give up on a prefill node's blocks this many seconds past the time it "
                        "accepted them for (the decode node's own estimate of computing them), then compute")
    p.add_argument("--enforce-eager", action="store_true",
                   help="on a CUDA device: no CUDA graphs of decode or prompt steps (captured at start-up otherwise)")
    p.add_argument("--role-changes", action="store_true",
                   help="the role may change at run time (the router's --roles auto): a prefill node is ready to "
                        "decode too (decode graphs captured, speculative decoding set up)")
    p.add_argument("--holder-timeout", type=float, default=5.0,
                   help="nodes give up on a holder's push of cached blocks after this many seconds (a decode node's "
                        "fetch, a prefill node's pull of a prefix)")
    p.add_argument("--landing-slots", type=int, default=-1,
                   help="one-sided backends (Mooncake): blocks of host memory where pushes land before a checked "
                        "copy into the KV buffer (-1: a quarter of the KV blocks, at most 1 GiB)")
    p.add_argument("--transfer-gib-per-s", type=float, default=1.0,
                   help="the cost model's bandwidth before it has measured real transfers")
    p.add_argument("--transfer-rtt-ms", type=float, default=10.0,
                   help="the cost model's fetch overhead beyond the bytes (round trip, thread hops, the wait for "
                        "an engine step) before it has measured real fetches")
    p.add_argument("--no-prefix-cache", action="store_true", help="compute every prompt in full (baseline)")
    p.add_argument("--speculative", default="off", choices=["off", "ngram", "self-draft"],
                   help="decode nodes: speculative decoding with prompt-lookup guesses or a self-draft (the "
                        "model's first layers); requests whose guesses mostly fail stop guessing for a while")
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--no-global-pool", action="store_true", help="local caches only: no global index lookups")
    p.add_argument("--host-kv-gib", type=host_kv_gib, default="auto",
                   help="tier 1: host memory that blocks evicted from the KV buffer move to (docs/tiers.md; "
                        "auto: two KV buffers' worth, at most 5%% of this machine's memory; 0: none)")
    p.add_argument("--disk-kv-gib", type=float, default=0.0,
                   help="tier 2: a file on a local disk that the host tier's victims move to (0: none)")
    p.add_argument("--disk-kv-path", default="",
                   help="folder of the disk tier's file (kept, and re-adopted by a restart with the same node id "
                        "and model; default: a temporary folder removed at exit)")
    p.add_argument("--verify-kv", action=argparse.BooleanOptionalAction, default=True,
                   help="check a crc32 of each lower-tier block when it is promoted or served, and of each block "
                        "a peer pushes here (a mismatch is recomputed, never used)")
    add_secret_arguments(p)
    p.add_argument("--log-level", default="WARNING")


def host_kv_gib(value: str) -> str:
    """``--host-kv-gib``: ``auto`` or a size in GiB (0 or more)."""
    if value != "auto":
        try:
            if float(value) < 0:
                raise ValueError
        except ValueError:
            raise argparse.ArgumentTypeError(f"auto or a size in GiB (0 or more), not {value!r}") from None
    return value


def _gib_to_bytes(flag: str, gib: float) -> int:
    if gib < 0:
        raise SystemExit(f"{flag} must be 0 or more, got {gib}")
    return int(gib * 2**30)


def run_node(role: str, args: argparse.Namespace) -> int:
    if (error := scheduling_argument_error(args)) is not None:
        raise SystemExit(error)
    from kvmesh.device import DeviceError  # the model stack: only for the node commands themselves
    from kvmesh.node.runtime import NodeConfig

    logging.basicConfig(level=args.log_level, format=f"%(asctime)s {args.node_id} %(name)s %(levelname)s %(message)s")
    if args.threads > 0:
        import torch

        torch.set_num_threads(args.threads)
    cfg = NodeConfig(node_id=args.node_id, role=role, etcd=args.etcd, cluster=args.cluster, model=args.model,
                     load_format=args.load_format, dtype=args.dtype, device=args.device, kv_transfer_memory=args.kv_transfer_memory,
                     num_kv_blocks=args.num_kv_blocks, max_num_seqs=args.max_num_seqs,
                     max_num_batched_tokens=args.max_num_batched_tokens,
                     long_prefill_token_threshold=args.long_prefill_token_threshold,
                     prompt_slice_s=args.prompt_slice_ms / 1e3,
                     host=args.host, advertise_host=args.advertise_host, transfer_backend=args.transfer_backend,
                     shared_memory_transfers=args.shared_memory_transfers,
                     lease_ttl_s=args.lease_ttl, transfer_gib_per_s=args.transfer_gib_per_s,
                     transfer_rtt_s=args.transfer_rtt_ms / 1e3,
                     prefill_timeout_s=args.prefill_timeout, holder_timeout_s=args.holder_timeout,
                     num_landing_slots=args.landing_slots, enforce_eager=args.enforce_eager,
                     role_changes=args.role_changes,
                     kv_placement=args.kv_placement, core_share="" if args.threads > 0 else args.core_share,
                     enable_prefix_caching=not args.no_prefix_cache, use_global_pool=not args.no_global_pool,
                     speculative=args.speculative, num_speculative_tokens=args.num_speculative_tokens,
                     host_kv_bytes=-1 if args.host_kv_gib == "auto" else
                     _gib_to_bytes("--host-kv-gib", float(args.host_kv_gib)),
                     disk_kv_bytes=_gib_to_bytes("--disk-kv-gib", args.disk_kv_gib), disk_kv_path=args.disk_kv_path,
                     verify_kv=args.verify_kv, cluster_token=secret_from_args(args), insecure=args.insecure,
                     tensor_parallel_size=args.tensor_parallel_size, otlp_endpoint=args.otlp_endpoint,
                     trace_sample_ratio=args.trace_sample_ratio)
    stop_on_sigterm()  # SIGTERM: deregister and close like Ctrl-C or a closed stdin
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID`: every thread's stack on stderr
    try:
        node = create_node(cfg)
    except KeyboardInterrupt:
        return 0
    except (DeviceError, ValueError, InsecureClusterError) as e:  # a flag this machine or network cannot honour
        raise SystemExit(f"{args.node_id}: {e}") from None
    node.serve_forever()
    return 1 if node.broken else 0


def create_node(cfg):
    """A node taking ``cfg.role`` first, started and registered."""
    from kvmesh.cluster.serving_node import ServingNode

    return ServingNode(cfg).start()
