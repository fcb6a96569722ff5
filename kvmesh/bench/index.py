"""``kvmesh bench index``: the global block index at the scale of a fleet, on one machine.

N publishers (``BlockPublisher``s in this process, each on its own lease, speaking the real protocol
to a real etcd; no model) fill M cached blocks between them, then churn (each round, every node evicts
its oldest chain and caches a new one). Each node's chains share a system-prompt prefix with a few
other nodes (``--prefixes`` of them in the fleet), so a lookup finds several holders of different
lengths. K mirror processes (``BlockIndex``) follow the watch throughout; after the churn they look up
2,048-block chains (latency p50/p99, and the promise against the truth: blocks promised that the holder
does not have, and the other way round), a fresh mirror measures catching up (the newest snapshots plus
the log after them), and one publisher stops renewing its lease (how long until no mirror lists it).

Reported per size: etcd's resident memory and database size per cached block (after a compaction, as
an etcd run with ``--auto-compaction`` keeps itself), publish and churn throughput, lookups, catch-up.
The same workload runs against the one-key-per-block index (``bench/index_baseline.py``) at smaller
sizes, in the same run: ``baseline``.
"""
from __future__ import annotations

import json
import math
import random
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

from kvmesh.bench.index_fleet import FleetShape, fleet_truth
from kvmesh.bench.report import machine, print_table, write_json
from kvmesh.metadata.embedded_etcd import EmbeddedEtcd
from kvmesh.metadata.etcd_store import EtcdStore
from kvmesh.metadata.holdings import GONE

NAMESPACE, CLUSTER = "ns", "bench"
LONG_LEASE_S = 3600
# A mirror process: follows the index; answers JSON commands on stdin, one per line.
_MIRROR = """
import json, sys, time, resource
design, endpoint = sys.argv[1], sys.argv[2]
started = time.perf_counter()
from kvmesh.bench.index_fleet import FleetShape, chain_hashes
from kvmesh.metadata.etcd_store import EtcdStore
def rss_now():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()
rss_start = rss_now()
store = EtcdStore(endpoint, timeout_s=120)
if design == "holdings":
    from kvmesh.metadata.block_index import BlockIndex
    index = BlockIndex(store, "bench", "ns")
    holds = index.holds_any
else:
    from kvmesh.bench.index_baseline import KeyPerBlockIndex
    index = KeyPerBlockIndex(store, "bench", "ns")
    holds = index.holds_any
index.mirror.wait_healthy(600)
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    cmd = json.loads(line)
    if cmd["op"] == "wait":
        deadline = time.monotonic() + cmd["timeout_s"]
        while (index.num_blocks != cmd["blocks"] or index.mirror.revision < cmd["revision"]) \
                and time.monotonic() < deadline:
            time.sleep(0.01)
        print(json.dumps({"blocks": index.num_blocks, "revision": index.mirror.revision,
                          "since_start_s": time.perf_counter() - started}), flush=True)
    elif cmd["op"] == "lookup":
        shape = FleetShape(**cmd["shape"])
        out = []
        for chain in cmd["chains"]:
            hashes = chain_hashes(shape, *chain)
            t0 = time.perf_counter_ns()
            found = index.lookup(hashes)
            out.append([(time.perf_counter_ns() - t0) / 1e3, found])
        print(json.dumps(out), flush=True)
    elif cmd["op"] == "holds":
        print(json.dumps(holds(cmd["node"])), flush=True)
    elif cmd["op"] == "rss":
        print(json.dumps({"rss": rss_now() - rss_start, "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                          "table_bytes": getattr(index, "table_bytes", None)}), flush=True)
"""


class Mirror:
    """One mirror process and its command pipe."""

    def __init__(self, design: str, endpoint: str):
        self.proc = subprocess.Popen([sys.executable, "-c", _MIRROR, design, endpoint], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self._read()  # {"ready": true} once its mirror is healthy

    def _read(self):
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"a mirror process exited (status {self.proc.poll()})")
        return json.loads(line)

    def ask(self, **cmd):
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


@dataclass
class Measure:
    design: str
    nodes: int
    blocks: int
    etcd_rss_bytes_per_block: float
    etcd_db_bytes_per_block: float
    publish_blocks_per_s: float
    churn_changes_per_s: float
    lookup_p50_us: float
    lookup_p99_us: float
    lookups: int
    promised_not_held_blocks: int
    held_not_promised_blocks: int
    mirror_catch_up_s: float
    mirror_rss_bytes_per_block: float  # what following the index added to a fresh mirror's resident memory
    mirror_peak_rss_bytes_per_block: float  # its peak resident memory (catching up included), whole process
    mirror_table_bytes_per_block: float | None  # the mirror's block maps themselves (holdings only)
    dead_publisher_cleared_s: float
    lease_ttl_s: int
    fill_s: float
    churn_changes: int


def _publishers(design: str, store: EtcdStore, shape: FleetShape, lease_ttl_s: int) -> tuple[list, list[int]]:
    if design == "holdings":
        from kvmesh.metadata.block_index import BlockPublisher

        pubs = [BlockPublisher(store, CLUSTER, NAMESPACE, shape.node_id(n), start=False) for n in range(shape.nodes)]
    else:
        from kvmesh.bench.index_baseline import KeyPerBlockPublisher

        pubs = [KeyPerBlockPublisher(store, CLUSTER, NAMESPACE, shape.node_id(n)) for n in range(shape.nodes)]
    leases = [store.grant_lease(lease_ttl_s if n == 0 else LONG_LEASE_S) for n in range(shape.nodes)]
    for pub, lease in zip(pubs, leases):
        pub.set_lease(lease)
    return pubs, leases


def _send(design: str, pub, changes: list[tuple[int, int]]) -> None:
    if design == "holdings":
        pub.update_keys(changes)
    else:
        pub.update_hashes([(k.to_bytes(8, "little") + bytes(8), code) for k, code in changes])


def _flush_all(pubs: list) -> None:
    for pub in pubs:
        while not pub.flush():
            time.sleep(0.01)


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _etcd_rss_and_db(server: EmbeddedEtcd, store: EtcdStore) -> tuple[int, int]:
    """(etcd's resident memory, its database size). etcd runs under its keeper (``metadata/etcd_keeper.py``):
    the server is the keeper's child, whose memory is what grows with the keys."""
    keeper = server.pid
    children = Path(f"/proc/{keeper}/task/{keeper}/children").read_text().split()
    rss = sum(_rss_bytes(int(pid)) for pid in children)
    if not children:
        raise RuntimeError(f"etcd's keeper (pid {keeper}) has no child process to measure")
    return rss, store._client.status().db_size


def _etcd_usage(server: EmbeddedEtcd, store: EtcdStore) -> tuple[int, int]:
    """(etcd's resident memory, its database size) after a compaction and a defragmentation."""
    revision = store.get_prefix("/kvmesh-bench-none/")[1]
    try:
        store._client.compact(revision, physical=True)
    except Exception as e:  # compacted already (nothing written since): nothing to do
        if "compacted" not in str(e):
            raise
    store._client.defragment()
    return _etcd_rss_and_db(server, store)


def measure(design: str, shape: FleetShape, num_mirrors: int, churn: float, num_lookups: int,
            lease_ttl_s: int) -> Measure:
    server = EmbeddedEtcd(extra_args=("--quota-backend-bytes", str(8 * 2**30))).start()
    store = EtcdStore(server.endpoint, timeout_s=120)
    mirrors: list[Mirror] = []
    stop_keepalive = threading.Event()
    try:
        rss0, db0 = _etcd_usage(server, store)
        pubs, leases = _publishers(design, store, shape, lease_ttl_s)
        last_renewal = [time.monotonic()]

        def keep_alive() -> None:
            while not stop_keepalive.wait(max(0.2, lease_ttl_s / 5)):
                store.keepalive(leases[0])
                last_renewal[0] = time.monotonic()

        threading.Thread(target=keep_alive, daemon=True).start()
        _flush_all(pubs)  # the holdings publishers' first record: an empty snapshot
        mirrors = [Mirror(design, server.endpoint) for _ in range(num_mirrors)]
        fleet = fleet_truth(shape)
        t0 = time.perf_counter()
        for round_ in tqdm(range(shape.chains_per_node), desc=f"{design}: filling {shape.blocks:,} blocks",
                           leave=False):
            for n, pub in enumerate(pubs):
                _send(design, pub, [(k, 0) for k in fleet.add_chain(n)])
                pub.flush()
        _flush_all(pubs)
        fill_s, filled = time.perf_counter() - t0, fleet.num_blocks()
        num_rounds = max(1, math.ceil(churn * shape.chains_per_node))
        changes = 0
        t0 = time.perf_counter()
        for _ in tqdm(range(num_rounds), desc=f"{design}: churn", leave=False):
            for n, pub in enumerate(pubs):
                gone, added = fleet.evict_oldest(n), fleet.add_chain(n)
                _send(design, pub, [(k, GONE) for k in gone] + [(k, 0) for k in added])
                changes += len(gone) + len(added)
                pub.flush()
        _flush_all(pubs)
        churn_s = time.perf_counter() - t0
        total = fleet.num_blocks()
        _, written = store.get_prefix(f"/kvmesh/{CLUSTER}/no-such-key/")  # etcd's revision after the last write
        for m in mirrors:  # caught up once it has seen that revision (churn leaves the count as it was)
            got = m.ask(op="wait", blocks=total, revision=written, timeout_s=600)
            if got["blocks"] != total or got["revision"] < written:
                raise RuntimeError(f"a mirror lists {got['blocks']:,} blocks as of revision {got['revision']}, the "
                                   f"fleet holds {total:,} as of {written}")
        rss1, db1 = _etcd_usage(server, store)
        rng = random.Random(shape.seed)
        sample = [fleet.random_chain(rng) for _ in range(num_lookups)]
        answers = mirrors[0].ask(op="lookup", shape=asdict(shape), chains=[c[:2] for c in sample])
        latencies = sorted(a[0] for a in answers)
        promised_not_held = held_not_promised = 0
        for (chain_id, prefix_id, _), (_, found) in zip(sample, answers):
            truth = fleet.truth(chain_id, prefix_id)
            for node in set(truth) | set(found):
                promised, held = found.get(node, 0), truth.get(node, 0)
                promised_not_held += max(0, promised - held)
                held_not_promised += max(0, held - promised)
        fresh = Mirror(design, server.endpoint)
        caught_up = fresh.ask(op="wait", blocks=total, revision=written, timeout_s=600)
        mirror_rss = fresh.ask(op="rss")
        fresh.close()
        # A publisher that dies: its lease is no longer renewed.
        stop_keepalive.set()
        renewed = last_renewal[0]
        deadline = time.monotonic() + lease_ttl_s + 60
        while mirrors[0].ask(op="holds", node=shape.node_id(0)) and time.monotonic() < deadline:
            time.sleep(0.05)
        cleared_s = time.monotonic() - renewed
        for pub in pubs:
            pub.close()
        return Measure(design, shape.nodes, total, (rss1 - rss0) / total, (db1 - db0) / total,
                       filled / fill_s, changes / churn_s,
                       statistics.median(latencies), _p99(latencies), len(latencies), promised_not_held,
                       held_not_promised, caught_up["since_start_s"],
                       mirror_rss["rss"] / total, mirror_rss["peak"] / total,
                       None if mirror_rss["table_bytes"] is None else mirror_rss["table_bytes"] / total,
                       cleared_s, lease_ttl_s, fill_s, changes)
    finally:
        stop_keepalive.set()
        for m in mirrors:
            m.close()
        store.close()
        server.cleanup()


def _p99(sorted_values: list[float]) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(0.99 * len(sorted_values)))]


def _fit(rows: list[Measure], field: str, at_blocks: int) -> float:
    """Per-block cost extrapolated linearly in log(blocks) from the measured sizes."""
    xs = [math.log(r.blocks) for r in rows]
    ys = [getattr(r, field) for r in rows]
    if len(rows) < 2:
        return ys[0]
    slope = statistics.linear_regression(xs, ys).slope
    return ys[-1] + slope * (math.log(at_blocks) - xs[-1])


def run(json_path: str | None, nodes: int, sizes: list[int], baseline_sizes: list[int], num_mirrors: int = 2,
        churn: float = 0.25, num_lookups: int = 1000, lease_ttl_s: int = 5, extrapolate_to: int = 100_000_000,
        seed: int = 0) -> dict:
    rows = [measure("holdings", FleetShape(nodes, m, seed), num_mirrors, churn, num_lookups, lease_ttl_s)
            for m in sizes]
    base = [measure("baseline", FleetShape(nodes, m, seed), num_mirrors, churn, num_lookups, lease_ttl_s)
            for m in baseline_sizes]
    top, ref = rows[-1], base[-1] if base else None
    res: dict = {"machine": machine(), **asdict(top), "sizes": [asdict(r) for r in rows],
                 "baseline": asdict(ref) if ref else None, "baseline_sizes": [asdict(r) for r in base]}
    if extrapolate_to > top.blocks:
        res["extrapolated"] = {"blocks": extrapolate_to, "note": "per-block costs fitted over the measured sizes",
                               **{f: _fit(rows, f, extrapolate_to) for f in
                                  ("etcd_rss_bytes_per_block", "etcd_db_bytes_per_block", "mirror_rss_bytes_per_block")}}
    if ref is not None:
        res["ratios"] = {
            "etcd_rss_per_block": top.etcd_rss_bytes_per_block / ref.etcd_rss_bytes_per_block,
            "etcd_db_per_block": top.etcd_db_bytes_per_block / ref.etcd_db_bytes_per_block,
            "publish": top.publish_blocks_per_s / ref.publish_blocks_per_s,
            "churn": top.churn_changes_per_s / ref.churn_changes_per_s,
        }
    table = [[r.design, f"{r.nodes}", f"{r.blocks:,}", f"{r.etcd_rss_bytes_per_block:,.1f} B",
              f"{r.etcd_db_bytes_per_block:,.1f} B", f"{r.publish_blocks_per_s:,.0f}/s", f"{r.churn_changes_per_s:,.0f}/s",
              f"{r.lookup_p50_us:.1f} / {r.lookup_p99_us:.1f} us", f"{r.promised_not_held_blocks} / "
              f"{r.held_not_promised_blocks}", f"{r.mirror_catch_up_s:.1f} s", f"{r.mirror_rss_bytes_per_block:.0f} B",
              f"{r.dead_publisher_cleared_s:.1f} s (lease {r.lease_ttl_s} s)"] for r in rows + base]
    print_table("global block index at fleet scale (one etcd)",
                ["index", "nodes", "cached blocks", "etcd RSS/block", "etcd db/block", "publish", "churn",
                 "lookup p50 / p99 (2,048 blocks)", "promised-not-held / held-not-promised", "mirror catch-up",
                 "mirror RSS/block", "dead publisher gone"], table)
    if "ratios" in res:
        r = res["ratios"]
        print(f"\nholdings vs one key per block: etcd RSS per block {r['etcd_rss_per_block']:.3f}x, database "
              f"{r['etcd_db_per_block']:.3f}x, publish {r['publish']:.1f}x, churn {r['churn']:.1f}x")
    write_json(json_path, res)
    return res
