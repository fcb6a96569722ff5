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
def ray_instance():
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.getcwd()}})
    yield
    stop_cluster()
    ray.shutdown()


def test_ray_cluster_serves_and_restarts_a_killed_node(ray_instance):
    cluster = RayCluster(num_prefill=1, num_decode=1, cluster="ray-test", cpus_per_node=1,
                         node_options={"transfer_backend": "zmq"}).start()
    router = Router(RouterConfig(etcd=cluster.etcd, cluster_token=cluster.token, cluster="ray-test", liveness_s=1.0))
    reference = LLM("tiny-llama", num_kv_blocks=256, progress=False)
    try:
        ids = list(range(20, 90))
        expected = reference.generate(ids, GREEDY, use_tqdm=False)[0].token_ids
        assert [t for c in router.generate(ids, GREEDY) for t in c.token_ids] == expected
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
        more = list(range(200, 260))
        assert [t for c in router.generate(more, GREEDY) for t in c.token_ids] == \
            reference.generate(more, GREEDY, use_tqdm=False)[0].token_ids
    finally:
        router.close()
        assert set(stop_cluster()) >= {"etcd", "prefill-0", "decode-0"}
