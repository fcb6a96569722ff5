"""``kvmesh bench metadata``: the global block index against a real etcd.

Publish throughput (holdings records vs one transaction per block, the old index's worst case), lookup latency of
128- and 2,048-block chains through the mirror and through direct reads,
and publish-to-visible latency on another process's mirror. etcd's memory and database
size per cached block, at fleet scale, are ``kvmesh bench index``'s.
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time

from kvmesh.bench.index_baseline import KeyPerBlockPublisher
from kvmesh.bench.report import machine, print_table, time_call, write_json
from kvmesh.kv.block_hash import hash_blocks, root_hash
from kvmesh.metadata.block_index import BlockIndex, BlockPublisher
from kvmesh.metadata.embedded_etcd import EmbeddedEtcd
from kvmesh.metadata.etcd_store import EtcdStore

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


def run(json_path: str | None, etcd_endpoint: str | None = None) -> dict:
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
        single = KeyPerBlockPublisher(store, "bench", "other-ns", "node-b")
        single.set_lease(lease)
        start = time.perf_counter()
        for h in singles:  # the worst case of the one-key-per-block index it replaced: one transaction each
            single.update_hashes([(h, 0)])
            single.flush()
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

    finally:
        publisher.close()
        index.close()
        store.close()
        if server is not None:
            server.cleanup()

    p, lk = res["publish_blocks_per_s"], res["lookup_us"]
    rows = [["publish 8,192 blocks (holdings records)", f"{p['batched']:,.0f} blocks/s",
             f"{p['ratio']:.0f}x one transaction per block"],
            ["publish, a key and a transaction per block", f"{p['one_by_one']:,.0f} blocks/s", "the old index, at worst"]]
    for n, v in lk.items():
        rows.append([f"lookup {n}-block chain, mirror", f"{v['mirror']:.1f} us", ""])
        rows.append([f"lookup {n}-block chain, direct", f"{v['direct'] / 1e3:.2f} ms", ""])
    v = res["publish_to_visible_ms"]
    rows.append(["publish -> visible in another process", f"{v['p50']:.1f} ms p50", f"max {v['max']:.1f} ms"])
    print_table("global block index on etcd", ["measure", "value", "note"], rows)
    write_json(json_path, res)
    return res
