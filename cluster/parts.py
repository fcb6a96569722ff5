"""``kvmesh etcd`` and ``kvmesh router``: the cluster's shared parts, run by hand, one per machine if you like.

    host A:  kvmesh etcd --host 0.0.0.0                       # prints its advertised endpoint
    host B:  kvmesh prefill-node --etcd A:2379 --host 0.0.0.0 --node-id prefill-0
    host C:  kvmesh decode-node  --etcd A:2379 --host 0.0.0.0 --node-id decode-0
    host A:  kvmesh router --etcd A:2379 --host 0.0.0.0       # learns the model from the nodes

All share ``$KVMESH_CLUSTER_TOKEN`` (or ``--cluster-token-file``; bound beyond loopback
they refuse to start without one) and the default cluster name; etcd then runs with
authentication, its credentials derived from that secret. Both run in the
foreground until Ctrl-C or SIGTERM, and leave nothing behind (etcd's data dir is
removed unless ``--data-dir`` names one).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from kvmesh.auth import add_secret_arguments, require_secret, secret_from_args
from kvmesh.errors import KvmeshError
from kvmesh.lifecycle import stop_on_sigterm
from kvmesh.metadata.keys import DEFAULT_CLUSTER


class NoNodesError(KvmeshError, RuntimeError):
    """The router found no node to learn the model from."""


def add_etcd_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="bind address (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=2379)
    p.add_argument("--advertise-host", default=None, help="the address nodes use (default: --host, or the "
                                                          "address of the default route for 0.0.0.0)")
    p.add_argument("--data-dir", default=None, help="keep etcd's data here (default: a temporary dir, removed)")
    add_secret_arguments(p)


def run_etcd(args: argparse.Namespace) -> int:
    from kvmesh.metadata.embedded_etcd import EmbeddedEtcd

    stop_on_sigterm()
    token = secret_from_args(args)
    require_secret("etcd", [args.host], token, args.insecure)
    etcd = EmbeddedEtcd(args.data_dir, host=args.host, port=args.port, advertise=args.advertise_host, token=token)
    try:
        etcd.start()
        print(json.dumps({"etcd": etcd.endpoint}), flush=True)
        print(f"etcd serving at {etcd.endpoint}; Ctrl-C stops it", file=sys.stderr)
        while etcd.running:
            time.sleep(0.5)
        print("etcd exited", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        etcd.cleanup()


def add_router_arguments(p: argparse.ArgumentParser) -> None:
    from kvmesh.cluster.serve import add_front_end_arguments

    p.add_argument("--etcd", required=True, help="host:port of the cluster's etcd")
    p.add_argument("--cluster", default=DEFAULT_CLUSTER)
    p.add_argument("--model", default=None, help="default: the model the registered nodes serve")
    p.add_argument("--wait-for-nodes", type=float, default=120.0, help="seconds to wait for a first node")
    add_front_end_arguments(p)


def model_of_cluster(etcd: str, cluster: str, timeout_s: float, token: str = "") -> str:
    """The model the cluster's nodes serve (from their records), waiting up to ``timeout_s`` for one."""
    from kvmesh.metadata.registry import NodeDirectory
    from kvmesh.metadata.sealed_store import open_store

    store = open_store(etcd, token)
    directory = NodeDirectory(store, cluster)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            models = {r.model.model for r in directory.nodes.values()} - {""}
            if len(models) > 1:
                raise KvmeshError(f"cluster {cluster!r} serves several models {sorted(models)}: pass --model")
            if models:
                return models.pop()
            if time.monotonic() > deadline:
                raise NoNodesError(f"no node registered in cluster {cluster!r} at {etcd} within {timeout_s} s "
                                   "(start nodes with the same --etcd and --cluster, or pass --model)")
            time.sleep(0.2)
    finally:
        directory.close()
        store.close()


def exit_now(code: int) -> None:
    """Leave without the interpreter's shutdown finalizers, once everything of ours is closed.

    gRPC objects (ours and the etcd client's) can deadlock in ``__del__`` at interpreter exit when a
    daemon thread was frozen holding their lock: a SIGTERM'd router then never exited."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_router(args: argparse.Namespace) -> int:
    from kvmesh.cluster.serve import check_front_end_ports, run_front_ends

    stop_on_sigterm()
    check_front_end_ports(args)
    token = secret_from_args(args)
    require_secret("router", [args.host], token, args.insecure)
    if not token:
        print("kvmesh router: no cluster token ($KVMESH_CLUSTER_TOKEN / --cluster-token-file): nodes that have "
              "one will refuse this router", file=sys.stderr)
    if args.model is None:
        args.model = model_of_cluster(args.etcd, args.cluster, args.wait_for_nodes, token)
        print(f"the cluster serves {args.model}", file=sys.stderr)
    run_front_ends(args, args.etcd, args.cluster, token)
    exit_now(0)
