"""Nodes of different tensor-parallel sizes in one cluster: KV moves between them through every path and is
what a single-node size-1 engine computes, position by position; a rank that dies takes its node out and the
router moves its streams elsewhere."""
from __future__ import annotations

import os
import signal
import threading

import pytest

from kvmesh import SamplingParams
from kvmesh.cluster.local_launcher import LocalCluster
from kvmesh.cluster.router import Router, RouterConfig
from tests.conftest import assert_same_kv
from tests.processes import children_running, still_running
from tests import test_cluster
from tests.test_cluster import BACKENDS, GREEDY, REMOTE_ONLY, check_all, prompt, wait_until_published

reference = test_cluster.reference  # the fixture: a size-1 engine's outputs and cached KV

# Per backend, the sizes of prefill-0, decode-0, decode-1 and decode-2 (decode-2 computes its prompts itself):
# between them every direction of a push and of a pull crosses sizes 1 and 2.
LAYOUTS = {"zmq": (2, 1, 2, 1), "mooncake": (1, 2, 1, 2)}


@pytest.fixture(scope="module", params=BACKENDS)
def cluster(request):
    sizes = dict(zip(("prefill-0", "decode-0", "decode-1", "decode-2"), LAYOUTS[request.param]))
    args = REMOTE_ONLY + ["--transfer-backend", request.param, "--prefill-timeout", "30", "--threads", "1"]
    if request.param == "mooncake":
        args.append("--no-shared-memory-transfers")
    per_node = {node_id: ["--tensor-parallel-size", str(size)] for node_id, size in sizes.items()}
    per_node["decode-2"] += ["--kv-placement", "threshold:100000"]
    with LocalCluster(num_prefill=1, num_decode=3, node_args=args, cluster=f"tp{request.param}",
                      per_node_args=per_node) as c:
        c.sizes = sizes
        yield c


def test_kv_crosses_tensor_parallel_sizes_as_a_size_one_engine_computes_it(cluster, reference):
    sizes = cluster.sizes
    for node_id, size in sizes.items():  # each node says its size in its record; ranks are its processes
        assert len(children_running(cluster.nodes[node_id].proc.pid, "kvmesh.parallel.rank_main")) == size - 1
    # A prefill node pushes to decode nodes of its own size and of the other.
    first, second = prompt(300, 90), prompt(301, 75)
    out_a = cluster.client("decode-0").generate(first, GREEDY)
    out_b = cluster.client("decode-1").generate(second, GREEDY)
    assert [out_a.token_ids, out_b.token_ids] == reference([first, second])
    assert out_a.stats.tokens_from_prefill_node >= 64 and out_b.stats.tokens_from_prefill_node >= 64
    assert_same_kv(cluster.client("decode-0"), reference.llm, first, min_blocks=len(first) // 16)
    assert_same_kv(cluster.client("decode-1"), reference.llm, second, min_blocks=len(second) // 16)
    # decode-2 computes a prefix itself; decode-0 then gets it from that holder, and the prefill node pulls it
    # from there to compute decode-1's suffix: holder pushes and pulls across sizes.
    prefix = prompt(302, 96)
    own = cluster.client("decode-2").generate(prefix + prompt(303, 10), GREEDY)
    wait_until_published(cluster, prefix, 6)
    later = [prefix + prompt(304, 20), prefix + prompt(305, 30)]
    outs = [cluster.client(d).generate(p, GREEDY) for d, p in zip(("decode-0", "decode-1"), later)]
    assert [own.token_ids, *(o.token_ids for o in outs)] == reference([prefix + prompt(303, 10), *later])
    assert all(o.stats.tokens_reused_remote + o.stats.tokens_reused_prefill_node >= 96 for o in outs), \
        [o.stats for o in outs]
    for node_id, p in zip(("decode-0", "decode-1"), later):
        assert_same_kv(cluster.client(node_id), reference.llm, p, min_blocks=len(p) // 16)
    assert cluster.client("prefill-0").stats()["tokens_pulled"] >= 96
    check_all(cluster)


def test_a_dead_rank_takes_its_node_out_and_its_stream_moves(reference):
    """Two decode nodes at size 2 (no prefill node: they compute prompts themselves): one rank of the node
    serving a stream is killed mid-stream. The node tells the router its streams must go elsewhere and leaves
    (exit status 1); the stream ends on the other node with no token lost or repeated. The router's liveness
    check is set far beyond the test: only the node's own word can move the stream in time."""
    with LocalCluster(0, 2, cluster="tp-rank-dies", role_args={"decode": ["--tensor-parallel-size", "2"]},
                      node_args=["--threads", "1"]) as cluster:
        router = Router(RouterConfig(etcd=cluster.etcd_endpoint, cluster_token=cluster.token, cluster="tp-rank-dies",
                                     liveness_s=600.0))
        try:
            ids = list(range(30, 110))
            params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
            stream = router.generate(ids, params)
            chunks = [next(stream) for _ in range(3)]
            victim = cluster.nodes[chunks[0].node_id].proc
            (rank,) = children_running(victim.pid, "kvmesh.parallel.rank_main")
            os.kill(rank, signal.SIGKILL)
            rest = threading.Thread(target=lambda: chunks.extend(stream), daemon=True)
            rest.start()
            rest.join(timeout=120)
            assert not rest.is_alive(), "the stream did not end"
            tokens = [t for c in chunks for t in c.token_ids]
            assert tokens == reference.llm.generate([ids], params, use_tqdm=False)[0].token_ids  # no gap, no repeat
            assert router.num_migrations == 1 and chunks[-1].node_id != chunks[0].node_id
            assert victim.wait(timeout=60) == 1  # the node left, saying it failed
            assert not still_running(rank)
        finally:
            router.close()


def test_serve_and_launch_take_a_size_per_role(monkeypatch):
    """``-tp`` for every node, a role's own flag over it; a size below 1 refused before anything starts; a Ray
    node actor asks for its CPUs and GPUs once per rank."""
    import argparse

    from kvmesh.cluster.ray_launcher import RayCluster
    from kvmesh.cluster.serve import add_serve_arguments, role_args, tensor_parallel_sizes
    from kvmesh.errors import KvmeshError

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args(["-tp", "2", "--decode-tensor-parallel-size", "1"])
    assert role_args(args) == {"prefill": ["--tensor-parallel-size", "2"], "decode": ["--tensor-parallel-size", "1"]}
    with pytest.raises(KvmeshError, match="1 or more"):
        tensor_parallel_sizes(parser.parse_args(["--prefill-tensor-parallel-size", "-1"]))
    ray_cluster = RayCluster(2, 1, cpus_per_node=1.5, gpus_per_node=1, tensor_parallel_sizes={"prefill": 4},
                             node_options={"cluster_token": "t"})
    assert [ray_cluster._tp(r) for r in ("prefill", "decode")] == [4, 1]
    import kvmesh.cluster.ray_launcher as rl

    monkeypatch.setattr(rl.ray, "cluster_resources", lambda: {"CPU": 100.0, "GPU": 8.0})
    with pytest.raises(KvmeshError, match="9 GPU"):  # 2 prefill nodes of 4 ranks and a decode node of 1
        ray_cluster._check_feasible(["prefill-0", "prefill-1", "decode-0"])


def test_a_node_refuses_a_size_its_model_cannot_be_split_by(tmp_path):
    """SmolLM2-135M has 9 attention heads: a node at size 2 exits at start-up saying so (nothing left running)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "kvmesh.cli", "decode-node", "--node-id", "d", "--etcd",
                           "127.0.0.1:1", "--model", "smollm2-135m-dummy", "-tp", "2"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "does not divide" in proc.stderr, proc.stderr[-2000:]
