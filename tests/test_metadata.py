"""Global pool metadata against a real etcd: round trips, two processes, leases, outages, bad input."""
from __future__ import annotations

import json
import logging
import signal
import socket
import subprocess
import sys
import time

import pytest

from kvmesh.metadata.block_index import BlockIndex, BlockPublisher
from kvmesh.metadata.embedded_etcd import EmbeddedEtcd, EtcdStartError, etcd_binary
from kvmesh.metadata.etcd_store import EtcdStore, split_batches
from kvmesh.metadata.keys import InvalidNameError, KeyLayout
from kvmesh.metadata.memory_store import MemoryStore
from kvmesh.metadata.records import KVLayoutRecord, NodeRecord
from kvmesh.metadata.store import KeyValue
from kvmesh.metadata.registry import NodeDirectory, NodeRegistry
from kvmesh.metadata.sealed_store import open_store
from tests.metadata_node import chain


def wait_for(predicate, timeout_s: float = 10.0, what: str = "condition") -> float:
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)
    return time.monotonic() - start


@pytest.fixture(scope="module")
def etcd():
    with EmbeddedEtcd() as server:
        yield server


@pytest.fixture(params=["etcd", "memory"])
def store(request, etcd):
    s = EtcdStore(etcd.endpoint) if request.param == "etcd" else MemoryStore()
    yield s
    s.close()


def node(store, cluster: str, node_id: str, ttl_s: int = 10):
    registry = NodeRegistry(store, cluster, ttl_s=ttl_s)
    publisher = BlockPublisher(store, cluster, "ns", node_id)
    registry.on_new_lease(publisher.set_lease)
    registry.register(NodeRecord(node_id, "prefill", "127.0.0.1", "127.0.0.1:9", "127.0.0.1:8"))
    return registry, publisher


def test_unsafe_names_are_refused():
    for bad in ("a/b", "", "../x", "a b", "x" * 200, "-lead"):
        with pytest.raises(InvalidNameError):
            KeyLayout(bad)
    keys = KeyLayout("prod-1")
    with pytest.raises(InvalidNameError):
        keys.node("n/1")
    log_key = keys.holdings_log("ns", "node-a", 0x1234)
    assert log_key == "/kvmesh/prod-1/holdings/ns/node-a/l/0000000000001234"
    assert keys.parse_holdings(log_key) == ("ns", "node-a", "l", 0x1234, 0, 1)
    part = keys.holdings_snapshot("ns", "node-a", 7, 2, 3)
    assert part == "/kvmesh/prod-1/holdings/ns/node-a/s/0000000000000007/0002-0003"
    assert keys.parse_holdings(part) == ("ns", "node-a", "s", 7, 2, 3)
    for bad in ("/kvmesh/prod-1/holdings/ns/node-a/l/12", "/kvmesh/prod-1/holdings/ns/node-a/s/0000000000000007/0003-0003",
                "/kvmesh/prod-1/holdings/ns/node-a/x/0000000000000007", "/kvmesh/prod-1/holdings/ns/a/b/l/0000000000000007"):
        assert keys.parse_holdings(bad) is None, bad
    with pytest.raises(InvalidNameError):
        keys.holdings_log("ns", "n/1", 0)


def test_batches_respect_etcd_limits():
    batches = split_batches(list(range(300)))
    assert [len(b) for b in batches] == [128, 128, 44]
    big = split_batches([b"x" * 400_000] * 5, len)
    assert all(sum(map(len, b)) <= 1 << 20 for b in big) and sum(map(len, big)) == 5


def test_listings_come_in_pages_at_one_revision(etcd):
    """More keys than a page, more bytes than gRPC's default 4 MiB message: one consistent listing."""
    from kvmesh.metadata import etcd_store

    store = EtcdStore(etcd.endpoint)
    try:
        starts = range(0, 5 * etcd_store.PAGE_KEYS, 64)  # 6.4 MB: pages past the first weigh over 4 MiB
        for start in starts:
            store.put_many([KeyValue(f"/paged/{i:05d}", bytes([i % 251]) * 20_000) for i in range(start, start + 64)])
        items, revision = store.get_prefix("/paged/")
        assert [kv.key for kv in items] == [f"/paged/{i:05d}" for i in range(64 * len(starts))]
        assert all(kv.value == bytes([i % 251]) * 20_000 for i, kv in enumerate(items))
        store.put_many([KeyValue("/paged/zzz", b"later")])
        assert store.get_prefix("/paged/")[1] > revision
    finally:
        store.close()


def test_publish_lookup_unpublish_round_trip(store):
    registry, publisher = node(store, "rt", "node-a")
    index = BlockIndex(store, "rt", "ns")
    try:
        assert index.mirror.wait_healthy(5)
        hashes = chain("rt", 300)  # more than one transaction's worth
        publisher.publish(hashes[:200])
        wait_for(lambda: index.lookup(hashes) == {"node-a": 200}, what="publish visible in the mirror")
        assert index.lookup_direct(hashes) == {"node-a": 200}
        assert index.lookup(hashes, exclude="node-a") == {}
        assert index.lookup(chain("other", 10)) == {}
        publisher.unpublish(hashes[150:])
        wait_for(lambda: index.lookup(hashes) == {"node-a": 150}, what="unpublish visible")
        assert index.lookup_direct(hashes) == {"node-a": 150}
    finally:
        publisher.close()
        registry.deregister()
        index.close()
    # Deregistering revokes the lease: the node's entries go with it.
    index2 = BlockIndex(store, "rt", "ns")
    assert index2.mirror.wait_healthy(5)
    assert index2.lookup(chain("rt", 300)) == {}
    index2.close()


def test_mirror_lookup_of_2048_blocks_is_local_and_exact(etcd):
    """Every lookup answers from the mirror, exactly; its time is reported, not asserted (noisy machines)."""
    store = EtcdStore(etcd.endpoint)
    registry, publisher = node(store, "fast", "node-a")
    index = BlockIndex(store, "fast", "ns")
    hashes = chain("fast", 2048)
    publisher.publish(hashes)
    wait_for(lambda: index.lookup(hashes) == {"node-a": 2048}, what="2048 blocks visible")
    start = time.perf_counter()
    answers = [index.lookup(hashes) for _ in range(100)]
    per_lookup_us = (time.perf_counter() - start) / 100 * 1e6
    print(f"mirror lookup of 2048 blocks: {per_lookup_us:.1f} us")  # reported, not asserted (noisy machines)
    assert all(a == {"node-a": 2048} for a in answers)
    assert index.lookup(hashes[:1000] + chain("other", 1)) == {"node-a": 1000}  # a chain that leaves the held one
    publisher.close()
    registry.deregister()
    index.close()


def spawn_node(etcd, cluster: str, node_id: str, salt: str, n: int, ttl_s: int = 10) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "tests.metadata_node", etcd.endpoint, cluster, node_id, salt,
                             str(n), str(ttl_s)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert json.loads(proc.stdout.readline()) == {"ready": True}
    return proc


def ask(proc: subprocess.Popen, line: str) -> dict:
    proc.stdin.write(line + "\n")
    proc.stdin.flush()
    return json.loads(proc.stdout.readline())


def test_two_processes_see_each_other_and_a_killed_node_vanishes(etcd):
    store = EtcdStore(etcd.endpoint)
    events: list[tuple[str, str]] = []
    directory = NodeDirectory(store, "two", on_event=lambda kind, nid, rec: events.append((kind, nid)))
    registry, publisher = node(store, "two", "here")
    index = BlockIndex(store, "two", "ns")
    publisher.publish(chain("mine", 12))
    other = spawn_node(etcd, "two", "there", "theirs", 40, ttl_s=2)
    try:
        wait_for(lambda: index.lookup(chain("theirs", 64)) == {"there": 40}, what="the other process's blocks")
        wait_for(lambda: ask(other, "lookup mine 20") == {"here": 12}, what="our blocks in the other mirror")
        wait_for(lambda: ("joined", "there") in events, what="join event")
        other.send_signal(signal.SIGKILL)
        other.wait()
        gone_after = wait_for(lambda: index.lookup(chain("theirs", 64)) == {}, timeout_s=10, what="entries gone")
        wait_for(lambda: ("left", "there") in events, what="death event")
        assert "there" not in directory.nodes and "here" in directory.nodes
        assert gone_after < 2 + 3  # within the 2 s lease TTL (plus etcd's expiry granularity)
    finally:
        if other.poll() is None:
            other.kill()
        publisher.close()
        registry.deregister()
        index.close()
        directory.close()


def _listening_socket(port: int = 0) -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", port))
    s.listen()
    return s


def test_a_port_taken_before_etcd_binds_it_is_picked_again():
    """Between picking a free port and etcd binding it, another process may take it (CI saw it)."""
    server = EmbeddedEtcd()
    taken_client, taken_peer = server.client_port, server.peer_port
    with _listening_socket(taken_client), _listening_socket(taken_peer):
        with server:
            assert {server.client_port, server.peer_port}.isdisjoint({taken_client, taken_peer})
            store = EtcdStore(server.endpoint)
            store.put_many([KeyValue("/kvmesh-test/k", b"v")])
            client_port = server.client_port
            server.stop()  # a restart keeps the client port clients know
            with _listening_socket(server.peer_port):  # ... and picks another peer port, its data keeping the first
                server.start()
            assert server.client_port == client_port
            assert store.get_many(["/kvmesh-test/k"]) == [b"v"]
            store.close()


def test_a_given_port_in_use_is_a_clear_error():
    with _listening_socket() as taken:
        port = taken.getsockname()[1]
        server = EmbeddedEtcd(port=port)
        try:
            with pytest.raises(EtcdStartError, match=f"port {port}: address already in use"):
                server.start()
            assert not server.running and server.client_port == port
        finally:
            server.cleanup()


def test_another_etcd_on_the_port_is_never_taken_for_ours():
    """Until ours binds its client port (or fails to), another etcd already listening there answers the health
    check: a start must not take it for its own (CI saw nodes register with another test's etcd, which then
    went away). A picked port is picked again; a given one is a clear error."""
    with EmbeddedEtcd() as other:
        given = EmbeddedEtcd(port=other.client_port)
        try:
            with pytest.raises(EtcdStartError, match=f"port {other.client_port}: address already in use"):
                given.start()
        finally:
            given.cleanup()
        picked = EmbeddedEtcd()
        picked.client_port = other.client_port  # taken by the other etcd after it was picked
        with picked:
            assert picked.client_port != other.client_port
            ours, theirs = EtcdStore(picked.endpoint), EtcdStore(other.endpoint)
            ours.put_many([KeyValue("/kvmesh-test/whose", b"ours")])
            assert theirs.get_many(["/kvmesh-test/whose"]) == [None]
            ours.close()
            theirs.close()


def test_an_etcd_that_cannot_start_says_why_in_the_error():
    """The error quotes etcd's own words: its log lives in a temporary data dir that is removed with it."""
    server = EmbeddedEtcd(command_prefix=["sh", "-c", "echo 'etcd: cannot start: the disk is on fire'; exit 3", "--"])
    try:
        with pytest.raises(EtcdStartError, match="the disk is on fire") as error:
            server.start()
        assert str(server.data_dir) not in str(error.value)
    finally:
        server.cleanup()


def test_etcd_outage_degrades_then_catches_up():
    with EmbeddedEtcd() as server:
        store = EtcdStore(server.endpoint)
        registry, publisher = node(store, "outage", "node-a", ttl_s=10)
        index = BlockIndex(EtcdStore(server.endpoint), "outage", "ns")
        hashes = chain("o", 100)
        publisher.publish(hashes[:50])
        wait_for(lambda: index.lookup(hashes) == {"node-a": 50}, what="first publish")
        server.stop()
        wait_for(lambda: not index.mirror.healthy, what="mirror notices the outage")
        start = time.monotonic()
        assert index.lookup(hashes) == {} and index.lookup_direct(hashes) == {}
        assert time.monotonic() - start < 1.0  # no hang
        publisher.publish(hashes[50:])
        time.sleep(0.3)
        assert publisher.num_pending == 50  # queued, not lost
        server.start()
        wait_for(lambda: index.lookup(hashes) == {"node-a": 100}, timeout_s=15, what="catch-up after restart")
        # The mirror can see the keys before the publisher's thread has counted its batch as done.
        wait_for(lambda: publisher.num_pending == 0, timeout_s=15, what="the publisher's queue to drain")
        assert index.mirror.num_resyncs >= 2
        publisher.close()
        registry.deregister()
        index.close()


def test_hand_written_garbage_is_skipped_with_a_warning(etcd, caplog):
    store = EtcdStore(etcd.endpoint)
    registry, publisher = node(store, "junk", "node-a")
    etcdctl = str(etcd_binary().with_name("etcdctl"))
    for key, value in (("/kvmesh/junk/holdings/ns/node-b/l/0000000000000001", "not-a-record"),
                       ("/kvmesh/junk/holdings/ns/node-b/l/nothex", "x"),
                       ("/kvmesh/junk/nodes/node-z", "garbage")):
        subprocess.run([etcdctl, f"--endpoints={etcd.endpoint}", "put", key, value], check=True,
                       capture_output=True)
    caplog.set_level(logging.WARNING, logger="kvmesh.metadata")
    index = BlockIndex(store, "junk", "ns")
    directory = NodeDirectory(store, "junk")
    try:
        publisher.publish(chain("junk", 3))
        wait_for(lambda: index.lookup(chain("junk", 3)) == {"node-a": 3}, what="good entries despite junk")
        assert index.num_skipped == 2
        assert "node-z" not in directory.nodes and "node-a" in directory.nodes
        assert any("skipping" in r.message for r in caplog.records)
    finally:
        publisher.close()
        registry.deregister()
        index.close()
        directory.close()


def test_compacted_watch_is_reported_and_the_mirror_resyncs(etcd):
    from kvmesh.metadata.mirror import PrefixMirror
    from kvmesh.metadata.store import CompactedError, KeyValue

    store = EtcdStore(etcd.endpoint)
    store.put_many([KeyValue("/compact/a", b"1")])
    _, old_revision = store.get_prefix("/compact/")
    store.put_many([KeyValue("/compact/b", b"2")])
    _, revision = store.get_prefix("/compact/")
    store._client.compact(revision)
    seen: list = []
    cancel = store.watch_prefix("/compact/", old_revision, seen.append)
    wait_for(lambda: seen, what="the watch to report")
    cancel()
    assert isinstance(seen[0], CompactedError)
    # A mirror whose watch breaks resyncs by itself and keeps every key.
    copy: dict[str, bytes] = {}

    def apply(kind: str, key: str, value: bytes, lease: int) -> None:
        if kind == "reset":
            copy.clear()
        elif kind == "put":
            copy[key] = value

    mirror = PrefixMirror(store, "/compact/", apply, retry_interval_s=0.1)
    assert mirror.wait_healthy(5)
    mirror._on_watch(mirror._generation, CompactedError("test: compacted"))
    assert not mirror.healthy
    wait_for(lambda: mirror.healthy and mirror.num_resyncs >= 2, what="resync")
    assert copy == {"/compact/a": b"1", "/compact/b": b"2"}
    mirror.close()


def test_a_peer_registered_after_the_last_watch_event_is_found_in_etcd(etcd):
    """A holder asked by a node that registered a moment ago must not refuse it as unknown."""
    from kvmesh.metadata.store import KeyValue
    from kvmesh.node.membership import ClusterMembership

    layout = KVLayoutRecord(num_blocks=8, bytes_per_block=512, base_addr=4096)
    me = ClusterMembership(etcd.endpoint, "fresh-peer", "holder", "mfresh", 10, on_peer_left=lambda _n: None)
    me.start(NodeRecord("holder", "prefill", "127.0.0.1", "127.0.0.1:1", "127.0.0.1:2", kv_layout=layout))
    try:
        me.directory.close()  # its mirror hears nothing from now on
        store = open_store(etcd.endpoint, "")
        record = NodeRecord("newcomer", "decode", "127.0.0.1", "127.0.0.1:3", "127.0.0.1:4", kv_layout=layout)
        store.put_many([KeyValue(KeyLayout("fresh-peer").node("newcomer"), record.encode())])
        store.close()
        assert "newcomer" not in me.directory.nodes
        peer = me.peer("newcomer")
        assert peer is not None and peer.side_channel == "127.0.0.1:4" and peer.num_blocks == 8
        assert me.peer("nobody") is None and me.peer("../bad name") is None
    finally:
        me.close()
