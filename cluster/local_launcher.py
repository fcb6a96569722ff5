"""LocalCluster: etcd + N prefill + M decode node processes on this machine, for tests and the harness.

    with LocalCluster(num_prefill=1, num_decode=1) as cluster:
        client = cluster.client("decode-0")
        client.generate(prompt_ids, SamplingParams(max_tokens=8, temperature=0))

On loopback by default; with ``hosts`` (``cluster.hosts.Hosts``, network
namespaces) etcd and every node run inside a simulated host of their own
(``placement``: node id -> host index; default etcd on host 1, nodes spread
over the others), bound to that host's address, so every byte between them
crosses a veth link. Waits until every node is registered in etcd; on exit
stops the nodes (closing their stdin, then killing stragglers) and the private etcd.
"""
from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import dataclass

from kvmesh.auth import TOKEN_ENV, ClusterAuth, generate_token, token_from_env
from kvmesh.cluster.client import NodeClient
from kvmesh.cluster.hosts import Hosts
from kvmesh.cluster.node_forkserver import ForkedProcess, start_module
from kvmesh.metadata.embedded_etcd import EmbeddedEtcd
from kvmesh.metadata.registry import wait_for_nodes
from kvmesh.node.core_share import CoreTable


@dataclass
class NodeProcess:
    node_id: str
    role: str
    proc: subprocess.Popen | ForkedProcess
    info: dict

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


class LocalCluster:
    def __init__(self, num_prefill: int = 1, num_decode: int = 1, model: str = "tiny-llama",
                 etcd: str | None = None, cluster: str = "local", node_args: list[str] | None = None,
                 start_timeout_s: float = 120.0, cluster_token: str | None = None, hosts: Hosts | None = None,
                 placement: dict[str, int] | None = None, dtype: str = "float32", threads_per_node: int = 0,
                 per_node_args: dict[str, list[str]] | None = None, role_args: dict[str, list[str]] | None = None,
                 fork_nodes: bool = True):
        """``cluster_token``: default $KVMESH_CLUSTER_TOKEN, else a fresh random one (``self.token``).

        ``dtype``: the nodes' model dtype ("auto" resolves on each node). ``threads_per_node``: compute threads
        of each node; 0: the nodes divide this machine's cores among those with work at each step (a
        ``CoreTable``), or on simulated ``hosts`` split them evenly (at least one each). ``role_args``: role ->
        arguments of that role's nodes (after ``node_args``); ``per_node_args``: node id -> arguments added to
        that node's command line only (after those). ``fork_nodes``: fork node processes from a server that
        has imported the model stack once (``node_forkserver``; on simulated hosts, one server inside each
        host's namespace) instead of starting each from scratch.
        """
        self.num_prefill, self.num_decode = num_prefill, num_decode
        self.hosts = hosts
        self.placement = dict(placement or {})
        if hosts is not None:
            others = [h.index for h in hosts.hosts[1:]] or [1]
            node_ids = [f"prefill-{i}" for i in range(num_prefill)] + [f"decode-{i}" for i in range(num_decode)]
            for i, node_id in enumerate(node_ids):
                self.placement.setdefault(node_id, others[i % len(others)])
            self.placement.setdefault("etcd", 1)
        self.token = cluster_token if cluster_token is not None else (token_from_env() or generate_token())
        self.auth = ClusterAuth(self.token)
        self.model, self.cluster = model, cluster
        self.node_args = node_args or []
        self.per_node_args = dict(per_node_args or {})
        self.role_args = dict(role_args or {})
        self.dtype = dtype
        self.fork_nodes = fork_nodes
        self.cores = CoreTable() if threads_per_node == 0 and hosts is None else None
        self.threads_per_node = threads_per_node or max(1, (os.cpu_count() or 1) // max(1, num_prefill + num_decode))
        self.start_timeout_s = start_timeout_s
        if etcd or hosts is None:
            self._etcd = None if etcd else EmbeddedEtcd(token=self.token)
        else:
            etcd_host = hosts[self.placement["etcd"]]
            self._etcd = EmbeddedEtcd(host=etcd_host.address, command_prefix=etcd_host.exec_prefix, token=self.token)
        self.etcd_endpoint = etcd or self._etcd.endpoint
        self.nodes: dict[str, NodeProcess] = {}
        self._clients: dict[str, NodeClient] = {}

    def start(self) -> LocalCluster:
        if self._etcd is not None:
            self._etcd.start()
        specs = [("prefill", f"prefill-{i}") for i in range(self.num_prefill)]
        specs += [("decode", f"decode-{i}") for i in range(self.num_decode)]
        for role, node_id in specs:
            self.start_node(role, node_id, wait=False)
        for node in self.nodes.values():
            node.info = json.loads(node.proc.stdout.readline() or "{}")
            if not node.info:
                raise RuntimeError(f"node {node.node_id} died during start-up (exit {node.proc.wait()})")
        self.wait_registered(set(self.nodes))
        self.wait_decode_nodes_see_prefill_nodes()
        return self

    def start_node(self, role: str, node_id: str, wait: bool = True, extra_args: tuple[str, ...] = ()) -> NodeProcess:
        """Start (or restart) one node process; with ``wait``, until it is registered."""
        argv = [f"{role}-node", "--node-id", node_id, "--etcd", self.etcd_endpoint, "--cluster", self.cluster,
                "--model", self.model, "--dtype", self.dtype, *self._thread_args(node_id), *self.node_args,
                *self.role_args.get(role, ()), *self.per_node_args.get(node_id, ()), *extra_args]
        prefix: tuple[str, ...] = ()
        if self.hosts is not None:
            host = self.hosts[self.placement.setdefault(node_id, self.hosts.hosts[-1].index)]
            prefix, argv = tuple(host.exec_prefix), [*argv, "--host", host.address]
        env = {**os.environ, TOKEN_ENV: self.token}  # never on argv: every local user can read that
        proc = start_module("kvmesh.cli", argv, env, secret_env=(TOKEN_ENV,), prefix=prefix, name=node_id,
                            pass_fds=(self.cores.fd,) if self.cores is not None else (), fork=self.fork_nodes)
        node = self.nodes[node_id] = NodeProcess(node_id, role, proc, {})
        stale = self._clients.pop(node_id, None)  # a restarted node listens elsewhere
        if stale is not None:
            stale.close()
        if wait:
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"node {node_id} died during start-up (exit {proc.wait()})")
            node.info = json.loads(line)
            self.wait_registered({node_id})
        return node

    def _thread_args(self, node_id: str) -> list[str]:
        share = self.cores.node_argument(node_id) if self.cores is not None else None
        if share is None:
            return ["--threads", str(self.threads_per_node)]
        return ["--threads", "0", "--core-share", share]

    def wait_registered(self, node_ids: set[str]) -> None:
        wait_for_nodes(self.etcd_endpoint, self.cluster, node_ids, self.start_timeout_s, self.token)

    def wait_decode_nodes_see_prefill_nodes(self) -> None:
        """Until every decode node's own directory (fed by an etcd watch) lists every prefill node: a
        request sent before that would be computed where it lands, whatever its plan."""
        prefill_ids = {n for n, node in self.nodes.items() if node.role == "prefill"}
        deadline = time.monotonic() + self.start_timeout_s
        for node_id in (n for n, node in self.nodes.items() if node.role == "decode" and prefill_ids):
            while not prefill_ids <= set(self.client(node_id).stats().get("prefill_node_ids", ())):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{node_id} did not see prefill nodes {sorted(prefill_ids)} "
                                       f"within {self.start_timeout_s} s")
                time.sleep(0.05)  # the condition is re-read; the directory updates from an etcd watch

    def client(self, node_id: str) -> NodeClient:
        if node_id not in self._clients:
            self._clients[node_id] = NodeClient(self.nodes[node_id].info["requests"], auth=self.auth)
        return self._clients[node_id]

    def stop_etcd(self) -> None:
        self._etcd.stop()

    def start_etcd(self) -> None:
        self._etcd.start()

    @property
    def supervises_etcd(self) -> bool:
        """True when this cluster started its own etcd (and so may restart it)."""
        return self._etcd is not None

    @property
    def etcd_running(self) -> bool:
        return self._etcd is None or self._etcd.running

    @property
    def etcd_pid(self) -> int | None:
        return self._etcd.pid if self._etcd is not None else None

    def restart_etcd(self) -> None:
        """Start the private etcd again on its ports and data (after it died)."""
        self._etcd.restart()

    def close(self) -> None:
        for client in self._clients.values():
            client.close()
        for node in self.nodes.values():
            if node.proc.poll() is None:
                try:
                    node.proc.stdin.write("quit\n")
                    node.proc.stdin.flush()
                except (BrokenPipeError, OSError):
                    pass
        for node in self.nodes.values():
            try:
                node.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                node.kill()
        if self._etcd is not None:
            self._etcd.cleanup()
        if self.cores is not None:
            self.cores.close()

    def __enter__(self) -> LocalCluster:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc) -> None:
        self.close()
