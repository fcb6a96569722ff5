"""Pinned prefixes: a pinned system prompt survives any eviction storm, on the engine and across a cluster."""
from __future__ import annotations

import pytest

from kvmesh import LLM, SamplingParams
from kvmesh.errors import InvalidRequestError

ONE = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
SYSTEM = list(range(10, 10 + 64))  # 4 full blocks


def _storm(llm: LLM, count: int, seed: int) -> None:
    """Distinct prompts that together need many times the pool: every unpinned cached block is evicted."""
    prompts = [[(seed * 7919 + i * 131 + j) % 250 + 3 for j in range(48)] for i in range(count)]
    llm.generate(prompts, ONE, use_tqdm=False)


def test_a_pinned_prefix_survives_an_eviction_storm_and_an_unpinned_one_does_not():
    llm = LLM("tiny-llama", num_kv_blocks=24, progress=False)
    engine = llm.engine
    pin = engine.pin_prefix(SYSTEM)
    assert engine.pins.status() == {pin.prefix_id: (0, 4)}  # nothing cached yet: pinned when computed
    llm.generate(SYSTEM + [5, 6, 7], ONE, use_tqdm=False)
    assert engine.pins.status() == {pin.prefix_id: (4, 4)}
    assert engine.pool.usage().num_pinned == 4 and engine.pool.num_free_blocks == 24 - 4  # pinned is never free
    _storm(llm, 40, seed=1)
    out = llm.generate(SYSTEM + [8, 9], ONE, use_tqdm=False)[0]
    assert out.num_cached_tokens == 64  # the whole system prompt was still there
    engine.check_integrity()
    assert engine.unpin_prefix(pin.prefix_id) and not engine.unpin_prefix(pin.prefix_id)
    assert engine.pool.usage().num_pinned == 0
    _storm(llm, 40, seed=2)
    assert llm.generate(SYSTEM + [8, 9], ONE, use_tqdm=False)[0].num_cached_tokens == 0  # gone once unpinned
    engine.check_integrity()


def test_pinning_is_idempotent_and_refuses_what_cannot_be_pinned():
    llm = LLM("tiny-llama", num_kv_blocks=24, progress=False)
    llm.generate(SYSTEM, ONE, use_tqdm=False)
    first = llm.engine.pin_prefix(SYSTEM)
    again = llm.engine.pin_prefix(SYSTEM + [1, 2])  # the same full blocks: the same pin
    assert first is again and llm.engine.pool.usage().num_pinned == 4
    with pytest.raises(InvalidRequestError, match="one full block"):
        llm.engine.pin_prefix([1, 2, 3])
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        llm.engine.pin_prefix([10**6] * 16)
    llm.engine.check_integrity()


def test_kvmesh_pin_keeps_a_prefix_on_every_node_through_a_storm(capsys):
    """``kvmesh pin`` through a router's admin API (behind its API key): the pin lives in etcd, every decode
    node (including one that starts after the pin) pins the prefix once computed, a storm of other prompts
    does not evict it, ``--list`` shows it per node, ``--unpin`` releases it."""
    import asyncio
    import json
    import threading
    import time

    from kvmesh.cli import main
    from kvmesh.cluster.http_server import start_http_server
    from kvmesh.cluster.local_launcher import LocalCluster
    from kvmesh.cluster.router import Router, RouterConfig

    def wait_for(predicate, what: str, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.05)

    def pinned_on(node_id: str) -> int:
        stats = cluster.client(node_id).stats()
        return sum(done for done, _ in stats.get("pinned_prefixes", {}).values())

    with LocalCluster(0, 1, node_args=["--num-kv-blocks", "24"], cluster="pins") as cluster:
        router = Router(RouterConfig(etcd=cluster.etcd_endpoint, cluster_token=cluster.token, cluster="pins"))
        loop = asyncio.new_event_loop()
        runner, port = loop.run_until_complete(start_http_server(router, "127.0.0.1", 0, token="k3y"))
        threading.Thread(target=loop.run_forever, daemon=True).start()
        url = f"http://127.0.0.1:{port}"
        try:
            assert main(["pin", "--url", url, "--tokens", ",".join(map(str, SYSTEM)), "--label", "system"]) == 1
            assert "401" in capsys.readouterr().err  # the admin API is behind the API key
            assert main(["pin", "--url", url, "--api-key", "k3y", "--tokens", ",".join(map(str, SYSTEM)),
                         "--label", "system"]) == 0
            pin = json.loads(capsys.readouterr().out)
            assert pin["num_blocks"] == 4 and pin["label"] == "system"
            cluster.start_node("decode", "decode-1")  # joins after the pin was made
            for node_id in ("decode-0", "decode-1"):
                assert cluster.client(node_id).generate(SYSTEM + [1, 2], ONE).error == ""
                wait_for(lambda n=node_id: pinned_on(n) == 4, f"{node_id} to pin the prefix")
            storm = [[(i * 131 + j) % 250 + 3 for j in range(48)] for i in range(40)]
            for node_id in ("decode-0", "decode-1"):
                assert all(c.error == "" for c in cluster.client(node_id).generate_many(storm, ONE))
                out = cluster.client(node_id).generate(SYSTEM + [7, 8], ONE)
                assert out.stats.tokens_reused_local == 64, node_id
                cluster.client(node_id).stats(check=True)
            assert main(["pin", "--url", url, "--api-key", "k3y", "--list"]) == 0
            listed = json.loads(capsys.readouterr().out)["pins"]
            assert [(p["id"], p["nodes"]) for p in listed] == [(pin["id"], {"decode-0": 4, "decode-1": 4})]
            assert main(["pin", "--url", url, "--api-key", "k3y", "--unpin", pin["id"]]) == 0
            for node_id in ("decode-0", "decode-1"):
                wait_for(lambda n=node_id: pinned_on(n) == 0 and cluster.client(n).stats()["num_pinned"] == 0,
                         f"{node_id} to unpin")
            capsys.readouterr()
            assert main(["pin", "--url", url, "--api-key", "k3y", "--unpin", pin["id"]]) == 1
            assert "404" in capsys.readouterr().err
        finally:
            asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
            loop.call_soon_threadsafe(loop.stop)
            router.close()


def test_pin_keys_and_records_refuse_what_does_not_fit_the_layout():
    from kvmesh.metadata.keys import InvalidNameError, KeyLayout
    from kvmesh.metadata.records import PinRecord, RecordError

    keys = KeyLayout("c")
    pin_id = "ab" * 16
    assert keys.pin("m1", pin_id) == f"/kvmesh/c/pins/m1/{pin_id}"
    assert keys.parse_pin(keys.pin("m1", pin_id), "m1") == pin_id
    assert keys.parse_pin(keys.pin("m1", pin_id), "m2") is None  # another namespace's pin
    assert keys.parse_pin("/kvmesh/c/pins/m1/../x", "m1") is None
    with pytest.raises(InvalidNameError):
        keys.pin("m1", "not-a-hash")
    record = PinRecord([1, 2, 3], "system", 5.0)
    assert PinRecord.decode(record.encode()) == record
    for bad in (b"\x01\x02", PinRecord([1, -2]).encode(), PinRecord("abc").encode()):
        with pytest.raises(RecordError):
            PinRecord.decode(bad)
