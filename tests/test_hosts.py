"""A cluster across simulated hosts (network namespaces on a bridge): every byte crosses a veth link.

Runs where root and ``ip netns`` exist; elsewhere each test is skipped with the one-line reason.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
import urllib.request

import pytest

from kvmesh import LLM, SamplingParams
from kvmesh.auth import TOKEN_ENV
from kvmesh.cluster.hosts import Hosts, can_create
from kvmesh.cluster.local_launcher import LocalCluster
from kvmesh.metadata.etcd_store import EtcdStore
from kvmesh.metadata.keys import KeyLayout
from kvmesh.transfer.engine import mooncake_available

BACKEND = "mooncake" if mooncake_available() else "zmq"
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@pytest.fixture(scope="module")
def hosts():
    ok, why = can_create()
    if not ok:
        pytest.skip(f"no simulated hosts here: {why}")
    pid = os.getpid()
    with Hosts(3, prefix=f"kt{pid % 100000}", subnet=f"10.79.{pid % 250}") as h:
        yield h


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(length)]


def reference(prompts: list[list[int]]) -> list[list[int]]:
    llm = LLM("tiny-llama", num_kv_blocks=1024, progress=False)
    return [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def wait_until(predicate, timeout_s: float = 60.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def start_router(hosts: Hosts, cluster: LocalCluster) -> tuple[subprocess.Popen, str]:
    """``kvmesh router`` alone on host 1, learning the model from the nodes; returns it and its HTTP base URL."""
    h1 = hosts[1]
    proc = subprocess.Popen([*h1.exec_prefix, sys.executable, "-m", "kvmesh.cli", "router", "--etcd",
                             cluster.etcd_endpoint, "--cluster", cluster.cluster, "--host", h1.address,
                             "--http-port", "0", "--grpc-port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env={**os.environ, TOKEN_ENV: cluster.token})
    info = json.loads(proc.stdout.readline())
    return proc, info["http"]


def complete(base_url: str, prompt_ids: list[int]) -> dict:
    body = json.dumps({"model": "tiny-llama", "prompt": prompt_ids, "max_tokens": 8, "temperature": 0,
                       "ignore_eos": True}).encode()
    req = urllib.request.Request(f"{base_url}/completions", body, {"Content-Type": "application/json"})
    with _NO_PROXY.open(req, timeout=60) as r:
        return json.loads(r.read())


def test_three_hosts_parity_and_cross_host_reuse(hosts):
    """etcd + router on host 1, a prefill node on host 2, a decode node on host 3."""
    placement = {"etcd": 1, "prefill-0": 2, "decode-0": 3}
    args = ["--transfer-backend", BACKEND, "--local-prefill-tokens", "0"]
    with LocalCluster(1, 1, hosts=hosts, placement=placement, node_args=args, cluster="hosts3") as cluster:
        assert cluster.etcd_endpoint.startswith(hosts[1].address)
        store = EtcdStore(cluster.etcd_endpoint)
        records, _ = store.get_prefix(KeyLayout("hosts3").nodes_prefix)
        assert len(records) == 2
        for rec in records:  # what the nodes publish is their host's address, never loopback
            assert b"127.0.0.1" not in rec.value
        store.close()
        prompts = [prompt(i, n) for i, n in enumerate((70, 100, 40))]
        out = cluster.client("decode-0").generate_many(prompts, GREEDY)
        assert [c.error for c in out] == [""] * 3
        assert [c.token_ids for c in out] == reference(prompts)
        assert all(c.stats["tokens_from_prefill_node"] > 0 for c in out)  # KV came from host 2
        prefill_stats = cluster.client("prefill-0").stats(check=True)
        decode_stats = cluster.client("decode-0").stats(check=True)
        assert prefill_stats["bytes_sent"] > 0 and decode_stats["bytes_received"] == prefill_stats["bytes_sent"]
        router, url = start_router(hosts, cluster)
        try:
            shared = prompt(7, 96)
            first = complete(url, shared + prompt(8, 20))
            second = complete(url, shared + prompt(9, 30))
            assert first["choices"][0]["text"] and second["choices"][0]["text"]
            assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= 80  # the shared prefix, reused
        finally:
            router.terminate()
            router.wait(timeout=30)


def test_a_host_link_going_down_and_coming_back(hosts):
    """Host 2's link goes down mid-run: nothing hangs, its index entries vanish with its lease, it re-joins."""
    placement = {"etcd": 1, "prefill-0": 2, "decode-0": 3}
    args = ["--transfer-backend", BACKEND, "--local-prefill-tokens", "0", "--lease-ttl", "3",
            "--prefill-timeout", "2"]
    with LocalCluster(1, 1, hosts=hosts, placement=placement, node_args=args, cluster="linkdown") as cluster:
        client = cluster.client("decode-0")
        prompts = [prompt(100 + i, 80) for i in range(12)]
        want = reference(prompts)
        assert [c.token_ids for c in client.generate_many(prompts[:4], GREEDY)] == want[:4]
        store = EtcdStore(cluster.etcd_endpoint)
        keys = KeyLayout("linkdown")

        def held_by_prefill() -> int:
            entries, _ = store.get_prefix(keys.blocks_prefix)
            return sum(1 for kv in entries if kv.key.endswith("/prefill-0"))

        def registered() -> set[str]:
            records, _ = store.get_prefix(keys.nodes_prefix)
            return {keys.parse_node(kv.key) for kv in records}

        assert held_by_prefill() > 0
        hosts.link_down(2)
        try:
            out = client.generate_many(prompts[4:8], GREEDY, timeout_s=60)  # must not hang
            assert all(c.token_ids == w or c.error for c, w in zip(out, want[4:8]))
            assert all(not c.error for c in out)  # the decode node computed what host 2 could not send
            assert all(c.stats["tokens_from_prefill_node"] == 0 and c.stats["tokens_computed"] >= 64 for c in out)
            wait_until(lambda: held_by_prefill() == 0 and "prefill-0" not in registered(), 30,
                       "host 2's lease to expire")
        finally:
            hosts.link_up(2)
        wait_until(lambda: "prefill-0" in registered(), 60, "host 2 to re-join")
        out = client.generate_many(prompts[8:], GREEDY, timeout_s=60)
        assert [c.token_ids for c in out] == want[8:]
        wait_until(lambda: held_by_prefill() > 0, 30, "host 2 to publish again")
        for node_id in ("prefill-0", "decode-0"):
            cluster.client(node_id).stats(check=True)
        store.close()
