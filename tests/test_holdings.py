"""The global index's holdings records (metadata/holdings.py, metadata/block_index.py): the format, log records
folded into snapshots, the records a snapshot supersedes deleted, a fresh mirror catching up from the newest
snapshot plus the log, a restarted node superseding its previous life, and lookups against a model."""
from __future__ import annotations

import random

import numpy as np
import pytest

from kvmesh.metadata import holdings as hd
from kvmesh.metadata.block_index import BlockIndex, BlockPublisher, read_holdings
from kvmesh.metadata.etcd_store import EtcdStore
from kvmesh.metadata.key_map import KeyMap
from kvmesh.metadata.keys import KeyLayout
from kvmesh.metadata.memory_store import MemoryStore
from kvmesh.metadata.records import RecordError
from tests.metadata_node import chain
from tests.test_metadata import etcd, wait_for  # noqa: F401 (etcd: the module fixture)


@pytest.fixture(params=["etcd", "memory"])
def store(request, etcd):
    s = EtcdStore(etcd.endpoint) if request.param == "etcd" else MemoryStore()
    yield s
    s.close()


def test_records_round_trip_and_junk_is_refused():
    entries = [(2**64 - 1, 0), (0, 2), (12345, hd.GONE)]
    keys, codes = hd.decode_record(hd.encode_record(entries))
    assert list(zip(keys.tolist(), codes.tolist())) == entries
    assert [len(part) for part in hd.decode_record(hd.encode_record([]))] == [0, 0]
    good = hd.encode_record(entries)
    for bad in (b"", good[:-1], b"KVH2" + good[4:], good[:-1] + bytes([7])):
        with pytest.raises(RecordError):
            hd.decode_record(bad)
    h = bytes(range(16))
    assert hd.block_key(h) == int.from_bytes(h[:8], "little")


def flush(publisher: BlockPublisher) -> None:
    """Until nothing is pending (a log record that makes a snapshot due takes a second flush)."""
    for _ in range(3):
        if publisher.flush():
            return
    raise AssertionError("the publisher kept something pending")


def listed_keys(store, cluster: str) -> list[str]:
    return [kv.key for kv in store.get_prefix(KeyLayout(cluster).holdings_prefix)[0]]


def test_the_log_is_folded_into_snapshots_and_a_fresh_mirror_catches_up(store):
    publisher = BlockPublisher(store, "fold", "ns", "node-a", snapshot_min_entries=40, start=False)
    publisher.set_lease(store.grant_lease(30))
    live = BlockIndex(store, "fold", "ns")
    rng = random.Random(0)
    chains = {i: chain(f"fold-{i}", 10) for i in range(12)}
    held: dict[int, int] = {}
    try:
        assert live.mirror.wait_healthy(10)
        for step in range(60):  # chains cached whole and evicted tail first, one flush each
            i = rng.randrange(12)
            if held.get(i, 0) < 10 and rng.random() < 0.6:
                publisher.publish(chains[i][held.get(i, 0):])
                held[i] = 10
            elif held.get(i):
                keep = rng.randrange(held[i])
                publisher.unpublish(chains[i][keep:held[i]][::-1])
                held[i] = keep
            flush(publisher)
        assert publisher.num_snapshots >= 3  # the first on the lease, then each time the log outgrew 40 entries
        # What a snapshot supersedes is deleted: the newest snapshot and the log after it stay.
        records = [KeyLayout("fold").parse_holdings(k) for k in listed_keys(store, "fold")]
        snapshots = [r for r in records if r.kind == hd.SNAPSHOT]
        assert len(snapshots) == 1 and all(r.seq > snapshots[0].seq for r in records if r.kind == hd.LOG)
        want = {name: n for name, n in ((f"c{i}", held.get(i, 0)) for i in range(12))}

        def answers(index) -> dict[str, int]:
            return {f"c{i}": index.lookup(chains[i]).get("node-a", 0) for i in range(12)}

        wait_for(lambda: answers(live) == want, what="the live mirror to follow")
        fresh = BlockIndex(store, "fold", "ns")
        try:
            assert fresh.mirror.wait_healthy(10)
            assert answers(fresh) == want and fresh.num_blocks == live.num_blocks == sum(held.values())
            assert {f"c{i}": live.lookup_direct(chains[i]).get("node-a", 0) for i in range(12)} == want
        finally:
            fresh.close()
    finally:
        publisher.close()
        live.close()


def test_a_restarted_node_supersedes_its_previous_life(store):
    lease = store.grant_lease(30)
    first = BlockPublisher(store, "again", "ns", "node-a", start=False)
    first.set_lease(lease)
    first.publish(chain("old", 6))
    flush(first)
    first.close()
    index = BlockIndex(store, "again", "ns")
    try:
        assert index.mirror.wait_healthy(10)
        wait_for(lambda: index.lookup(chain("old", 6)) == {"node-a": 6}, what="the first life's blocks")
        second = BlockPublisher(store, "again", "ns", "node-a", start=False)  # the same node id, started again
        second.set_lease(lease)
        second.publish(chain("new", 3))
        flush(second)  # its first record: a snapshot of what it holds now
        wait_for(lambda: index.lookup(chain("old", 6)) == {} and index.lookup(chain("new", 3)) == {"node-a": 3},
                 what="the new life's snapshot to replace the old life's blocks")
        assert read_holdings(store, KeyLayout("again"), "ns").table.lookup(chain("old", 6)) == {}
        second.close()
    finally:
        index.close()


@pytest.mark.parametrize("search", ["native", "python"])
@pytest.mark.parametrize("renumber_often", [False, True])
def test_table_lookups_agree_with_a_model(renumber_often, search, monkeypatch):
    """Random holdings of random prefixes over several nodes: every lookup equals the model's answer, with
    holder sets renumbered every few changes or not (nodes come and go, and each change interns new sets),
    searched in C (metadata/chain_search.c, built here: CI has a compiler) and in Python."""
    if renumber_often:
        monkeypatch.setattr(hd, "_MIN_MAX_SETS", 8)
    rng = random.Random(1)
    table = hd.HoldingsTable()
    if search == "python":
        table._native = None
    else:
        assert table._native is not None, "the native chain search did not build (see the log)"
    chains = [chain(f"model-{i}", 40) for i in range(6)]
    model: dict[str, dict[int, int]] = {}
    for step in range(300):
        node = f"n{rng.randrange(9)}"
        i, length = rng.randrange(6), rng.randrange(41)
        state, seq = table.state(node), step + 1
        had = model.setdefault(node, {}).get(i, 0)
        changes = [(hd.block_key(h), 0) for h in chains[i][had:length]] + \
                  [(hd.block_key(h), hd.GONE) for h in chains[i][length:had][::-1]]
        table.change(node, state.apply_log(seq, [k for k, _ in changes], bytes(c for _, c in changes)))
        model[node][i] = length
        if rng.random() < 0.05:
            table.remove(node)
            model.pop(node)
        table.check_integrity()
        if renumber_often:
            assert len(table._sets) <= 4 * 4 * 9 + 9 * 2, "unused holder sets are not dropped"
        for j in range(6):
            want = {n: held[j] for n, held in model.items() if held.get(j)}
            assert table.lookup(chains[j]) == want
            assert table.lookup(chains[j][:17]) == {n: min(v, 17) for n, v in want.items()}


def test_a_change_that_fails_to_apply_makes_the_mirror_resync(store):
    """An exception while a watched change is applied (a bug, memory) must not leave the mirror drifting: it marks
    itself unhealthy and starts over from a listing, which brings the change in."""
    from kvmesh.metadata.mirror import PrefixMirror
    from kvmesh.metadata.store import KeyValue

    seen: list[str] = []
    fail_once = [True]

    def on_change(kind: str, key: str, value: bytes, lease: int = 0) -> None:
        if kind == "put" and key.endswith("/boom") and fail_once[0]:
            fail_once[0] = False
            raise RuntimeError("boom")
        if kind == "put":
            seen.append(key)

    mirror = PrefixMirror(store, "/resync-test/", on_change, retry_interval_s=0.05)
    try:
        assert mirror.wait_healthy(10)
        store.put_many([KeyValue("/resync-test/boom", b"x")])
        wait_for(lambda: "/resync-test/boom" in seen and mirror.healthy, what="the failed change, after a resync")
        assert mirror.num_resyncs == 2 and not fail_once[0]
    finally:
        mirror.close()


def test_memory_store_watch_starts_from_the_revision_it_names():
    """As with etcd: a reader that listed at R and watches from R + 1 gets what was written in between."""
    from kvmesh.metadata.store import KeyValue

    store = MemoryStore()
    _, revision = store.get_prefix("/w/")
    store.put_many([KeyValue("/w/a", b"1"), KeyValue("/elsewhere", b"x")])
    seen: list = []
    store.watch_prefix("/w/", revision + 1, seen.extend)
    store.put_many([KeyValue("/w/b", b"2")])
    assert [(e.kind, e.key) for e in seen] == [("put", "/w/a"), ("put", "/w/b")]


def test_the_native_search_refuses_what_it_cannot_read():
    """Malformed arguments raise (no crash); a small map's answers are right: nodes leave where their set
    changes, slots without a node, unknown set numbers and the excluded node are left out."""
    from kvmesh.metadata import native_search

    native = native_search.load()
    assert native is not None, "the native chain search did not build (see the log)"
    keys = KeyMap()
    keys.put_many(np.array([5, 6, 8, 9, 10], dtype=np.uint64), np.array([1, 1, 2, 9, 2**63 + 5], dtype=np.uint64))
    layout = keys.layout()
    slots, mask = layout[0], layout[1]
    set_slots, node_at = [(), (0, 2, 3), (2,)], ["a", None, "c", "d"]

    def holders(hashes, *, layout=layout, guesses=(), exclude=""):
        return native.holders(hashes, *layout, guesses, set_slots, node_at, exclude)

    key = lambda k: k.to_bytes(8, "little")  # noqa: E731
    with pytest.raises(TypeError, match="block hash 0"):
        holders(["not bytes"])
    with pytest.raises(TypeError, match="block hash 0"):
        holders([b"short"])
    with pytest.raises(ValueError, match="mask"):
        holders([bytes(16)], layout=(slots[:4], mask, *layout[2:]))
    with pytest.raises(TypeError, match="guesses"):
        native.holders([bytes(16)], *layout, [3], set_slots, node_at, "")
    assert holders([key(5), key(6)]) == ({"a": 2, "c": 2, "d": 2}, ())
    assert holders([key(5), key(6), key(8), key(7)], exclude="d") == ({"a": 2, "c": 3}, (2, 3))
    assert holders([key(5), key(8), key(8)], guesses=(1,)) == ({"a": 1, "c": 3, "d": 1}, (1,))
    assert holders([key(7)]) == ({}, ())
    assert holders([key(9), key(9)]) == ({}, ())  # set 9 is not in set_slots (renumbered meanwhile): no holder
    assert holders([key(10)]) == ({}, ())  # nor is a number past any index
