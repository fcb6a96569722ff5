"""The control plane against someone without the cluster secret: sealed frames, sealed etcd values, etcd
credentials, records that lie, deletions that are not deaths, exposure without a secret, tier files."""
from __future__ import annotations

import dataclasses
import os
import queue
import struct
import subprocess
import sys
import threading
import time

import msgpack
import pytest
import zmq

from kvmesh.auth import HEADER_BYTES, MAC_BYTES, NONCE_BYTES, AuthError, ClusterAuth, InsecureClusterError, \
    require_secret
from kvmesh.metadata.embedded_etcd import EmbeddedEtcd
from kvmesh.metadata.etcd_store import EtcdStore
from kvmesh.metadata.keys import KeyLayout
from kvmesh.metadata.memory_store import MemoryStore
from kvmesh.metadata.records import KVLayoutRecord, NodeRecord
from kvmesh.metadata.registry import NodeDirectory, NodeRegistry
from kvmesh.metadata.sealed_store import SealedStore, open_store
from kvmesh.metadata.store import KeyValue, StoreUnavailable
from tests.transfer_support import wait_until

TOKEN = "security-test-token"
RECORD = NodeRecord("decode-0", "decode", "127.0.0.1", "127.0.0.1:7001", "127.0.0.1:7002", "127.0.0.1:7003",
                    kv_layout=KVLayoutRecord(num_blocks=8, bytes_per_block=512, base_addr=4096))


@pytest.fixture(scope="module")
def open_etcd():
    """An etcd without authentication: the attacker of these tests can write to it, but has no secret."""
    with EmbeddedEtcd() as server:
        yield server


# ---- frames -------------------------------------------------------------------------------------------
def test_a_frame_opens_once_within_its_window_and_only_under_its_token():
    sender, receiver = ClusterAuth(TOKEN), ClusterAuth(TOKEN)
    frame = sender.seal(b"payload")
    assert receiver.open(frame) == b"payload"
    with pytest.raises(AuthError, match="replayed"):
        receiver.open(frame)
    with pytest.raises(AuthError, match="token"):
        ClusterAuth("other").open(sender.seal(b"payload"))
    tampered = bytearray(sender.seal(b"payload"))
    tampered[-1] ^= 1
    with pytest.raises(AuthError, match="token"):
        receiver.open(bytes(tampered))
    # A frame sealed two minutes ago (MAC valid for its old time): stale.
    body = os.urandom(NONCE_BYTES) + struct.pack(">Q", int((time.time() - 120) * 1000)) + b"old"
    with pytest.raises(AuthError, match="window"):
        receiver.open(sender.mac(body) + body)
    assert receiver.num_refused == 3 and len(frame) == HEADER_BYTES + len(b"payload") and MAC_BYTES == 16


def test_a_process_without_the_token_cannot_complete_a_handshake():
    from kvmesh.router_endpoint import RouterEndpoint

    received = queue.Queue()
    endpoint = RouterEndpoint("127.0.0.1", lambda identity, payload: received.put(payload), "handshake",
                              ClusterAuth(TOKEN)).start()
    try:
        for outsider in (ClusterAuth(""), ClusterAuth("guess")):
            sock = outsider.curve_client(zmq.Context.instance().socket(zmq.DEALER))
            sock.linger = 0
            sock.connect(f"tcp://{endpoint.endpoint}")
            sock.send(ClusterAuth(TOKEN).seal(b"a frame someone sniffed"))  # even a valid frame
            assert not sock.poll(1000)
            sock.close()
        wait_until(lambda: endpoint.num_refused >= 2)
        assert received.empty()
        insider = ClusterAuth(TOKEN).curve_client(zmq.Context.instance().socket(zmq.DEALER))
        insider.linger = 0
        insider.connect(f"tcp://{endpoint.endpoint}")
        insider.send(ClusterAuth(TOKEN).seal(b"hello"))
        assert received.get(timeout=10) == b"hello"
        insider.close()
    finally:
        endpoint.close()


def test_replies_still_queued_when_an_endpoint_closes_are_sealed():
    """A reply handed to ``send`` that the serving thread had not forwarded when ``close`` stopped it goes out
    from ``close``, sealed like any other (a holder's last SHUTTING_DOWN answers take that path)."""
    from kvmesh.router_endpoint import RouterEndpoint

    answered, release = threading.Event(), threading.Event()
    endpoint = None

    def on_message(identity, payload):  # runs on the serving thread: it is busy here while close stops it
        endpoint.send(identity, b"last words")
        answered.set()
        release.wait(10)

    endpoint = RouterEndpoint("127.0.0.1", on_message, "closing", ClusterAuth(TOKEN)).start()
    client = ClusterAuth(TOKEN).curve_client(zmq.Context.instance().socket(zmq.DEALER))
    client.linger = 0
    try:
        client.connect(f"tcp://{endpoint.endpoint}")
        client.send(ClusterAuth(TOKEN).seal(b"hello"))
        assert answered.wait(10)  # the reply waits in the hand-over queue
        threading.Timer(0.3, release.set).start()  # after close has asked the serving thread to stop
        endpoint.close()
        assert client.poll(10_000)
        assert ClusterAuth(TOKEN).open_reply(client.recv(), "closing") == b"last words"
    finally:
        release.set()
        client.close()
        endpoint.close()


def test_a_router_with_another_token_fails_its_streams_at_once():
    """Its handshake is refused: the streams end with NodeLost naming the token, not after a liveness timeout."""
    from kvmesh.cluster.node_connection import NodeConnection, NodeLost
    from kvmesh.node.messages import GenerateRequest
    from kvmesh.router_endpoint import RouterEndpoint

    endpoint = RouterEndpoint("127.0.0.1", lambda identity, payload: None, "node", ClusterAuth(TOKEN)).start()
    conn = NodeConnection("decode-0", endpoint.endpoint, liveness_s=600, auth=ClusterAuth("another-token"))
    try:
        error = conn.submit(GenerateRequest("r", [1, 2, 3], {"max_tokens": 1})).get(timeout=30)
        assert isinstance(error, NodeLost) and "cluster token" in str(error)
    finally:
        conn.close()
        endpoint.close()


# ---- etcd values and credentials ----------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["etcd", "memory"])
def test_values_without_the_cluster_mac_do_not_exist_for_readers(backend, open_etcd):
    inner = EtcdStore(open_etcd.endpoint) if backend == "etcd" else MemoryStore()
    raw = EtcdStore(open_etcd.endpoint) if backend == "etcd" else inner  # the attacker's client: no secret
    store = SealedStore(inner, ClusterAuth(TOKEN).record_key)
    prefix = f"/sealed-{backend}/"
    events = []
    lease = store.grant_lease(30)
    try:
        _, revision = store.get_prefix(prefix)
        cancel = store.watch_prefix(prefix, revision + 1, events.extend)
        store.put_many([KeyValue(prefix + "genuine", b"v1")], lease)
        raw.put_many([KeyValue(prefix + "forged", b"\0" * 16 + b"v2")])  # a made-up MAC
        genuine = raw.get_many([prefix + "genuine"])[0]
        raw.put_many([KeyValue(prefix + "copied", genuine)], lease)  # a genuine value under another key
        raw.put_many([KeyValue(prefix + "genuine", genuine)])  # the same value detached from its lease
        wait_until(lambda: len(events) >= 4)
        assert [(e.kind, e.key.removeprefix(prefix)) for e in events] == [
            ("put", "genuine"), ("delete", "forged"), ("delete", "copied"), ("delete", "genuine")]
        assert store.get_prefix(prefix)[0] == [] and store.get_many([prefix + "forged", prefix + "genuine"]) == [
            None, None]
        store.put_many([KeyValue(prefix + "genuine", b"v3")], lease)
        assert [kv.value for kv in store.get_prefix(prefix)[0]] == [b"v3"]
        assert store.num_forged >= 6
        cancel()
    finally:
        store.revoke_lease(lease)
        store.delete_many([prefix + k for k in ("genuine", "forged", "copied")])
        if raw is not inner:
            raw.close()
        store.close()


def test_etcd_started_with_a_secret_admits_only_its_holders():
    with EmbeddedEtcd(token=TOKEN) as server:
        for outsider in (EtcdStore(server.endpoint), EtcdStore(server.endpoint, token="guess")):
            with pytest.raises(StoreUnavailable, match="authentication|credentials"):
                outsider.put_many([KeyValue("/x", b"1")])
            outsider.close()
        store = open_store(server.endpoint, TOKEN)
        store.put_many([KeyValue("/x", b"1")])
        assert store.get_many(["/x"]) == [b"1"] and store.inner.authenticated
        store.close()


# ---- records ------------------------------------------------------------------------------------------
def test_a_forged_or_rewritten_node_record_is_never_believed(open_etcd):
    """A process with etcd access but no secret registers a node of its own, and rewrites a real node's
    transfer endpoint: readers see neither, and the real record is written back by its node."""
    keys = KeyLayout("forged")
    node_store, reader_store = open_store(open_etcd.endpoint, TOKEN), open_store(open_etcd.endpoint, TOKEN)
    attacker = EtcdStore(open_etcd.endpoint)
    registry = NodeRegistry(node_store, "forged", ttl_s=3)
    directory = NodeDirectory(reader_store, "forged")
    try:
        registry.register(RECORD)
        wait_until(lambda: "decode-0" in directory.nodes)
        fake = NodeRecord("decode-9", "decode", "127.0.0.1", "127.0.0.1:6001", "127.0.0.1:6002", "127.0.0.1:6003")
        attacker.put_many([KeyValue(keys.node("decode-9"), fake.encode())])
        moved = dataclasses.replace(RECORD, transfer_endpoint="127.0.0.1:6666")
        attacker.put_many([KeyValue(keys.node("decode-0"), moved.encode())])
        wait_until(lambda: reader_store.num_forged >= 2)
        assert "decode-9" not in directory.nodes
        assert directory.nodes["decode-0"].transfer_endpoint == "127.0.0.1:7001"
        wait_until(lambda: node_store.get_many([keys.node("decode-0")])[0] == RECORD.encode())  # written back
    finally:
        registry.deregister()
        directory.close()
        attacker.delete_many([keys.node("decode-9")])
        for s in (attacker, node_store, reader_store):
            s.close()


def test_deleting_a_live_nodes_record_is_not_its_death():
    """Departures release quarantines (``peer_gone``): only a lease that really ended may cause one."""
    store = MemoryStore()
    events = []
    registry = NodeRegistry(store, "deaths", ttl_s=30)
    directory = NodeDirectory(store, "deaths", on_event=lambda kind, node, record: events.append((kind, node)))
    try:
        registry.register(RECORD)
        wait_until(lambda: "decode-0" in directory.nodes)
        store.delete_many([KeyLayout("deaths").node("decode-0")])  # someone with etcd access, not the node
        assert ("left", "decode-0") not in events and "decode-0" in directory.nodes
        assert directory.num_deletes_ignored == 1
        store.revoke_lease(registry.lease_id)  # the node's lease ends: that is a departure
        wait_until(lambda: ("left", "decode-0") in events)
    finally:
        registry._stop.set()
        directory.close()


def test_malformed_records_are_dropped_and_unreachable_nodes_fail_at_once():
    from kvmesh.cluster.node_connection import NodeConnection, NodeLost
    from kvmesh.metadata.records import RecordError
    from kvmesh.node.messages import GenerateRequest

    for bad in ({"request_endpoint": "tcp://127.0.0.1:5"}, {"side_channel": "127.0.0.1:99999"},
                {"transfer_endpoint": "a b:1"}):
        with pytest.raises(RecordError):
            NodeRecord.decode(dataclasses.replace(RECORD, **bad).encode())
    for part, value in (("kv_layout", [1, 2]), ("kv_layout", {"num_blocks": "8"}), ("probe", {"decode_step_s": -1}),
                        ("model", {"fingerprint": 3}), ("kv_layout", {"surprise": 1})):
        raw = {**dataclasses.asdict(RECORD), part: value}
        with pytest.raises(RecordError, match=part):
            NodeRecord.decode(msgpack.packb(raw, use_bin_type=True))
    assert NodeRecord.decode(RECORD.encode()) == RECORD
    store = MemoryStore()
    directory = NodeDirectory(store, "bad")
    store.put_many([KeyValue(KeyLayout("bad").node("decode-1"),
                             dataclasses.replace(RECORD, node_id="decode-1",
                                                 request_endpoint="tcp://127.0.0.1:5").encode())])
    store.put_many([KeyValue(KeyLayout("bad").node("decode-2"), RECORD.encode())])  # names another node
    wait_until(lambda: directory.num_invalid == 2)
    assert directory.nodes == {}
    directory.close()
    conn = NodeConnection("decode-1", "tcp://127.0.0.1:5", auth=ClusterAuth(TOKEN))  # what a router once did
    try:
        events = conn.submit(GenerateRequest("r", [1, 2, 3], {"max_tokens": 1}))
        assert isinstance(events.get(timeout=10), NodeLost)
        assert isinstance(conn.submit(GenerateRequest("r2", [1], {"max_tokens": 1})).get(timeout=10), NodeLost)
    finally:
        conn.close()


# ---- exposure -----------------------------------------------------------------------------------------
def test_nothing_listens_beyond_loopback_without_a_secret():
    require_secret("node", ["127.0.0.1"], "")
    require_secret("node", ["0.0.0.0"], TOKEN)
    require_secret("node", ["0.0.0.0"], "", insecure=True)
    with pytest.raises(InsecureClusterError, match="0.0.0.0"):
        require_secret("node", ["0.0.0.0"], "")
    env = {k: v for k, v in os.environ.items() if k != "KVMESH_CLUSTER_TOKEN"}
    for argv in (["etcd", "--host", "0.0.0.0", "--port", "0"],
                 ["decode-node", "--node-id", "d", "--etcd", "127.0.0.1:1", "--host", "0.0.0.0"]):
        proc = subprocess.run([sys.executable, "-m", "kvmesh.cli", *argv], env=env, capture_output=True, text=True,
                              timeout=120, stdin=subprocess.DEVNULL)
        assert proc.returncode != 0 and "without a cluster secret" in proc.stderr, (argv, proc.stderr[-500:])


def test_auto_never_opens_a_loopback_node_to_the_network_through_mooncake():
    from kvmesh.transfer.engine import create_transfer_engine

    engine = create_transfer_engine("auto", host="127.0.0.1", auth=ClusterAuth(TOKEN))
    try:
        assert engine.name == "zmq" and "loopback" in engine.transport_reason
    finally:
        engine.close()


# ---- tier files ---------------------------------------------------------------------------------------
def test_tier_files_are_private_and_never_followed(tmp_path):
    from kvmesh.kv.tiers.media import DiskLayout, DiskMedium, UnsafeTierFile
    from kvmesh.kv.tiers.tiered_cache import TEMP_PREFIX, remove_stale_temp_folders

    layout = DiskLayout(b"r" * 16, 4096, 4)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    (tmp_path / "n.kvtier").symlink_to(victim)
    medium = DiskMedium(tmp_path / "n.kvtier", layout)  # a planted link is replaced, never written through
    assert victim.read_bytes() == b"precious" and not (tmp_path / "n.kvtier").is_symlink()
    assert (os.stat(tmp_path / "n.kvtier").st_mode & 0o777) == 0o600
    medium.close()
    os.chmod(tmp_path / "n.kvtier", 0o644)  # readable by others: not adopted
    with pytest.raises(UnsafeTierFile):
        DiskMedium(tmp_path / "n.kvtier", layout)
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale, live = tmp_path / f"{TEMP_PREFIX}{dead.pid}-x", tmp_path / f"{TEMP_PREFIX}{os.getpid()}-y"
    stale.mkdir()
    live.mkdir()
    assert remove_stale_temp_folders(str(tmp_path)) == [str(stale)] and live.exists()


def test_the_replay_guard_takes_reordering_and_stays_small():
    from kvmesh.auth import ReplayGuard

    guard, now = ReplayGuard(window=64), time.time()
    prefix = b"p" * 8
    nonce = [prefix + i.to_bytes(4, "big") for i in range(200)]
    assert guard.check(nonce[10], now, now) == ""
    assert guard.check(nonce[5], now, now) == ""  # a little late: fine, once
    assert "replayed" in guard.check(nonce[5], now, now) and "replayed" in guard.check(nonce[10], now, now)
    assert guard.check(nonce[150], now, now) == ""
    assert "behind" in guard.check(nonce[20], now, now)  # further behind than the window: refused
    assert guard.check(b"q" * 8 + (20).to_bytes(4, "big"), now, now) == ""  # another sender, its own counter
    for i in range(151, 200):
        assert guard.check(nonce[i], now, now) == ""
    assert len(guard._senders) == 2 and guard._senders[prefix][1] < 1 << 64
    assert guard.check(b"r" * 8 + bytes(4), now + 100, now + 100) == ""  # later: silent senders are forgotten
    assert set(guard._senders) == {b"r" * 8}
