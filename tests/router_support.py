"""The router test files' shared parts: one running cluster behind a router with both front ends, the
single-node reference, and small HTTP helpers."""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.error
import urllib.request

import pytest

from kvmesh import LLM, SamplingParams
from kvmesh.cluster.local_launcher import LocalCluster
from kvmesh.cluster.router import Router, RouterConfig

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def served():
    """A 1 prefill + 2 decode cluster behind a router with gRPC and HTTP on free ports."""
    from kvmesh.cluster.grpc_server import start_grpc_server
    from kvmesh.cluster.http_server import start_http_server

    with LocalCluster(1, 2, cluster="router") as cluster:
        router = Router(RouterConfig(etcd=cluster.etcd_endpoint, cluster_token=cluster.token, cluster="router", max_in_flight=64))
        grpc_server, grpc_port = start_grpc_server(router, "127.0.0.1:0")
        loop = asyncio.new_event_loop()
        started = threading.Event()
        ports: dict = {}

        def run_loop() -> None:
            asyncio.set_event_loop(loop)
            runner, ports["http"] = loop.run_until_complete(start_http_server(router, "127.0.0.1", 0))
            ports["runner"] = runner
            started.set()
            loop.run_forever()

        thread = threading.Thread(target=run_loop, daemon=True)
        thread.start()
        started.wait(30)
        yield {"router": router, "grpc": f"127.0.0.1:{grpc_port}", "http": f"http://127.0.0.1:{ports['http']}",
               "cluster": cluster}
        asyncio.run_coroutine_threadsafe(ports["runner"].cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        grpc_server.stop(grace=1)
        router.close()


@pytest.fixture(scope="module")
def reference():
    llm = LLM("tiny-llama", num_kv_blocks=512, progress=False)
    return lambda prompt, params=GREEDY: llm.generate(prompt, params, use_tqdm=False)[0]


def _post(url: str, body: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())



def aborted_counts(cluster) -> dict[str, int]:
    return {n: cluster.client(n).stats()["num_aborted"] for n, node in cluster.nodes.items() if node.role == "decode"}


