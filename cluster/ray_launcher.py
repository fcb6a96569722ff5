"""``kvmesh launch``: the same cluster on a Ray cluster: an etcd actor, node actors, the router.

Every actor is named in the ``kvmesh`` Ray namespace, detached (it outlives the
``kvmesh launch`` driver: a new driver re-attaches by name, ``--stop`` ends them)
and restarted by Ray when it dies (``max_restarts=-1``); a restarted node registers again under its node id,
and the router follows the directory to its new endpoints. With ``--roles auto --max-nodes N`` the
router also adds node actors (while the Ray cluster has room) and removes idle ones (``add_node`` /
``remove_node``: this class is its ``NodeSupply``). Across machines: node
actors are spread over the Ray nodes (``placement`` pins a role to the nodes that
offer a custom resource instead), every actor binds all interfaces and
advertises its Ray node's IP, and etcd does the same (or ``etcd`` names one).
Node actors ask Ray for a GPU when ``gpus_per_node`` > 0 and compute on the one Ray
assigns (``--device auto``: model, KV buffer and Triton kernels there), else on CPUs.
``stop_cluster`` (``kvmesh launch --stop``) stops etcd cleanly (no data dir left
behind) and kills them all.

Ray 2.60 turns token authentication on: every process joining the cluster (a
worker's ``ray start``, the ``kvmesh launch`` driver) needs ``RAY_AUTH_MODE=token``
and the head's token (``~/.ray/auth_token``, ``$RAY_AUTH_TOKEN_PATH`` or
``$RAY_AUTH_TOKEN``); ``ray get-auth-token --generate`` makes one on the head.
A relaunch reattaches to the actors still up only with the cluster token they
were started with (their etcd actor keeps its digest), and start-up says what it
waits for (Ray resources no node has free) instead of hanging without a word.
"""
from __future__ import annotations

import hashlib
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import ray

from kvmesh.auth import generate_token, token_from_env
from kvmesh.metadata.registry import wait_for_nodes
from kvmesh.metadata.keys import DEFAULT_CLUSTER

NAMESPACE = "kvmesh"
log = logging.getLogger("kvmesh.launch")


RAY_TOKEN_HELP = ("this Ray cluster wants a token: run `ray get-auth-token --generate` on the head, copy its "
                  "~/.ray/auth_token to every machine (or export RAY_AUTH_TOKEN), and start Ray and kvmesh with "
                  "RAY_AUTH_MODE=token")


def ray_token_available() -> bool:
    """Whether this process has a Ray token: ``$RAY_AUTH_TOKEN``, ``$RAY_AUTH_TOKEN_PATH`` or ~/.ray/auth_token."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return True
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token"
    return Path(path).expanduser().is_file()


def join_ray(address: str) -> None:
    """``ray.init`` into the running cluster at ``address`` (token authentication when a token is at hand);
    KvmeshError saying what to do when there is no cluster there or it wants a token we lack."""
    from kvmesh.errors import KvmeshError

    if "RAY_AUTH_MODE" not in os.environ and ray_token_available():
        os.environ["RAY_AUTH_MODE"] = "token"  # Ray 2.60 clusters require it of every joining process
    try:
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False)
    except ConnectionError as e:
        raise KvmeshError(f"no Ray cluster at {address!r} ({e}); start one with `ray start --head` first") from None
    except Exception as e:
        if "token" in str(e).lower() or type(e).__name__ == "AuthenticationError":
            raise KvmeshError(f"{RAY_TOKEN_HELP} ({type(e).__name__})") from None
        raise


def token_digest(token: str) -> str:
    return hashlib.sha256(b"kvmesh-ray-launch:" + token.encode()).hexdigest()


def node_ip() -> str:
    """This Ray node's IP: what actors advertise (routable from the other Ray nodes)."""
    return ray.util.get_node_ip_address()


@ray.remote(max_restarts=-1)
class EtcdActor:
    def __init__(self, token: str) -> None:
        from kvmesh.metadata.embedded_etcd import EmbeddedEtcd

        self.server = EmbeddedEtcd(host="0.0.0.0", advertise=node_ip(), token=token).start()
        self._token_digest = token_digest(token)

    def token_digest(self) -> str:
        """Which cluster token this etcd (and the nodes launched with it) was started with, as a digest."""
        return self._token_digest

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

    def close(self) -> None:
        """Stop the node (it deregisters, its holder tells requesters it stopped) before the actor is killed."""
        self.node.close()


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
    # role -> its nodes' tensor-parallel size: a node actor asks N times the CPUs and GPUs (one Ray node holds all
    # of a node's ranks: they are processes of its actor, which die with it and come back with its restart)
    tensor_parallel_sizes: dict = field(default_factory=dict)
    etcd: str = ""
    actors: dict = field(default_factory=dict)
    _starting: set = field(default_factory=set)  # nodes added at run time, not seen registered yet

    def __post_init__(self) -> None:  # every node actor and the router share one cluster token
        self.node_options.setdefault("cluster_token", token_from_env() or generate_token())

    @property
    def token(self) -> str:
        return self.node_options["cluster_token"]

    def start(self, timeout_s: float = 300.0, say=None) -> RayCluster:
        """Create (or reuse, by name) the etcd and node actors and wait until every node is registered.

        ``say(line)`` hears what start-up waits for (default: stderr). KvmeshError when actors of an earlier
        launch are up with another cluster token, when the actors ask for more than the whole Ray cluster has,
        or when they are not placed within ``timeout_s`` (naming the resources they wait for)."""
        from kvmesh.errors import KvmeshError

        say = say or (lambda line: print(line, file=sys.stderr, flush=True))
        specs = [("prefill", f"prefill-{i}") for i in range(self.num_prefill)]
        specs += [("decode", f"decode-{i}") for i in range(self.num_decode)]
        existing = kvmesh_actor_names()
        if existing:
            say(f"reattaching to the kvmesh actors already up on this Ray cluster: {', '.join(existing)} "
                f"(`kvmesh launch --stop` ends them)")
            if "etcd" in existing and not self.etcd:
                old = ray.get_actor("etcd", namespace=NAMESPACE)
                if ray.get(old.token_digest.remote(), timeout=60) != token_digest(self.token):
                    raise KvmeshError("the kvmesh actors already up were launched with another cluster token: "
                                      "pass that token (--cluster-token-file or $KVMESH_CLUSTER_TOKEN) to reuse "
                                      "them, or end them with `kvmesh launch --stop`")
        missing = [n for _, n in specs if n not in existing] + ([] if self.etcd or "etcd" in existing else ["etcd"])
        self._check_feasible(missing)
        if not self.etcd:
            etcd_actor = EtcdActor.options(name="etcd", namespace=NAMESPACE, get_if_exists=True,
                                           num_cpus=ETCD_CPUS, lifetime="detached").remote(self.token)
            self.actors["etcd"] = etcd_actor
            self.etcd = self._wait_placed({"etcd": etcd_actor.endpoint.remote()}, timeout_s, say,
                                          f"{ETCD_CPUS:g} CPU")["etcd"]
        for role, node_id in specs:
            self._create_node_actor(role, node_id)
        asks = f"{self.cpus_per_node:g} CPU" + (f", {self.gpus_per_node:g} GPU" if self.gpus_per_node else "") + \
            " per rank"
        self._wait_placed({n: self.actors[n].info.remote() for _, n in specs}, timeout_s, say, asks)
        self.wait_registered({n for _, n in specs}, timeout_s)
        return self

    def _create_node_actor(self, role: str, node_id: str):
        where = ({"resources": {self.placement[role]: 0.001}} if role in self.placement
                 else {"scheduling_strategy": "SPREAD"})
        tp = self._tp(role)
        self.actors[node_id] = NodeActor.options(
            name=node_id, namespace=NAMESPACE, get_if_exists=True, lifetime="detached",
            num_cpus=self.cpus_per_node * tp, num_gpus=self.gpus_per_node * tp, **where).remote(
                role, node_id, self.etcd, self.cluster, self.model, {**self.node_options, "tensor_parallel_size": tp})
        return self.actors[node_id]

    # ---- a NodeSupply (kvmesh/cluster/role_controller.py): the router grows and shrinks the cluster ----------
    def add_node(self, role: str) -> str | None:
        """A node actor of ``role`` under the next free id, started now (it registers by itself); None when the
        Ray cluster has no free room for its CPUs and GPUs (logged)."""
        tp = self._tp(role)
        free = ray.available_resources()
        want = {"CPU": self.cpus_per_node * tp, "GPU": self.gpus_per_node * tp}
        short = {k: v for k, v in want.items() if v > free.get(k, 0.0) + 1e-9}
        if short:
            log.info("no room on the Ray cluster for another %s node: it asks %s, free %s", role, want,
                     {k: free.get(k, 0.0) for k in want})
            return None
        taken = set(self.actors) | set(kvmesh_actor_names())
        node_id = next(f"{role}-{i}" for i in range(len(taken) + 1) if f"{role}-{i}" not in taken)
        self._create_node_actor(role, node_id)
        self._starting.add(node_id)
        return node_id

    def remove_node(self, node_id: str) -> None:
        """Stop that node actor for good: its node closes (deregisters), then Ray kills it without a restart."""
        actor = self.actors.pop(node_id, None) or ray.get_actor(node_id, namespace=NAMESPACE)
        self._starting.discard(node_id)
        try:
            ray.get(actor.close.remote(), timeout=60)
        except Exception as e:  # dead already, or stuck: the kill below ends it either way
            log.warning("node %s did not close cleanly before its removal: %s", node_id, e)
        ray.kill(actor, no_restart=True)

    def num_starting(self, registered: set[str]) -> int:
        self._starting -= registered
        return len(self._starting)

    def _tp(self, role: str) -> int:
        return int(self.tensor_parallel_sizes.get(role, 1))

    def _check_feasible(self, names: list[str]) -> None:
        """KvmeshError when the actors still to create ask for more CPUs or GPUs than the Ray cluster has."""
        from kvmesh.errors import KvmeshError

        ranks = sum(self._tp(n.split("-")[0]) for n in names if n != "etcd")
        want = {"CPU": self.cpus_per_node * ranks + (ETCD_CPUS if "etcd" in names else 0),
                "GPU": self.gpus_per_node * ranks}
        have = ray.cluster_resources()
        short = {k: (v, have.get(k, 0.0)) for k, v in want.items() if v > have.get(k, 0.0) + 1e-9}
        if short:
            detail = ", ".join(f"{v:g} {k} (the cluster has {h:g})" for k, (v, h) in short.items())
            raise KvmeshError(f"{', '.join(names)} would need {detail}: lower --cpus-per-node / "
                              f"--gpus-per-node or add Ray nodes")

    def _wait_placed(self, refs: dict, timeout_s: float, say, asks: str) -> dict:
        """Each ref's value; every ``WAIT_REPORT_S`` says which actors Ray has not placed, what each asks
        (``asks``) and what is free."""
        from kvmesh.errors import KvmeshError

        deadline = time.monotonic() + timeout_s
        pending = dict(refs)
        values = {}
        while pending:
            ready, _ = ray.wait(list(pending.values()), num_returns=len(pending),
                                timeout=min(WAIT_REPORT_S, max(0.1, deadline - time.monotonic())))
            for name, ref in list(pending.items()):
                if ref in ready:
                    values[name] = ray.get(ref)
                    del pending[name]
            if not pending:
                break
            free = ray.available_resources()
            line = (f"waiting for Ray to start {', '.join(pending)} (each asks {asks}; free now: "
                    f"{free.get('CPU', 0):g} CPU, {free.get('GPU', 0):g} GPU; `ray status` shows the demand)")
            if time.monotonic() >= deadline:
                raise KvmeshError(f"timed out after {timeout_s:.0f} s {line}")
            say(line)
        return values

    def hosts(self) -> dict[str, str]:
        """Node id -> the address its actor advertises (its Ray node's IP)."""
        infos = ray.get([a.info.remote() for n, a in self.actors.items() if n != "etcd"])
        return {i["node_id"]: i["host"] for i in infos}

    def wait_registered(self, node_ids: set[str], timeout_s: float = 120.0) -> None:
        wait_for_nodes(self.etcd, self.cluster, node_ids, timeout_s, self.token)


ETCD_CPUS = 0.1
WAIT_REPORT_S = 10.0


def kvmesh_actor_names() -> list[str]:
    """The kvmesh actors alive on this Ray cluster (an earlier launch's, detached), sorted."""
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == NAMESPACE)


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
