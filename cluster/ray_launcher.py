"""``kvmesh launch``: the same cluster on a Ray cluster: an etcd actor, node actors, the router.

Every actor is named in the ``kvmesh`` Ray namespace and restarted by Ray when it
dies (``max_restarts=-1``); a restarted node registers again under its node id,
and the router follows the directory to its new endpoints. Node actors ask Ray
for a GPU when ``gpus_per_node`` > 0 (the Triton path), else for CPUs.
``stop_cluster`` (``kvmesh launch --stop``) kills them all.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import ray

from kvmesh.auth import generate_token, token_from_env
from kvmesh.metadata.registry import wait_for_nodes

NAMESPACE = "kvmesh"


@ray.remote(max_restarts=-1)
class EtcdActor:
    def __init__(self) -> None:
        from kvmesh.metadata.embedded_etcd import EmbeddedEtcd

        self.server = EmbeddedEtcd().start()

    def endpoint(self) -> str:
        return self.server.endpoint


@ray.remote(max_restarts=-1, max_task_retries=-1)
class NodeActor:
    """One prefill or decode node (a NodeRuntime) inside a Ray actor process."""

    def __init__(self, role: str, node_id: str, etcd: str, cluster: str, model: str, node_options: dict) -> None:
        from kvmesh.cluster.node_main import create_node
        from kvmesh.node.runtime import NodeConfig

        self.node = create_node(NodeConfig(node_id=node_id, role=role, etcd=etcd, cluster=cluster, model=model,
                                           **node_options))

    def info(self) -> dict:
        return {"node_id": self.node.cfg.node_id, "role": self.node.cfg.role,
                "requests": self.node.endpoint.endpoint, "side_channel": self.node.agent.side_channel}

    def pid(self) -> int:
        import os

        return os.getpid()


@dataclass
class RayCluster:
    num_prefill: int = 1
    num_decode: int = 1
    model: str = "tiny-llama"
    cluster: str = "ray"
    gpus_per_node: float = 0
    cpus_per_node: float = 1
    node_options: dict = field(default_factory=dict)
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
            etcd_actor = EtcdActor.options(name="etcd", namespace=NAMESPACE, get_if_exists=True,
                                           num_cpus=0.1).remote()
            self.etcd = ray.get(etcd_actor.endpoint.remote(), timeout=timeout_s)
            self.actors["etcd"] = etcd_actor
        specs = [("prefill", f"prefill-{i}") for i in range(self.num_prefill)]
        specs += [("decode", f"decode-{i}") for i in range(self.num_decode)]
        for role, node_id in specs:
            self.actors[node_id] = NodeActor.options(
                name=node_id, namespace=NAMESPACE, get_if_exists=True, num_cpus=self.cpus_per_node,
                num_gpus=self.gpus_per_node).remote(role, node_id, self.etcd, self.cluster, self.model,
                                                    self.node_options)
        ray.get([self.actors[n].info.remote() for _, n in specs], timeout=timeout_s)
        self.wait_registered({n for _, n in specs}, timeout_s)
        return self

    def wait_registered(self, node_ids: set[str], timeout_s: float = 120.0) -> None:
        wait_for_nodes(self.etcd, self.cluster, node_ids, timeout_s)


def stop_cluster() -> list[str]:
    """Kill every kvmesh actor of this Ray cluster (no restart); returns their names."""
    killed = []
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["namespace"] == NAMESPACE:
            ray.kill(ray.get_actor(actor["name"], namespace=NAMESPACE), no_restart=True)
            killed.append(actor["name"])
    return killed
