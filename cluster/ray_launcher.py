"""``kvmesh launch``: the same cluster on a Ray cluster: an etcd actor, node actors, the router.

Every actor is named in the ``kvmesh`` Ray namespace, detached (it outlives the
``kvmesh launch`` driver: a new driver re-attaches by name, ``--stop`` ends them)
and restarted by Ray when it dies (``max_restarts=-1``); a restarted node registers again under its node id,
and the router follows the directory to its new endpoints. Across machines: node
actors are spread over the Ray nodes (``placement`` pins a role to the nodes that
offer a custom resource instead), every actor binds all interfaces and
advertises its Ray node's IP, and etcd does the same (or ``etcd`` names one).
Node actors ask Ray for a GPU when ``gpus_per_node`` > 0 and compute on the one Ray
assigns (``--device auto``: model, KV buffer and Triton kernels there), else on CPUs.
``stop_cluster`` (``kvmesh launch --stop``) stops etcd cleanly (no data dir left
behind) and kills them all.

Ray 2.60 turns token authentication on: every process joining the cluster (a
worker's ``ray start``, the ``kvmesh launch`` driver) needs ``RAY_AUTH_MODE=token``
and the head's token (``~/.ray/auth_token`` or ``$RAY_AUTH_TOKEN``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import ray

from kvmesh.auth import generate_token, token_from_env
from kvmesh.metadata.registry import wait_for_nodes
from kvmesh.metadata.keys import DEFAULT_CLUSTER

NAMESPACE = "kvmesh"


def node_ip() -> str:
    """This Ray node's IP: what actors advertise (routable from the other Ray nodes)."""
    return ray.util.get_node_ip_address()


@ray.remote(max_restarts=-1)
class EtcdActor:
    def __init__(self, token: str) -> None:
        from kvmesh.metadata.embedded_etcd import EmbeddedEtcd

        self.server = EmbeddedEtcd(host="0.0.0.0", advertise=node_ip(), token=token).start()

    def endpoint(self) -> str:
        return self.server.endpoint

    def stop(self) -> None:
        """Stop etcd and remove its data dir (before the actor is killed)."""
        self.server.cleanup()


@ray.remote(max_restarts=-1, max_task_retries=-1)
class NodeActor:
    """One prefill or decode node (a NodeRuntime) inside a Ray actor process."""

    def __init__(self, role: str, node_id: str, etcd: str, cluster: str, model: str, node_options: dict) -> None:
        from kvmesh.cluster.node_main import create_node
        from kvmesh.device import device_for_ray_actor
        from kvmesh.node.runtime import NodeConfig

        options = {"host": "0.0.0.0", "advertise_host": node_ip(), **node_options}
        options["device"] = device_for_ray_actor(options.get("device", "auto"), ray.get_gpu_ids())
        self.node = create_node(NodeConfig(node_id=node_id, role=role, etcd=etcd, cluster=cluster, model=model,
                                           **options))

    def info(self) -> dict:
        return {"node_id": self.node.cfg.node_id, "role": self.node.cfg.role, "host": self.node.advertise_host,
                "requests": self.node.endpoint.endpoint, "side_channel": self.node.agent.side_channel}

    def pid(self) -> int:
        import os

        return os.getpid()


@dataclass
class RayCluster:
    num_prefill: int = 1
    num_decode: int = 1
    model: str = "tiny-llama"
    cluster: str = DEFAULT_CLUSTER
    gpus_per_node: float = 0
    cpus_per_node: float = 1
    node_options: dict = field(default_factory=dict)
    placement: dict = field(default_factory=dict)  # role -> a custom resource offered by the nodes for that role
    etcd: str = ""
    actors: dict = field(default_factory=dict)

    def __post_init__(self) -> None:  # every node actor and the router share one cluster token
        self.node_options.setdefault("cluster_token", token_from_env() or generate_token())

    @property
    def token(self) -> str:
        return self.node_options["cluster_token"]

    def start(self, timeout_s: float = 300.0) -> RayCluster:
        """Create (or reuse, by name) the etcd and node actors and wait until every node is registered."""
        if not self.etcd:
            etcd_actor = EtcdActor.options(name="etcd", namespace=NAMESPACE, get_if_exists=True, num_cpus=0.1,
                                           lifetime="detached").remote(self.token)
            self.etcd = ray.get(etcd_actor.endpoint.remote(), timeout=timeout_s)
            self.actors["etcd"] = etcd_actor
        specs = [("prefill", f"prefill-{i}") for i in range(self.num_prefill)]
        specs += [("decode", f"decode-{i}") for i in range(self.num_decode)]
        for role, node_id in specs:
            where = ({"resources": {self.placement[role]: 0.001}} if role in self.placement
                     else {"scheduling_strategy": "SPREAD"})
            self.actors[node_id] = NodeActor.options(
                name=node_id, namespace=NAMESPACE, get_if_exists=True, lifetime="detached",
                num_cpus=self.cpus_per_node, num_gpus=self.gpus_per_node, **where).remote(role, node_id, self.etcd, self.cluster, self.model,
                                                             self.node_options)
        ray.get([self.actors[n].info.remote() for _, n in specs], timeout=timeout_s)
        self.wait_registered({n for _, n in specs}, timeout_s)
        return self

    def hosts(self) -> dict[str, str]:
        """Node id -> the address its actor advertises (its Ray node's IP)."""
        infos = ray.get([a.info.remote() for n, a in self.actors.items() if n != "etcd"])
        return {i["node_id"]: i["host"] for i in infos}

    def wait_registered(self, node_ids: set[str], timeout_s: float = 120.0) -> None:
        wait_for_nodes(self.etcd, self.cluster, node_ids, timeout_s, self.token)


def stop_cluster() -> list[str]:
    """Stop etcd cleanly, then kill every kvmesh actor of this Ray cluster (no restart); returns their names."""
    killed = []
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["namespace"] == NAMESPACE:
            handle = ray.get_actor(actor["name"], namespace=NAMESPACE)
            if actor["name"] == "etcd":
                try:
                    ray.get(handle.stop.remote(), timeout=30)
                except Exception:  # already dead: Ray's kill below is all that is left to do
                    pass
            ray.kill(handle, no_restart=True)
            killed.append(actor["name"])
    return killed
