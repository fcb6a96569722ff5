"""``kvmesh bench metadata``: the global block index against a real etcd.

Publish throughput (batched transactions vs one put per block), lookup latency of
128- and 2,048-block chains through the mirror and through direct reads,
publish-to-visible latency on another process's mirror, and etcd's memory and
database size per million block keys (extrapolated from ``--keys`` keys).
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from tqdm import tqdm

from kvmesh.bench.report import machine, print_table, time_call, write_json
from kvmesh.kv.block_hash import hash_blocks, root_hash
from kvmesh.metadata.block_index import BlockIndex, BlockPublisher
from kvmesh.metadata.embedded_etcd import EmbeddedEtcd
from kvmesh.metadata.etcd_store import EtcdStore
from kvmesh.metadata.store import KeyValue

_WATCHER = """
import json, sys, time
from kvmesh.kv.block_hash import hash_blocks, root_hash
from kvmesh.metadata.block_index import BlockIndex
from kvmesh.metadata.etcd_store import EtcdStore
index = BlockIndex(EtcdStore(sys.argv[1]), "bench", "ns")
index.mirror.wait_healthy(10)
print("ready", flush=True)
for line in sys.stdin:
    salt = line.strip()
    first = hash_blocks(root_hash(salt.encode()), list(range(16)), 16)
    while not index.lookup(first):
        time.sleep(0.0002)
    print(json.dumps(time.time()), flush=True)
"""


def _chain(salt: str, n: int) -> list[bytes]:
    return hash_blocks(root_hash(salt.encode()), list(range(n * 16)), 16)


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _etcd_usage(server: EmbeddedEtcd, store: EtcdStore) -> tuple[int, int]:
    """(etcd's resident memory, its database size). etcd runs under its keeper (``metadata/etcd_keeper.py``):
    the server is the keeper's child, whose memory is what grows with the keys."""
    keeper = server.pid
    children = Path(f"/proc/{keeper}/task/{keeper}/children").read_text().split()
    rss = sum(_rss_bytes(int(pid)) for pid in children)
    if not children:
        raise RuntimeError(f"etcd's keeper (pid {keeper}) has no child process to measure")
    return rss, store._client.status().db_size


def run(json_path: str | None, etcd_endpoint: str | None = None, num_keys: int = 100_000) -> dict:
    server = None if etcd_endpoint else EmbeddedEtcd().start()
    endpoint = etcd_endpoint or server.endpoint
    store = EtcdStore(endpoint, timeout_s=30)
    res: dict = {"machine": machine(), "etcd": endpoint}
    lease = store.grant_lease(600)
    publisher = BlockPublisher(store, "bench", "ns", "node-a")
    publisher.set_lease(lease)
    index = BlockIndex(store, "bench", "ns")
    index.mirror.wait_healthy(10)
    try:
        # Publish throughput.
        hashes = _chain("tput", 8192)
        start = time.perf_counter()
        publisher.publish(hashes)
        while not publisher.flush():
            pass
        batched = len(hashes) / (time.perf_counter() - start)
        singles = _chain("single", 300)
        start = time.perf_counter()
        for h in singles:
            store.put_many([KeyValue(publisher.keys.block("ns", h, "node-b"), b"\x91\x00")], lease)
        one_by_one = len(singles) / (time.perf_counter() - start)
        res["publish_blocks_per_s"] = {"batched": batched, "one_by_one": one_by_one, "ratio": batched / one_by_one}

        # Lookups.
        res["lookup_us"] = {}
        for n in (128, 2048):
            chain = hashes[:n]
            while index.lookup(chain).get("node-a") != n:
                time.sleep(0.01)
            res["lookup_us"][str(n)] = {
                "mirror": time_call(lambda c=chain: index.lookup(c), 7, 200) * 1e6,
                "direct": time_call(lambda c=chain: index.lookup_direct(c), 5, 3) * 1e6,
            }

        # Publish-to-visible on another process's mirror.
        watcher = subprocess.Popen([sys.executable, "-c", _WATCHER, endpoint], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, text=True)
        try:
            assert watcher.stdout.readline().strip() == "ready"
            delays = []
            for i in range(15):
                salt = f"visible-{i}"
                watcher.stdin.write(salt + "\n")
                watcher.stdin.flush()
                time.sleep(0.05)
                sent = time.time()
                publisher.publish(_chain(salt, 1))
                publisher.flush()
                delays.append(json.loads(watcher.stdout.readline()) - sent)
            res["publish_to_visible_ms"] = {"p50": statistics.median(delays) * 1e3, "max": max(delays) * 1e3}
        finally:
            watcher.kill()
            watcher.wait()

        # etcd's memory per million keys.
        if server is not None:
            rss0, db0 = _etcd_usage(server, store)
            keys_hashes = _chain("mem", num_keys)
            for i in tqdm(range(0, num_keys, 4096), desc="filling etcd", leave=False):
                publisher.publish(keys_hashes[i : i + 4096])
                while not publisher.flush():
                    pass
            rss1, db1 = _etcd_usage(server, store)
            scale = 1_000_000 / num_keys
            # bbolt grows its file in steps: a few thousand keys may fit in space it already has (0 per key)
            res["etcd_memory"] = {"keys": num_keys, "keys_visible": index.lookup_direct(keys_hashes).get("node-a", 0),
                                  "rss_bytes_per_key": (rss1 - rss0) / num_keys,
                                  "db_bytes_per_key": (db1 - db0) / num_keys,
                                  "rss_mb_per_million_keys": (rss1 - rss0) * scale / 2**20,
                                  "db_mb_per_million_keys": (db1 - db0) * scale / 2**20}
    finally:
        publisher.close()
        index.close()
        store.close()
        if server is not None:
            server.cleanup()

    p, lk = res["publish_blocks_per_s"], res["lookup_us"]
    rows = [["publish, batched transactions", f"{p['batched']:,.0f} blocks/s", f"{p['ratio']:.0f}x one-by-one"],
            ["publish, one put per block", f"{p['one_by_one']:,.0f} blocks/s", ""]]
    for n, v in lk.items():
        rows.append([f"lookup {n}-block chain, mirror", f"{v['mirror']:.1f} us", ""])
        rows.append([f"lookup {n}-block chain, direct", f"{v['direct'] / 1e3:.2f} ms", ""])
    v = res["publish_to_visible_ms"]
    rows.append(["publish -> visible in another process", f"{v['p50']:.1f} ms p50", f"max {v['max']:.1f} ms"])
    if "etcd_memory" in res:
        mem = res["etcd_memory"]
        rows.append(["etcd RSS per million block keys", f"{mem['rss_mb_per_million_keys']:.0f} MB",
                     f"from {mem['keys']:,} keys"])
        rows.append(["etcd db size per million block keys", f"{mem['db_mb_per_million_keys']:.0f} MB", ""])
    print_table("global block index on etcd", ["measure", "value", "note"], rows)
    write_json(json_path, res)
    return res
