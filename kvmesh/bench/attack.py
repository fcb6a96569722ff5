"""``kvmesh bench attack``: each attack of docs/security.md against a real cluster; every one must fail.

A 1 prefill + 1 decode cluster (tiny preset, real etcd with authentication, real
processes) behind a router whose HTTP front end requires an API key. The attackers:
a process that can write to etcd but holds no cluster secret (it was given etcd's
credentials: the worst case), a process that reaches every port but has neither, a
sniffed frame, and a hostile HTTP client. Per attack: attempts, successes (must be
0) and whether well-behaved clients were still answered right after.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from contextlib import contextmanager

import zmq

from kvmesh.auth import REFUSED, ClusterAuth
from kvmesh.bench.report import machine, print_table, write_json

API_KEY = "attack-bench-key"  # the attacking client's (where an attack needs a key at all)
OTHER_KEY = "attack-bench-other-key"  # another tenant: whether the service kept answering is asked with it
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class _Listener:
    """A socket an attacker controls: counts every frame that reaches it (plain ZMQ, no keys)."""

    def __init__(self):
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.linger = 0
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"127.0.0.1:{self.port}"

    def frames(self) -> int:
        n = 0
        while self.sock.poll(0):
            self.sock.recv_multipart()
            n += 1
        return n

    def close(self) -> None:
        self.sock.close()


class AttackRun:
    def __init__(self, cluster, router, http: str):
        self.cluster, self.router, self.http = cluster, router, http
        self.results: dict[str, dict] = {}
        self.keys = None

    # ---- helpers ------------------------------------------------------------------------------------
    def _http(self, path: str, body: dict | None = None, key: str | None = API_KEY) -> tuple[int, dict]:
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
        request = urllib.request.Request(self.http + path, data=data, headers=headers)
        try:
            with _NO_PROXY.open(request, timeout=120) as r:
                return r.status, json.loads(r.read() or b"{}") if path != "/metrics" else {}
        except urllib.error.HTTPError as e:
            return e.code, {}

    def service_answers(self, n: int = 4) -> bool:
        """Other clients' requests (another tenant's key: the front end, the router, a decode node and a prefill
        node) still work."""
        for i in range(n):
            status, out = self._http("/v1/completions", {"prompt": f"attack check {i} " * 8, "max_tokens": 4,
                                                         "temperature": 0}, key=OTHER_KEY)
            if status != 200 or not out.get("choices"):
                return False
        return True

    def record(self, name: str, attempted: int, succeeded: int, detail: str) -> None:
        self.results[name] = {"attempted": attempted, "succeeded": succeeded, "service_answered": self.service_answers(),
                              "detail": detail}

    @contextmanager
    def etcd_writer(self):
        """etcd access without the cluster secret: etcd's credentials, but not the key that seals values."""
        from kvmesh.metadata.etcd_store import EtcdStore

        store = EtcdStore(self.cluster.etcd_endpoint, token=self.cluster.token)
        try:
            yield store
        finally:
            store.close()

    def _decode_record(self):
        return self.router.directory.nodes["decode-0"]

    # ---- etcd: records, pins, reads -----------------------------------------------------------------
    def forged_node_record(self) -> None:
        from kvmesh.metadata.keys import KeyLayout
        from kvmesh.metadata.store import KeyValue

        fake = _Listener()
        genuine = self._decode_record()
        record = dataclasses.replace(genuine, node_id="decode-evil", request_endpoint=fake.endpoint,
                                     side_channel=fake.endpoint)
        with self.etcd_writer() as etcd:
            etcd.put_many([KeyValue(KeyLayout(self.cluster.cluster).node("decode-evil"), record.encode())])
            answered = self.service_answers(8)  # round-robin-free: the cache-aware router picks among all
            etcd.delete_many([KeyLayout(self.cluster.cluster).node("decode-evil")])
        prompts = fake.frames()
        fake.close()
        self.record("forged_node_record", 1, int(prompts > 0 or "decode-evil" in self.router.directory.nodes),
                    f"prompts that reached the forged node: {prompts}; requests answered: {answered}")

    def rewritten_transfer_endpoint(self) -> None:
        from kvmesh.metadata.keys import KeyLayout
        from kvmesh.metadata.store import KeyValue

        thief = _Listener()
        genuine = self._decode_record()
        moved = dataclasses.replace(genuine, transfer_endpoint=thief.endpoint, side_channel=thief.endpoint)
        with self.etcd_writer() as etcd:
            etcd.put_many([KeyValue(KeyLayout(self.cluster.cluster).node("decode-0"), moved.encode())])
            self.service_answers(6)  # prompts the prefill node computes and pushes to decode-0
        stolen = thief.frames()
        thief.close()
        believed = self._decode_record().transfer_endpoint == thief.endpoint
        self.record("rewritten_transfer_endpoint", 1, int(stolen > 0 or believed),
                    f"frames that reached the thief: {stolen}")

    def deleted_record(self) -> None:
        from kvmesh.metadata.keys import KeyLayout

        with self.etcd_writer() as etcd:
            etcd.delete_many([KeyLayout(self.cluster.cluster).node("decode-0")])
        gone = "decode-0" not in self.router.directory.nodes
        self.record("deleted_record_releases_quarantine", 1, int(gone),
                    f"deletes ignored by the router's directory: {self.router.directory.num_deletes_ignored}")

    def malformed_record(self) -> None:
        from kvmesh.metadata.keys import KeyLayout
        from kvmesh.metadata.sealed_store import SealedStore
        from kvmesh.metadata.store import KeyValue

        bad = dataclasses.replace(self._decode_record(), node_id="decode-bad", request_endpoint="tcp://127.0.0.1:5")
        with self.etcd_writer() as etcd:  # even sealed (an insider's bug, not an outsider): dropped
            sealed = SealedStore(etcd, ClusterAuth(self.cluster.token).record_key)
            sealed.put_many([KeyValue(KeyLayout(self.cluster.cluster).node("decode-bad"), bad.encode())])
            started = time.monotonic()
            answered = self.service_answers(6)
            took = time.monotonic() - started
            sealed.delete_many([KeyLayout(self.cluster.cluster).node("decode-bad")])
        self.record("malformed_record", 1, int("decode-bad" in self.router.directory.nodes or not answered),
                    f"6 requests answered in {took:.1f} s")

    def forged_pins(self) -> None:
        from kvmesh.metadata.keys import KeyLayout
        from kvmesh.metadata.records import PinRecord
        from kvmesh.metadata.store import KeyValue

        namespace = self.router.pin_registry.namespace
        with self.etcd_writer() as etcd:
            etcd.put_many([KeyValue(KeyLayout(self.cluster.cluster).pin(namespace, f"{i:032x}"),
                                    PinRecord([1 + j % 300 for j in range(512)], "flood").encode())
                           for i in range(32)])
            time.sleep(0.5)  # let the mirrors see them (they must drop them)
            applied = sum(1 for p in self.router.pins() if p.get("label") == "flood")
            etcd.delete_many([KeyLayout(self.cluster.cluster).pin(namespace, f"{i:032x}") for i in range(32)])
        status, _ = self._http("/admin/pins", {"tokens": [1 + i % 300 for i in range(900)]})  # > 1/4 of blocks
        self.record("pin_flood", 33, applied + int(status == 200),
                    f"forged pins believed: {applied}; oversized pin through the API: HTTP {status}")

    def read_etcd_without_credentials(self) -> None:
        from kvmesh.metadata.etcd_store import EtcdStore
        from kvmesh.metadata.keys import KeyLayout
        from kvmesh.metadata.store import StoreUnavailable

        store = EtcdStore(self.cluster.etcd_endpoint)
        try:
            store.get_prefix(KeyLayout(self.cluster.cluster).nodes_prefix)
            read = 1
        except StoreUnavailable:
            read = 0
        finally:
            store.close()
        self.record("read_etcd_without_credentials", 1, read, "node records, KV addresses, pins")

    # ---- channels -----------------------------------------------------------------------------------
    def _ask(self, endpoint: str, frame: bytes, channel: ClusterAuth, timeout_ms: int = 3000) -> bytes | None:
        from kvmesh.bench.chaos import ask_once

        return ask_once(endpoint, frame, channel, timeout_ms)

    def unauthenticated_frames(self) -> None:
        from kvmesh.node import messages as nm
        from kvmesh.wire import encode

        attempted = succeeded = 0
        for node in self.cluster.nodes.values():
            for endpoint in (node.info["requests"], node.info["side_channel"]):
                for channel in (ClusterAuth(""), ClusterAuth("guess")):
                    frame = channel.seal(encode(nm.GenerateRequest("outsider", [1, 2, 3], {"max_tokens": 1})))
                    attempted += 1
                    succeeded += self._ask(endpoint, frame, channel, 1000) is not None
        self.record("unauthenticated_frames", attempted, succeeded, "no CurveZMQ handshake without the secret")

    def replayed_generate_request(self) -> None:
        from kvmesh.node import messages as nm
        from kvmesh.wire import encode

        auth = self.cluster.auth
        frame = auth.seal(encode(nm.GenerateRequest("sniffed", [5, 6, 7], {"max_tokens": 2})))
        endpoint = self.cluster.nodes["decode-0"].info["requests"]
        first = self._ask(endpoint, frame, auth)  # the original, as its client sent it
        replies = [self._ask(endpoint, frame, auth) for _ in range(3)]  # replayed inside a valid channel
        replies += [self._ask(endpoint, frame, ClusterAuth("")) for _ in range(2)]  # or from outside
        succeeded = sum(1 for r in replies if r is not None and r != REFUSED)
        self.record("replayed_generate_request", len(replies), succeeded,
                    f"original answered: {first is not None and first != REFUSED}")

    # ---- the front end ------------------------------------------------------------------------------
    def front_end_without_key(self) -> None:
        paths = [("/v1/models", None), ("/v1/completions", {"prompt": "x", "max_tokens": 1}), ("/metrics", None),
                 ("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]}), ("/admin/pins", None)]
        codes = [self._http(p, b, key=k)[0] for p, b in paths for k in (None, "wrong-key")]
        self.record("front_end_without_key", len(codes), sum(c != 401 for c in codes), f"HTTP codes: {set(codes)}")

    def stop_string_flood(self) -> None:
        bodies = [{"prompt": "x", "max_tokens": 2, "stop": [f"s{i}" for i in range(20_000)]},
                  {"prompt": "x", "max_tokens": 2, "stop": ["y" * 100_000]},
                  {"prompt": "x", "max_tokens": 2, "stop_token_ids": list(range(20_000))}]
        codes = [self._http("/v1/completions", b)[0] for b in bodies]
        self.record("stop_string_flood", len(codes), sum(c != 400 for c in codes), f"HTTP codes: {codes}")

    def one_client_takes_every_slot(self) -> None:
        """A client opens more streams than its share; another client must still be served."""
        import http.client
        from urllib.parse import urlparse

        url = urlparse(self.http)
        body = json.dumps({"prompt": "hog " * 8, "max_tokens": 960, "stream": True, "ignore_eos": True})
        conns, statuses = [], []
        for _ in range(self.router.cfg.max_in_flight + 4):  # more than the whole router takes
            conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
            conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json",
                                                           "Authorization": f"Bearer {API_KEY}"})
            response = conn.getresponse()
            statuses.append(response.status)
            conns.append((conn, response))
        other = _other_client_answered(self.http)
        for conn, _ in conns:
            conn.close()
        self.record("one_client_takes_every_slot", len(statuses), int(not other),
                    f"{statuses.count(200)} streams admitted, {statuses.count(429)} refused (429); "
                    f"another client answered: {other}")

    def tiny_temperature(self) -> None:
        status, out = self._http("/v1/completions", {"prompt": "hello", "max_tokens": 4, "temperature": 1e-30})
        self.record("tiny_temperature", 1, int(status != 200), f"HTTP {status} (greedy below 1e-5)")

    def cross_tenant_cache_probe(self) -> None:
        prompt = "the other tenant's confidential system prompt " * 6

        def cached(salt: str) -> int:
            _, out = self._http("/v1/completions", {"prompt": prompt, "max_tokens": 1, "cache_salt": salt})
            return out.get("usage", {}).get("prompt_tokens_details", {}).get("cached_tokens", -1)

        cached("tenant-a")
        own = cached("tenant-a")
        seen = cached("tenant-b")
        self.record("cross_tenant_cache_probe", 1, int(seen != 0), f"tenant-a reuses {own}, tenant-b sees {seen}")

    def tier_file_symlink(self) -> None:
        import tempfile
        from pathlib import Path

        from kvmesh.kv.tiers.media import DiskLayout, DiskMedium

        with tempfile.TemporaryDirectory() as folder:
            victim = Path(folder) / "victim"
            victim.write_bytes(b"precious")
            (Path(folder) / "node.kvtier").symlink_to(victim)
            DiskMedium(Path(folder) / "node.kvtier", DiskLayout(b"r" * 16, 4096, 4)).close()
            changed = victim.read_bytes() != b"precious"
        self.record("tier_file_symlink", 1, int(changed), "a link planted where the disk tier's file goes")

    def mooncake_data_port(self) -> None:
        self.results["mooncake_data_port"] = {
            "attempted": 0, "succeeded": 0, "service_answered": True,
            "detail": "not defended: Mooncake's TCP data port takes reads and writes at raw addresses from anyone "
                      "who reaches it (upstream design); run it on a private network (docs/security.md)"}

    def run(self, progress: Callable[[str], None]) -> dict:
        for attack in (self.unauthenticated_frames, self.replayed_generate_request, self.read_etcd_without_credentials,
                       self.forged_node_record, self.rewritten_transfer_endpoint, self.deleted_record,
                       self.malformed_record, self.forged_pins, self.front_end_without_key, self.stop_string_flood,
                       self.one_client_takes_every_slot, self.tiny_temperature, self.cross_tenant_cache_probe,
                       self.tier_file_symlink, self.mooncake_data_port):
            progress(attack.__name__)
            attack()
        return self.results


def _other_client_answered(http: str) -> bool:
    """A request from a second API key (another tenant)."""
    request = urllib.request.Request(http + "/v1/completions",
                                     data=json.dumps({"prompt": "polite", "max_tokens": 2}).encode(),
                                     headers={"Content-Type": "application/json",
                                              "Authorization": f"Bearer {OTHER_KEY}"})
    try:
        with _NO_PROXY.open(request, timeout=120) as r:
            return r.status == 200
    except urllib.error.HTTPError:
        return False


@contextmanager
def attacked_cluster(max_in_flight: int = 16):
    """The cluster under attack: etcd (with authentication), 1 prefill + 1 decode node, a router and an HTTP
    front end that requires one of two API keys."""
    from kvmesh.cluster.api_keys import ApiKeys
    from kvmesh.cluster.http_server import start_http_server
    from kvmesh.cluster.local_launcher import LocalCluster
    from kvmesh.cluster.router import Router, RouterConfig

    with LocalCluster(1, 1, cluster="attack", node_args=["--num-kv-blocks", "128"]) as cluster:
        router = Router(RouterConfig(etcd=cluster.etcd_endpoint, cluster_token=cluster.token, cluster="attack",
                                     max_in_flight=max_in_flight))
        loop = asyncio.new_event_loop()
        ready, ports = threading.Event(), {}

        def serve() -> None:
            asyncio.set_event_loop(loop)
            ports["runner"], ports["http"] = loop.run_until_complete(start_http_server(
                router, "127.0.0.1", 0, token=ApiKeys([API_KEY, OTHER_KEY])))
            ready.set()
            loop.run_forever()

        threading.Thread(target=serve, daemon=True).start()
        ready.wait(60)
        try:
            yield cluster, router, f"http://127.0.0.1:{ports['http']}"
        finally:
            asyncio.run_coroutine_threadsafe(ports["runner"].cleanup(), loop).result(10)
            loop.call_soon_threadsafe(loop.stop)
            router.close()


def run(json_path: str | None = None) -> dict:
    from tqdm import tqdm

    with attacked_cluster() as (cluster, router, http):
        attacks = AttackRun(cluster, router, http)
        bar = tqdm(total=15, desc="attacks", unit="attack")
        results = attacks.run(lambda name: (bar.set_postfix_str(name), bar.update(1)))
        bar.close()
    rows = [[name, r["attempted"], r["succeeded"], r["service_answered"], r["detail"][:80]]
            for name, r in results.items()]
    print_table("attacks on a cluster (succeeded must be 0; the service must keep answering)",
                ["attack", "attempted", "succeeded", "service answered", "detail"], rows)
    out = {"machine": machine(), "attacks": results}
    write_json(json_path, out)
    return out
