"""A cluster across simulated hosts (network namespaces on a bridge): every byte crosses a veth link.

Runs where root and ``ip netns`` exist; elsewhere each test is skipped with the one-line reason.
"""
from __future__ import annotations

import functools
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import pytest

from kvmesh import LLM, SamplingParams
from kvmesh.auth import TOKEN_ENV, generate_token
from kvmesh.bench.late_writes import PATHS, LateWritesConfig, run_one
from kvmesh.cluster.hosts import Hosts, can_create
from kvmesh.cluster.local_launcher import LocalCluster
from kvmesh.cluster.serve import STOP_BOUND_S
from kvmesh.metadata.block_index import read_holdings
from kvmesh.metadata.sealed_store import open_store
from kvmesh.metadata.keys import KeyLayout
from kvmesh.transfer.engine import mooncake_available
from tests.conftest import assert_same_kv
from tests.processes import still_running

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


@functools.cache
def reference_llm() -> LLM:
    """The single-node engine on the same weights; its cached KV is the KV-level oracle's reference."""
    return LLM("tiny-llama", num_kv_blocks=1024, progress=False)


def reference(prompts: list[list[int]]) -> list[list[int]]:
    return [o.token_ids for o in reference_llm().generate(prompts, GREEDY, use_tqdm=False)]


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc's children lists), deepest last."""
    found, queue = [], [pid]
    while queue:
        parent = queue.pop(0)
        try:
            for task in os.listdir(f"/proc/{parent}/task"):
                with open(f"/proc/{parent}/task/{task}/children") as f:
                    kids = [int(k) for k in f.read().split()]
                found += kids
                queue += kids
        except OSError:
            continue
    return found


def _argv_after(pid: int, flag: str) -> list[str]:
    """The values following ``flag`` in ``pid``'s command line (none when it has gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().decode(errors="replace").split("\0")
    except OSError:
        return []
    return [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == flag]


def processes_matching(*parts: str) -> list[int]:
    """Pids whose command line contains every one of ``parts`` (read from /proc, no pgrep needed)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if all(p in cmdline for p in parts):
            pids.append(int(entry))
    return pids


def wait_until(predicate, timeout_s: float = 60.0, what: str = "condition", poll_s: float = 0.05) -> None:
    """``poll_s``: the pause between checks (a check that starts a process should not crowd out what it waits for)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(poll_s)


def start_router(hosts: Hosts, cluster: LocalCluster, stderr) -> tuple[subprocess.Popen, str]:
    """``kvmesh router`` alone on host 1, learning the model from the nodes, its stderr into the file ``stderr``;
    returns it and its HTTP base URL."""
    h1 = hosts[1]
    proc = subprocess.Popen([*h1.exec_prefix, sys.executable, "-m", "kvmesh.cli", "router", "--etcd",
                             cluster.etcd_endpoint, "--cluster", cluster.cluster, "--host", h1.address,
                             "--http-port", "0", "--grpc-port", "0"],
                            stdout=subprocess.PIPE, stderr=stderr, text=True,
                            env={**os.environ, TOKEN_ENV: cluster.token})
    info = json.loads(proc.stdout.readline())
    return proc, info["http"]


def complete(base_url: str, prompt_ids: list[int]) -> dict:
    body = json.dumps({"model": "tiny-llama", "prompt": prompt_ids, "max_tokens": 8, "temperature": 0,
                       "ignore_eos": True}).encode()
    req = urllib.request.Request(f"{base_url}/completions", body, {"Content-Type": "application/json"})
    with _NO_PROXY.open(req, timeout=60) as r:
        return json.loads(r.read())


def start_etcd(host, token: str) -> tuple[subprocess.Popen, str]:
    """``kvmesh etcd`` alone on ``host`` (with authentication: its credentials derived from ``token``); returns it
    and its advertised endpoint."""
    proc = subprocess.Popen([*host.exec_prefix, sys.executable, "-m", "kvmesh.cli", "etcd", "--host", "0.0.0.0",
                             "--port", "2379"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env={**os.environ, TOKEN_ENV: token})
    return proc, json.loads(proc.stdout.readline())["etcd"]


def test_three_hosts_parity_and_cross_host_reuse(hosts):
    """etcd + router on host 1 (each run alone, as on separate machines), a prefill node on host 2, a decode
    node on host 3; etcd stops cleanly on SIGTERM."""
    placement = {"prefill-0": 2, "decode-0": 3}
    args = ["--transfer-backend", BACKEND, "--kv-placement", "threshold:0"]
    token = generate_token()
    etcd, endpoint = start_etcd(hosts[1], token)
    assert endpoint == f"{hosts[1].address}:2379"  # 0.0.0.0 advertised as the address routing out of host 1
    below = descendants(etcd.pid)  # ours: the etcd server `kvmesh etcd` started (no other job's process)
    data_dirs = {os.path.dirname(arg) for pid in below for arg in _argv_after(pid, "--data-dir")}
    assert data_dirs, "no etcd data dir among the processes of kvmesh etcd"
    try:
        _three_hosts(hosts, endpoint, placement, args, token)
    finally:
        etcd.terminate()
        assert etcd.wait(timeout=30) == 0
    assert not [d for d in data_dirs if os.path.exists(d)], "etcd's data dir outlived kvmesh etcd"
    assert below and not [pid for pid in below if still_running(pid)], "etcd outlived kvmesh etcd"


def _three_hosts(hosts, endpoint: str, placement: dict, args: list[str], token: str) -> None:
    with LocalCluster(1, 1, etcd=endpoint, hosts=hosts, placement=placement, node_args=args,
                      cluster="hosts3", cluster_token=token) as cluster:
        assert cluster.etcd_endpoint.startswith(hosts[1].address)
        store = open_store(cluster.etcd_endpoint, cluster.token)
        records, _ = store.get_prefix(KeyLayout("hosts3").nodes_prefix)
        assert len(records) == 2
        for rec in records:  # what the nodes publish is their host's address, never loopback
            assert b"127.0.0.1" not in rec.value
        store.close()
        prompts = [prompt(i, n) for i, n in enumerate((70, 100, 40))]
        out = cluster.client("decode-0").generate_many(prompts, GREEDY)
        assert [c.error for c in out] == [""] * 3
        assert [c.token_ids for c in out] == reference(prompts)
        assert all(c.stats.tokens_from_prefill_node > 0 for c in out)  # KV came from host 2
        for p in prompts:  # ... into the right slots of decode-0's block tables
            assert_same_kv(cluster.client("decode-0"), reference_llm(), p, min_blocks=(len(p) - 1) // 16)
        prefill_stats = cluster.client("prefill-0").stats(check=True)
        decode_stats = cluster.client("decode-0").stats(check=True)
        assert prefill_stats["bytes_sent"] > 0 and decode_stats["bytes_received"] == prefill_stats["bytes_sent"]
        assert prefill_stats["bytes_sent_shared_memory"] == 0  # other hosts' memory is never shared
        router_log = tempfile.TemporaryFile("w+")
        router, url = start_router(hosts, cluster, router_log)
        try:
            shared = prompt(7, 96)
            first = complete(url, shared + prompt(8, 20))
            second = complete(url, shared + prompt(9, 30))
            assert first["choices"][0]["text"] and second["choices"][0]["text"]
            assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= 80  # the shared prefix, reused
        finally:
            router.terminate()
            try:  # a SIGTERM'd router exits cleanly (one that cannot prints every thread's stack and exits 1)
                code = router.wait(timeout=STOP_BOUND_S + 15)
                router_log.seek(0)
                assert code == 0, f"the router exited with {code}: {router_log.read()[-6000:]}"
            finally:
                if router.poll() is None:  # never leave it behind, even when the assertion fails
                    router.kill()
                    router.wait()
                router_log.close()


def test_a_host_link_going_down_and_coming_back(hosts):
    """Host 2's link goes down mid-run: nothing hangs, its index entries vanish with its lease, it re-joins."""
    placement = {"etcd": 1, "prefill-0": 2, "decode-0": 3}
    args = ["--transfer-backend", BACKEND, "--kv-placement", "threshold:0", "--lease-ttl", "3",
            "--prefill-timeout", "2"]
    with LocalCluster(1, 1, hosts=hosts, placement=placement, node_args=args, cluster="linkdown") as cluster:
        client = cluster.client("decode-0")
        prompts = [prompt(100 + i, 80) for i in range(12)]
        want = reference(prompts)
        assert [c.token_ids for c in client.generate_many(prompts[:4], GREEDY)] == want[:4]
        store = open_store(cluster.etcd_endpoint, cluster.token)
        keys = KeyLayout("linkdown")

        def held_by_prefill() -> int:
            nodes = read_holdings(store, keys).table.nodes
            return len(nodes["prefill-0"].blocks) if "prefill-0" in nodes else 0

        def registered() -> set[str]:
            records, _ = store.get_prefix(keys.nodes_prefix)
            return {keys.parse_node(kv.key) for kv in records}

        wait_until(lambda: held_by_prefill() > 0, 30, "host 2 to publish its blocks")  # publication is asynchronous
        hosts.link_down(2)
        try:
            out = client.generate_many(prompts[4:8], GREEDY, timeout_s=60)  # must not hang
            assert all(c.token_ids == w or c.error for c, w in zip(out, want[4:8]))
            assert all(not c.error for c in out)  # the decode node computed what host 2 could not send
            assert all(c.stats.tokens_from_prefill_node == 0 and c.stats.tokens_computed >= 64 for c in out)
            wait_until(lambda: held_by_prefill() == 0 and "prefill-0" not in registered(), 30,
                       "host 2's lease to expire")
        finally:
            hosts.link_up(2)
        wait_until(lambda: "prefill-0" in registered(), 60, "host 2 to re-join")
        out = client.generate_many(prompts[8:], GREEDY, timeout_s=60)
        assert [c.token_ids for c in out] == want[8:]
        for p in prompts[8:]:  # host 2's KV again, in the right slots
            assert_same_kv(client, reference_llm(), p, min_blocks=4)
        wait_until(lambda: held_by_prefill() > 0, 30, "host 2 to publish again")
        for node_id in ("prefill-0", "decode-0"):
            cluster.client(node_id).stats(check=True)
        store.close()


class RayNode:
    """``ray start --block`` inside a host: terminating it stops every Ray process of that node."""

    def __init__(self, host, temp_dir: str, head: str | None, resources: dict, env: dict):
        cmd = [*host.exec_prefix, os.path.join(os.path.dirname(sys.executable), "ray"), "start", "--block",
               "--node-ip-address", host.address, "--temp-dir", temp_dir, "--num-cpus", "2",
               "--resources", json.dumps(resources), "--disable-usage-stats"]
        cmd += ["--address", head] if head else ["--head", "--port", "6390", "--include-dashboard", "false"]
        self.log = tempfile.TemporaryFile()  # what `ray start` said, for the message if it never comes up
        self.env = env
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)

    def joined(self, host, address: str, num_nodes: int) -> bool:
        """Whether the cluster at ``address`` has ``num_nodes`` alive; raises (with its output) if this node's
        ``ray start`` exited instead."""
        if self.proc.poll() is not None:
            self.log.seek(0)
            tail = self.log.read().decode(errors="replace")[-2000:]
            raise AssertionError(f"ray start exited ({self.proc.returncode}): {tail}")
        return alive_ray_nodes(host, address, self.env) >= num_nodes

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=60)
        self.log.close()


RAY_START_TIMEOUT_S = 300


def alive_ray_nodes(host, address: str, env: dict) -> int:
    """Ray nodes alive in the cluster at ``address`` (0 while its GCS does not answer yet)."""
    ip, port = address.split(":")
    try:
        socket.create_connection((ip, int(port)), timeout=2).close()
    except OSError:
        return 0
    code = ("import ray; ray.init(address=%r, log_to_driver=False); "
            "print(sum(n['Alive'] for n in ray.nodes()))" % address)
    try:
        res = subprocess.run([*host.exec_prefix, sys.executable, "-c", code], capture_output=True, text=True,
                             env=env, timeout=60)
    except subprocess.TimeoutExpired:
        return 0
    lines = res.stdout.strip().splitlines()
    return int(lines[-1]) if res.returncode == 0 and lines and lines[-1].isdigit() else 0


@pytest.mark.timeout(2 * RAY_START_TIMEOUT_S + 300)
def test_kvmesh_launch_on_a_ray_cluster_spanning_two_hosts(hosts, ray_auth_env):
    """Ray head on host 1, a worker on host 2; ``kvmesh launch`` puts the prefill node on one and the decode
    node on the other, each advertising its own host's address, and serves a request; ``--stop`` cleans up."""
    pytest.importorskip("ray")
    h1, h2 = hosts[1], hosts[2]
    address = f"{h1.address}:6390"
    temp = f"/tmp/kvr{os.getpid()}"  # short: Ray's unix socket paths live below it
    env = {**os.environ, **ray_auth_env}  # the suite's own token: nothing from an earlier Ray run in HOME
    head = RayNode(h1, f"{temp}-h1", None, {"prefill_host": 1}, env)
    worker = None
    launch = None
    try:
        # Room for a loaded machine: a Ray head's start-up has taken over 120 s under the full suite.
        wait_until(lambda: head.joined(h1, address, 1), RAY_START_TIMEOUT_S, "the Ray head", poll_s=1.0)
        worker = RayNode(h2, f"{temp}-h2", address, {"decode_host": 1}, env)
        wait_until(lambda: worker.joined(h1, address, 2), RAY_START_TIMEOUT_S, "the Ray worker to join", poll_s=1.0)
        launch = subprocess.Popen(
            [*h1.exec_prefix, sys.executable, "-m", "kvmesh.cli", "launch", "--address", address, "--model",
             "tiny-llama", "--placement", "prefill=prefill_host", "--placement", "decode=decode_host",
             "--cluster", "rayhosts", "--host", h1.address, "--http-port", "0", "--grpc-port", "0",
             "--cpus-per-node", "0.5"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
        placed = json.loads(launch.stdout.readline())
        assert placed["nodes"] == {"prefill-0": h1.address, "decode-0": h2.address}
        assert placed["etcd"].split(":")[0] in (h1.address, h2.address)  # etcd advertises its Ray node's IP
        url = json.loads(launch.stdout.readline())["http"]
        ids = prompt(42, 90)
        body = complete(url, ids)
        assert body["choices"][0]["text"] and body["usage"]["completion_tokens"] == 8
        launch.terminate()
        launch.wait(timeout=60)
        stop = subprocess.run([*h1.exec_prefix, sys.executable, "-m", "kvmesh.cli", "launch", "--address", address,
                               "--stop"], capture_output=True, text=True, env=env, timeout=120)
        assert all(name in stop.stderr for name in ("etcd", "prefill-0", "decode-0")), stop.stderr
        assert not processes_matching("--listen-client-urls", placed["etcd"]), "launch --stop left etcd running"
    finally:
        if launch is not None and launch.poll() is None:
            launch.kill()
        for node in (worker, head):
            if node is not None:
                node.stop()
        for suffix in ("-h1", "-h2"):
            shutil.rmtree(temp + suffix, ignore_errors=True)
    assert not processes_matching(temp), "Ray processes of this test are still running"


TINY_LATE = LateWritesConfig(model="tiny-llama", prefix_tokens=992, local_tokens=600, link_mbit=0.5, timeout_s=1.0,
                             num_requests=15, far_every=3, num_kv_blocks=160, quiet_rounds=25)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("backend", ["zmq"] + (["mooncake"] if BACKEND == "mooncake" else []))
def test_a_push_that_outlives_its_requester_never_lands_in_reused_blocks(hosts, backend, path, monkeypatch):
    """The requester (host 3: a small pool, a 0.5 Mbit/s link) gives up on 62-block pushes after 1 s and keeps
    serving requests that reuse its blocks while those pushes drain into its host; Mooncake's own bound on a
    batch (5 s) ends the writer's part before the bytes stop arriving. Every answer equals the single-node
    engine's, none fails, and nothing stays fenced once the link is quiet (``kvmesh bench late-writes``)."""
    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "5")
    r = run_one(hosts, backend, path, TINY_LATE)
    assert r["given_up"] >= 2, r  # the pushes really were given up (else this proves nothing)
    assert (r["differ"], r["failed"], r["kv_mismatched"]) == (0, 0, 0), r
    assert r["kv_checked"] >= TINY_LATE.num_kv_blocks // 4, r  # the oracle read back much of what the pool caches
    assert r["requests"] >= TINY_LATE.num_requests and r["tokens_reused_local"] > 0
