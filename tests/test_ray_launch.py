"""``kvmesh launch`` on a real local Ray instance: serve through the router, kill a node actor, see it back."""
from __future__ import annotations

import os
import signal
import time

import pytest

ray = pytest.importorskip("ray")  # a declared dependency: `make test` installs it

from kvmesh import LLM, SamplingParams  # noqa: E402
from kvmesh.cluster.ray_launcher import RayCluster, stop_cluster  # noqa: E402
from kvmesh.cluster.router import Router, RouterConfig  # noqa: E402

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def ray_instance(ray_auth_env):
    """A local Ray instance with the suite's own token; whatever ``ray.init`` puts in the environment
    (Ray 2.60 sets ``RAY_AUTH_MODE``) is taken out again afterwards."""
    saved = {name: os.environ.get(name) for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH")}
    # The token path only: a new local cluster turns token mode on itself (and tells Ray's native config so).
    os.environ["RAY_AUTH_TOKEN_PATH"] = ray_auth_env["RAY_AUTH_TOKEN_PATH"]
    try:
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": os.getcwd()}})
        assert os.environ.get("RAY_AUTH_MODE") == "token"  # what the actors' processes inherit
        yield
    finally:
        stop_cluster()
        ray.shutdown()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def assert_serves_as_the_engine(router: Router, reference: LLM, ids: list[int]) -> None:
    assert [t for c in router.generate(ids, GREEDY) for t in c.token_ids] == \
        reference.generate(ids, GREEDY, use_tqdm=False)[0].token_ids


def test_ray_cluster_serves_and_restarts_a_killed_node(ray_instance):
    cluster = RayCluster(num_prefill=1, num_decode=1, cluster="ray-test", cpus_per_node=1,
                         node_options={"transfer_backend": "zmq"}).start()
    router = Router(RouterConfig(etcd=cluster.etcd, cluster_token=cluster.token, cluster="ray-test", liveness_s=1.0))
    reference = LLM("tiny-llama", num_kv_blocks=256, progress=False)
    try:
        assert_serves_as_the_engine(router, reference, list(range(20, 90)))
        decode = cluster.actors["decode-0"]
        old_pid = ray.get(decode.pid.remote())
        old_endpoint = ray.get(decode.info.remote())["requests"]
        os.kill(old_pid, signal.SIGKILL)  # the actor's process dies; Ray restarts it
        deadline = time.monotonic() + 120
        while True:
            try:
                info = ray.get(decode.info.remote(), timeout=10)
                if ray.get(decode.pid.remote(), timeout=10) != old_pid:
                    break
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                pass
            assert time.monotonic() < deadline, "the node actor did not come back"
            time.sleep(0.5)
        assert info["requests"] != old_endpoint
        deadline = time.monotonic() + 60
        while router.directory.nodes.get("decode-0") is None or \
                router.directory.nodes["decode-0"].request_endpoint != info["requests"]:
            assert time.monotonic() < deadline, "the restarted node did not register"
            time.sleep(0.1)
        assert_serves_as_the_engine(router, reference, list(range(200, 260)))
    finally:
        router.close()
        assert set(stop_cluster()) >= {"etcd", "prefill-0", "decode-0"}


def test_launch_says_what_it_waits_for_and_refuses_actors_of_another_token(ray_instance):
    """A relaunch reattaches to the actors still up only with their token; actors that the whole Ray cluster
    cannot hold are refused at once, and actors that wait for free resources are named with what is free,
    never a silent hang."""
    from kvmesh.errors import KvmeshError

    lines: list[str] = []
    token = "a" * 64
    try:
        RayCluster(num_prefill=0, num_decode=1, cluster="ray-relaunch", cpus_per_node=1,
                   node_options={"transfer_backend": "zmq", "cluster_token": token}).start(say=lines.append)
        assert not [line for line in lines if "reattaching" in line]  # a first launch reattaches to nothing
        with pytest.raises(KvmeshError, match="another cluster token"):
            RayCluster(num_prefill=0, num_decode=1, cluster="ray-relaunch",
                       node_options={"transfer_backend": "zmq", "cluster_token": "b" * 64}).start(say=lines.append)
        assert "etcd" in lines[-1] and "decode-0" in lines[-1] and "--stop" in lines[-1]
        with pytest.raises(KvmeshError, match=r"64 CPU \(the cluster has 4\)"):
            RayCluster(num_prefill=0, num_decode=2, cluster="ray-relaunch", cpus_per_node=64,
                       node_options={"transfer_backend": "zmq", "cluster_token": token}).start(say=lines.append)
        started = time.monotonic()
        with pytest.raises(KvmeshError, match=r"waiting for Ray to start decode-1 .*free now: 2\.9 CPU"):
            RayCluster(num_prefill=0, num_decode=2, cluster="ray-relaunch", cpus_per_node=3,
                       node_options={"transfer_backend": "zmq", "cluster_token": token}).start(timeout_s=3,
                                                                                              say=lines.append)
        assert time.monotonic() - started < 60
    finally:
        assert set(stop_cluster()) >= {"etcd", "decode-0"}


def test_the_router_adds_a_node_actor_under_load_and_removes_an_idle_one(ray_instance):
    """``--roles auto --max-nodes 2`` on Ray: one decode node whose slots stay full gets a second node actor (no
    prefill node to move: there is none); once idle, the cluster shrinks back to one node, the decode node
    removed drained first, its actor gone for good; every stream equal to the single-process engine's."""
    import threading

    cluster = RayCluster(num_prefill=0, num_decode=1, cluster="ray-scale", cpus_per_node=1,
                         node_options={"transfer_backend": "zmq", "role_changes": True, "max_num_seqs": 2}).start()
    router = Router(RouterConfig(etcd=cluster.etcd, cluster_token=cluster.token, cluster="ray-scale",
                                 liveness_s=1.0, roles="auto", max_nodes=2, role_interval_s=0.2,
                                 role_cooldown_s=1.0), supply=cluster)
    reference = LLM("tiny-llama", num_kv_blocks=256, progress=False)
    long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    prompts = [list(range(30 + k, 70 + k)) for k in range(2)]
    outputs: list[tuple[int, list[int]]] = []
    added = threading.Event()

    def keep_busy(k: int) -> None:  # both of decode-0's slots busy until a node is added
        while not added.is_set():
            outputs.append((k, [t for c in router.generate(prompts[k], long) for t in c.token_ids]))

    try:
        threads = [threading.Thread(target=keep_busy, args=(k,)) for k in range(2)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 240
        while len(router.directory.nodes) < 2:
            assert time.monotonic() < deadline, f"no node added: {router.roles.history}"
            time.sleep(0.2)
        added.set()
        assert router.roles.scaled["add"] == 1 and "decode-1" in router.directory.nodes
        for t in threads:
            t.join(timeout=120)
        expected = [reference.generate(p, long, use_tqdm=False)[0].token_ids for p in prompts]
        assert outputs and all(out == expected[k] for k, out in outputs)
        while len(router.directory.nodes) > 1 or router.roles.scaled["remove"] < 1:  # idle: back to one
            assert time.monotonic() < deadline, f"no node removed: {router.roles.history}"
            time.sleep(0.2)
        (left,) = router.directory.nodes
        removed = ({"decode-0", "decode-1"} - {left}).pop()
        assert [kind for _, node, kind, _ in router.roles.history if node == removed][-1] == "remove"
        while removed in {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)}:  # killed after
            assert time.monotonic() < deadline, f"{removed}'s actor still up"  # its node closed and deregistered
            time.sleep(0.2)
        assert_serves_as_the_engine(router, reference, list(range(200, 240)))
    finally:
        added.set()
        router.close()
        stopped = set(stop_cluster())
    assert "etcd" in stopped and left in stopped
    # Any other node actor still up is one the scaler added again while the serving check above kept the node left
    # busy (a removed one that lived on would have "remove" as its last action).
    for node in stopped & {"decode-0", "decode-1"} - {left}:
        assert [kind for _, n, kind, _ in router.roles.history if n == node][-1] == "add", node
