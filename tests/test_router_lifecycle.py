"""The router beyond one running cluster: migration when a decode node dies mid-stream, ``kvmesh serve`` as a
process, a router that loads no weights (and refuses nodes with other weights), cached-token accounting."""
from __future__ import annotations

import json

import grpc
import pytest

from kvmesh import LLM, SamplingParams
from kvmesh.cluster.local_launcher import LocalCluster
from kvmesh.cluster.router import Router, RouterConfig


@pytest.fixture(scope="module")
def reference():
    llm = LLM("tiny-llama", num_kv_blocks=512, progress=False)
    return lambda prompt, params: llm.generate(prompt, params, use_tqdm=False)[0]


def test_migration_when_the_decode_node_dies_mid_stream(reference):
    with LocalCluster(1, 2, cluster="migrate") as cluster:
        router = Router(RouterConfig(etcd=cluster.etcd_endpoint, cluster_token=cluster.token, cluster="migrate", liveness_s=1.0))
        try:
            ids = list(range(50, 120))
            params = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)
            stream = router.generate(ids, params)
            chunks = [next(stream) for _ in range(5)]
            cluster.nodes[chunks[0].node_id].kill()  # mid-stream
            chunks += list(stream)
            tokens = [t for c in chunks for t in c.token_ids]
            assert tokens == reference(ids, params).token_ids  # no duplicate, no gap
            assert router.num_migrations == 1 and chunks[-1].node_id != chunks[0].node_id
            assert chunks[-1].completion_tokens == 300
        finally:
            router.close()


def test_kvmesh_serve_end_to_end(tmp_path):
    """`kvmesh serve` (what `make serve` runs), with the tiny preset and free ports, answered by the openai client;
    its nodes have a host KV tier by default; a client that goes away mid-stream and a clean stop log no
    traceback and no warning."""
    import signal
    import subprocess
    import sys

    openai = pytest.importorskip("openai")
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "kvmesh.cli", "serve", "--model", "tiny-llama",
                             "--dtype", "float32", "--grpc-port", "0",
                             "--http-port", "0"], stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        endpoints = json.loads(proc.stdout.readline())
        client = openai.OpenAI(base_url=endpoints["http"], api_key="unused")
        out = client.completions.create(model="tiny-llama", prompt="hello kvmesh", max_tokens=5, temperature=0.0)
        assert out.usage.completion_tokens >= 1 and out.choices[0].finish_reason in ("length", "stop")
        stream = client.completions.create(model="tiny-llama", prompt="go on", max_tokens=900,
                                           stream=True, extra_body={"ignore_eos": True})
        next(iter(stream))
        stream.close()  # the client goes away mid-stream
        from kvmesh.cluster.grpc_server import pb, pb_grpc

        stub = pb_grpc.RouterStub(grpc.insecure_channel(endpoints["grpc"]))
        assert list(stub.ListModels(pb.ListModelsRequest(), timeout=10).models) == ["tiny-llama"]
        for node in stub.ClusterStatus(pb.ClusterStatusRequest(), timeout=30).nodes:
            assert json.loads(node.stats_json)["tier_host_capacity"] > 0, node.node_id  # on by default
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
    log.seek(0)
    said = log.read()
    assert "Traceback" not in said and "WARNING" not in said and "watch broke" not in said, said


def test_the_router_loads_no_weights_and_refuses_nodes_with_other_weights(monkeypatch):
    import kvmesh.model.loader as loader

    def no_weights(*args, **kwargs):
        raise AssertionError("the router must not load or build a model")

    monkeypatch.setattr(loader, "load_model", no_weights)
    monkeypatch.setattr(loader, "build_model", no_weights)
    with LocalCluster(0, 1, cluster="card") as cluster:
        cluster.start_node("decode", "decode-bf16", extra_args=("--dtype", "bfloat16"))  # same name, other weights
        router = Router(RouterConfig(etcd=cluster.etcd_endpoint, cluster_token=cluster.token, cluster="card",
                                     routing="round-robin"))
        try:
            nodes = {c.node_id for _ in range(6) for c in router.generate(list(range(3, 40)),
                                                                         SamplingParams(max_tokens=2)) if c.finished}
            assert nodes == {"decode-0"}
            ready, detail = router.readiness()
            assert ready and detail["refused_nodes"] == ["decode-bf16"] and detail["decode_nodes"] == ["decode-0"]
        finally:
            router.close()


def test_cached_tokens_count_every_cache_the_prompt_came_from():
    """The KV buffer, the host and disk tiers, peers and a prefill node's cache are all reuse (usage, /metrics); a
    prefill node's computing is not."""
    from kvmesh.cluster.metrics import RouterMetrics
    from kvmesh.cluster.openai_protocol import usage
    from kvmesh.cluster.router import Chunk

    from kvmesh.node.messages import RequestStats

    cache = RequestStats(tokens_reused_local=16, tokens_reused_host=32, tokens_reused_disk=48, tokens_reused_remote=64,
                         tokens_reused_prefill_node=80, tokens_from_prefill_node=100, tokens_computed=5)
    assert usage(Chunk([], "", True, prompt_tokens=345, cache=cache))["prompt_tokens_details"]["cached_tokens"] == 240
    metrics = RouterMetrics()
    metrics.record_finished(cache)
    text = metrics.exposition().decode()
    for source, n in (("host", 32), ("disk", 48), ("remote", 64), ("prefill_node_cache", 80), ("prefill_node", 100)):
        assert f'kvmesh_prompt_tokens_total{{source="{source}"}} {float(n)}' in text, text
