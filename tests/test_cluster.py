"""Disaggregated serving with real processes: prefill and decode nodes, etcd, transfers, faults."""
from __future__ import annotations

import random
import signal
import time

import pytest
import zmq

from kvmesh import LLM, SamplingParams
from kvmesh.auth import REFUSED
from kvmesh.cluster.client import RequestFailed
from kvmesh.cluster.local_launcher import LocalCluster
from kvmesh.node.core_share import machine_cores
from kvmesh.node.messages import GenerateRequest, TokenEvent
from kvmesh.transfer.engine import mooncake_available
from kvmesh.wire import decode
from tests.conftest import assert_same_kv

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
# Force the remote path: decode nodes compute no prompt token (a sampled request: its last one).
REMOTE_ONLY = ["--kv-placement", "threshold:0", "--prefill-timeout", "4"]
BACKENDS = ["zmq"] + (["mooncake"] if mooncake_available() else [])


@pytest.fixture(scope="module")
def reference():
    llm = LLM("tiny-llama", num_kv_blocks=1024, progress=False)

    def run(prompts: list[list[int]]) -> list[list[int]]:
        return [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]

    run.llm = llm  # its cached KV is the KV-level oracle's reference
    return run


@pytest.fixture(scope="module", params=BACKENDS)
def cluster(request):
    """2 prefill + 3 decode nodes moving KV over each transfer backend (every test runs on both).

    decode-2 computes every prompt itself (``--kv-placement threshold:100000``): what it caches is held by no
    prefill node, so a prefill node asked to extend it must pull it first. prefill-1 and decode-1 register a host mirror of their KV buffer (what nodes on a GPU without
    GPUDirect do), so pushes run direct -> direct, direct <-> staged and staged -> staged. With zmq, nodes
    keep their (direct) KV buffers in shared memory, so pushes into decode-0 and prefill-0 are same-host copies;
    with Mooncake every push goes through the engine (--no-shared-memory-transfers)."""
    # Tests here assert that prefill nodes did the work: a generous timeout keeps a CPU-starved prefill node
    # from being given up on (the fault tests below keep REMOTE_ONLY's short one).
    args = REMOTE_ONLY + ["--transfer-backend", request.param, "--prefill-timeout", "30"]
    if request.param == "mooncake":
        args.append("--no-shared-memory-transfers")
    staged = ["--kv-transfer-memory", "host-staging"]
    local = ["--kv-placement", "threshold:100000"]
    with LocalCluster(num_prefill=2, num_decode=3, node_args=args, cluster=f"t2x2{request.param}",
                      per_node_args={"prefill-1": staged, "decode-1": staged, "decode-2": local}) as c:
        yield c


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(length)]


def check_all(cluster: LocalCluster) -> None:
    for node_id in cluster.nodes:
        if cluster.nodes[node_id].proc.poll() is None:
            stats = cluster.client(node_id).stats(check=True)  # raises on a failed integrity check
            assert stats["num_pinned"] == 0


def test_one_prefill_one_decode_matches_the_single_node_engine(cluster, reference):
    prompts = [prompt(i, n) for i, n in enumerate((70, 33, 100, 17, 48))]
    out = cluster.client("decode-0").generate_many(prompts, GREEDY)
    assert [c.error for c in out] == [""] * 5
    assert [c.token_ids for c in out] == reference(prompts)
    assert all(c.stats.tokens_from_prefill_node > 0 for c, p in zip(out, prompts) if len(p) > 32)
    check_all(cluster)


def test_a_node_computing_alone_computes_on_every_core(cluster, reference):
    """The launcher's nodes share this machine's cores (kvmesh/node/core_share.py): decode-2 computes a prompt
    while every other node idles, so its prompt step runs on every core, its decode steps on all but one or on
    every one, as its probe of the two measures faster."""
    p = prompt(99, 40)
    out = cluster.client("decode-2").generate(p, GREEDY)
    assert out.error == "" and out.token_ids == reference([p])[0]
    cores = machine_cores()
    stats = cluster.client("decode-2").stats()
    assert stats["compute_threads"]["prompt"] == cores
    assert stats["compute_threads"]["decode"] in {max(1, cores - 1), cores}
    assert set(stats["decode_thread_choices"]) <= {f"{max(1, cores - 1)}-{cores}"}
    check_all(cluster)


def test_nodes_freeze_their_start_up_objects_and_count_collections(cluster):
    """A node's start-up objects (model, pool, stacks) are frozen out of the collector's full walks, which
    would otherwise stop the engine thread for a tenth of a second or more (kvmesh/gc_pauses.py), and
    its stats count every collection since serving began."""
    for node_id in ("prefill-0", "decode-0"):
        stats = cluster.client(node_id).stats()
        assert stats["gc_frozen_objects"] > 50_000, stats["gc_frozen_objects"]
        assert len(stats["gc_collections"]) == len(stats["gc_max_pause_ms"]) == len(stats["gc_total_pause_ms"]) == 3


def test_host_staged_nodes_compute_what_the_single_node_engine_does(cluster, reference):
    prompts = [prompt(40 + i, n) for i, n in enumerate((70, 100, 48))]
    landed = cluster.client("decode-1").stats()["landing"].get("landed", 0)
    staged_in, staged_out = (cluster.client(n).stats()["kv_memory"] for n in ("decode-1", "prefill-1"))
    assert staged_in["mode"] == staged_out["mode"] == "host-staging"
    assert cluster.client("decode-0").stats()["kv_memory"]["mode"] == "direct"
    # Fresh prompts each round: the decode node's prefill conversations take turns between the prefill nodes
    # (each plan's reservation moves the rotation on), so every pair of host-staged and direct nodes is used.
    for round_, decode_id in enumerate(["decode-1", "decode-0", "decode-1"]):
        out = cluster.client(decode_id).generate_many(prompts, GREEDY)
        assert [c.error for c in out] == [""] * 3 and [c.token_ids for c in out] == reference(prompts)
        assert all(c.stats.tokens_from_prefill_node > 0 for c in out)
        prompts = [prompt(60 + 3 * round_ + i, n) for i, n in enumerate((70, 100, 48))]
    after_in, after_out = (cluster.client(n).stats()["kv_memory"] for n in ("decode-1", "prefill-1"))
    landing = cluster.client("decode-1").stats()["landing"]
    if landing:  # one-sided writes land in slots and are copied out checked, past the mirror
        assert landing["landed"] > landed and after_in["blocks_staged_in"] == staged_in["blocks_staged_in"]
    else:
        assert after_in["blocks_staged_in"] > staged_in["blocks_staged_in"]
    assert after_out["blocks_staged_out"] > staged_out["blocks_staged_out"]
    check_all(cluster)


def test_the_shared_memory_round_trip_is_measured_at_start(cluster):
    """decode-0 (KV in shared memory) seeds that link's round trip with a fetch from itself at start-up;
    decode-1 (host-staged: no shared region) has no such link; with Mooncake here shared memory is off."""
    shared = "--no-shared-memory-transfers" not in cluster.node_args
    d0, d1 = (cluster.client(n).stats() for n in ("decode-0", "decode-1"))
    assert ("shared-memory" in d0["rtt_ms_by_link"]) == shared
    if shared:
        assert d0["rtt_ms_by_link"]["shared-memory"] > 0
    assert "shared-memory" not in d1["rtt_ms_by_link"]
    check_all(cluster)


def test_every_node_reports_what_the_router_reads_as_a_typed_record(cluster):
    """Each ``NodeLoadStats`` field is one of the node's counters (none left at its default by a renamed key), and
    the record carries their values."""
    from dataclasses import fields

    from kvmesh.node.messages import NodeLoadStats

    required = {f.name for f in fields(NodeLoadStats)} - set(NodeLoadStats.OPTIONAL)
    for node_id, node in cluster.nodes.items():
        stats, load = cluster.client(node_id).stats(), cluster.client(node_id).load()
        assert required <= set(stats), (node_id, required - set(stats))
        assert load.role == node.role == stats["role"] and load.num_kv_blocks == stats["num_kv_blocks"] > 0
        assert load.max_num_seqs == stats["max_num_seqs"] > 0


def test_cross_node_prefix_reuse_by_counters(cluster, reference):
    prefix = prompt(100, 96)  # 6 blocks
    first, second = prefix + prompt(101, 20), prefix + prompt(102, 25)
    prefill_ids = ("prefill-0", "prefill-1")

    def prefill_totals() -> dict[str, int]:
        stats = [cluster.client(n).stats() for n in prefill_ids]
        return {k: sum(s[k] for s in stats) for k in ("tokens_computed", "bytes_received", "tokens_pulled")}

    before = prefill_totals()
    out1 = cluster.client("decode-2").generate(first, GREEDY)  # computed there: no prefill node holds it
    wait_until_published(cluster, prefix, 6)  # publication to the global index is asynchronous
    out2 = cluster.client("decode-1").generate(second, GREEDY)
    assert [out1.token_ids, out2.token_ids] == reference([first, second])
    after = prefill_totals()
    # decode-1 got the prefix from its holder (decode-2); the prefill node had the suffix to do, after pulling
    # the prefix it attends to from that holder.
    assert out1.stats.tokens_from_prefill_node == 0 and out2.stats.tokens_reused_remote >= 96
    assert 0 < out2.stats.fetch_ms <= out2.stats.kv_wait_ms  # the fetch thread's part of the KV wait
    assert out1.stats.fetch_ms == out1.stats.kv_wait_ms == 0  # computed where it landed: no fetch
    # The KV itself, position by position: received blocks in the wrong slots leave greedy tokens unchanged.
    assert_same_kv(cluster.client("decode-1"), reference.llm, second, min_blocks=(len(second) - 1) // 16)
    assert 0 < after["tokens_computed"] - before["tokens_computed"] <= len(second) - 96
    assert after["bytes_received"] > before["bytes_received"]
    assert after["tokens_pulled"] - before["tokens_pulled"] >= 96
    shared_bytes = sum(cluster.client(n).stats()["bytes_sent_shared_memory"] for n in cluster.nodes)
    assert (shared_bytes > 0) == (cluster.node_args.count("--no-shared-memory-transfers") == 0), shared_bytes
    # A conversation's next turn on the same decode node asks only for the new blocks.
    turn2 = first + out1.token_ids + prompt(103, 30)
    out3 = cluster.client("decode-2").generate(turn2, GREEDY)
    assert out3.token_ids == reference([turn2])[0]
    assert out3.stats.tokens_reused_local >= (len(first) + len(out1.token_ids)) // 16 * 16 - 16
    check_all(cluster)


SOURCES = ("tokens_reused_local", "tokens_reused_host", "tokens_reused_disk", "tokens_reused_remote",
           "tokens_reused_prefill_node", "tokens_from_prefill_node", "tokens_computed")


def test_a_prefill_nodes_own_cache_hits_are_counted_as_reused(reference):
    """A decode node that caches nothing itself (and looks nothing up) sends every prompt to the prefill node;
    the second prompt sharing an 80-token prefix is pushed partly from the prefill node's cache: those tokens are
    counted as reused there (``tokens_reused_prefill_node``), not as computed by it, and every source sums to
    the prompt."""
    args = REMOTE_ONLY + ["--transfer-backend", "zmq", "--prefill-timeout", "30"]
    with LocalCluster(1, 1, node_args=args, cluster="prefill-reuse",
                      per_node_args={"decode-0": ["--no-prefix-cache", "--no-global-pool", "--host-kv-gib", "0"]}) as c:
        shared = prompt(800, 80)
        stats = []
        for tail in (prompt(801, 40), prompt(802, 40)):
            out = c.client("decode-0").generate(shared + tail, GREEDY)
            assert out.error == "" and out.token_ids == reference([shared + tail])[0]
            assert sum(getattr(out.stats, k) for k in SOURCES) == len(shared + tail), out.stats
            stats.append(out.stats.as_dict())
        assert stats[0]["tokens_reused_prefill_node"] == 0 and stats[0]["tokens_from_prefill_node"] >= 112
        assert stats[1]["tokens_reused_prefill_node"] == 80, stats[1]
        # The new full blocks, then the partial last block, its last token included: a greedy request's first
        # token came with it, so the decode node computed none.
        assert stats[1]["tokens_from_prefill_node"] == 32 + 8 and stats[1]["tokens_computed"] == 0, stats[1]
        check_all(c)


def test_a_prefill_node_sends_the_last_block_and_a_greedy_first_token(cluster, reference):
    """Every prompt token reaches the decode node from a prefill node, the block holding the last token included
    (``ComputeAndPush.with_tail``), with the token the prefill node picked after the prompt: a greedy request
    streams it as its first and computes no prompt token (a last token alone in its block included); a sampled
    one computes the last token itself, for its own draw, and draws what the engine alone draws with its seed. On
    both decode nodes (in place and host-staged) and, by rotation, from both prefill nodes; the last block's KV,
    completed by the decoded tokens into a full block there, equals a full recompute's."""
    for i, node_id in enumerate(("decode-0", "decode-1", "decode-0", "decode-1")):
        ids = prompt(950 + i, 41 if i < 2 else 33)  # two full blocks, then 9 tokens or the last one alone
        out = cluster.client(node_id).generate(ids, GREEDY)
        assert out.error == "" and out.token_ids == reference([ids])[0]
        assert (out.stats.tokens_from_prefill_node, out.stats.tokens_computed) == (len(ids), 0), out.stats
        full = ids + out.token_ids[:-1]  # the last block completed by the decoded tokens (three blocks, or two)
        assert_same_kv(cluster.client(node_id), reference.llm, full, min_blocks=len(full) // 16)
    sampled = SamplingParams(max_tokens=6, temperature=0.9, seed=11, ignore_eos=True)
    for i, node_id in enumerate(("decode-0", "decode-1")):
        ids = prompt(960 + i, 41)
        out = cluster.client(node_id).generate(ids, sampled)
        alone = reference.llm.generate([ids], sampled, use_tqdm=False)[0].outputs[0].token_ids
        assert out.error == "" and out.token_ids == alone
        assert (out.stats.tokens_from_prefill_node, out.stats.tokens_computed) == (40, 1), out.stats
    check_all(cluster)


def test_every_prompt_token_is_counted_once(cluster, reference):
    """A mixed workload: prefill-node pushes, peers' caches, local hits, short prompts computed here. Each
    request's four sources sum to its prompt, and the decode nodes' totals are the sums of their requests."""
    keys = SOURCES
    before = {n: cluster.client(n).stats() for n in ("decode-0", "decode-1")}
    totals = {n: dict.fromkeys(keys, 0) for n in before}

    def run(node_id: str, ids: list[int]) -> dict:
        out = cluster.client(node_id).generate(ids, GREEDY)
        assert out.error == "" and out.token_ids == reference([ids])[0]
        counts = out.stats.as_dict()
        assert sum(counts[k] for k in keys) == len(ids) and all(counts[k] >= 0 for k in keys), out.stats
        for k in keys:
            totals[node_id][k] += counts[k]
        return counts

    shared = prompt(500, 80)
    assert run("decode-0", shared + prompt(501, 30))["tokens_from_prefill_node"] > 0
    assert run("decode-0", shared + prompt(502, 5))["tokens_reused_local"] >= 80
    assert run("decode-1", prompt(503, 9))["tokens_computed"] == 9  # under a block: nothing to fetch
    # A prefix held by a peer only: decode-2 computes it (no prefill node holds it, so no prefill node can offer it
    # from its own cache), and decode-1 fetches it from there once the global index has it.
    held_by_peer = prompt(504, 80)
    assert cluster.client("decode-2").generate(held_by_peer + prompt(505, 7), GREEDY).error == ""
    wait_until_published(cluster, held_by_peer, 5)
    assert run("decode-1", held_by_peer + prompt(506, 21))["tokens_reused_remote"] >= 80
    for node_id, stats in before.items():
        after = cluster.client(node_id).stats()
        assert {k: after[f"prompt_{k}"] - stats[f"prompt_{k}"] for k in keys} == totals[node_id]
    check_all(cluster)


def test_two_hundred_concurrent_requests(cluster, reference):
    """...streamed in batched frames: one per step per connection, not one per token per request."""
    prompts = [prompt(1000 + i, 20 + (i * 7) % 60) for i in range(200)]
    expected = reference(prompts)
    before = {n: cluster.client(n).stats() for n in ("decode-0", "decode-1")}
    halves = [cluster.client("decode-0").generate_many(prompts[:100], GREEDY, timeout_s=300),
              cluster.client("decode-1").generate_many(prompts[100:], GREEDY, timeout_s=300)]
    got = [c.token_ids for half in halves for c in half]
    assert [c.error for half in halves for c in half] == [""] * 200
    assert got == expected
    for node, old in before.items():
        new = cluster.client(node).stats()
        events, frames = (new[k] - old[k] for k in ("num_events_sent", "num_event_frames"))
        assert events >= 100 * (GREEDY.max_tokens + 1)  # every token and every end
        assert frames * 4 <= events, (events, frames)  # many requests' tokens share a step's frame
    check_all(cluster)


def test_dead_prefill_node_and_etcd_outage_do_not_lose_requests(reference):
    # Prefill in 8-token steps, so a 900-token prompt is mid-prefill for a while.
    args = REMOTE_ONLY + ["--lease-ttl", "30", "--max-num-batched-tokens", "8"]
    with LocalCluster(num_prefill=2, num_decode=1, node_args=args, cluster="faults") as c:
        long_prompt = prompt(1999, 900)
        d0 = c.client("decode-0")
        events = d0.submit(GenerateRequest("mid-kill", long_prompt, {"max_tokens": 10, "temperature": 0.0,
                                                                     "ignore_eos": True}))
        busy: list[str] = []
        wait_until(lambda: busy.extend(n for n in ("prefill-0", "prefill-1")
                                       if c.client(n).stats()["num_running"] >= 1) or busy)
        c.nodes[busy[0]].kill()  # killed mid-prefill, still registered (30 s lease)
        tokens, event = [], None
        while event is None or not event.finished:
            event = events.get(timeout=60)  # queue.Empty here: the request was lost
            assert isinstance(event, TokenEvent), event
            tokens += event.token_ids
        assert event.error == "" and tokens == reference([long_prompt])[0]
        prompts = [prompt(2000 + i, 60) for i in range(3)]
        out = d0.generate_many(prompts, GREEDY, timeout_s=120)  # turns between the prefill nodes: one is dead
        assert [o.token_ids for o in out] == reference(prompts)
        assert d0.stats(check=True)["num_fallbacks"] >= 2
        check_all(c)
        c.stop_etcd()
        more = [prompt(3000 + i, 50) for i in range(3)]
        out = c.client("decode-0").generate_many(more, GREEDY, timeout_s=120)
        assert [o.token_ids for o in out] == reference(more)
        c.start_etcd()
        check_all(c)


def test_a_silent_holder_is_given_up_on_after_the_holder_timeout(reference):
    """decode-0 holds a prefix and stops answering (SIGSTOP, its lease still valid): decode-1 plans to fetch the
    prefix from it, waits ``--holder-timeout`` for the push (well under the 5 s default), then gets the blocks
    elsewhere and answers correctly, counting nothing as reused from that holder."""
    args = ["--transfer-backend", "zmq", "--holder-timeout", "0.5", "--prefill-timeout", "30"]
    per_node = {"decode-0": ["--kv-placement", "threshold:100000"], "decode-1": ["--kv-placement", "threshold:0"]}
    with LocalCluster(num_prefill=1, num_decode=2, node_args=args, cluster="holder-timeout",
                      per_node_args=per_node) as c:
        prefix = prompt(4000, 96)
        first, second = prefix + prompt(4001, 20), prefix + prompt(4002, 20)
        assert c.client("decode-0").generate(first, GREEDY).token_ids == reference([first])[0]
        wait_until_published(c, prefix, 6)
        c.nodes["decode-0"].proc.send_signal(signal.SIGSTOP)
        try:
            out = c.client("decode-1").generate(second, GREEDY, timeout_s=60)
        finally:
            c.nodes["decode-0"].proc.send_signal(signal.SIGCONT)
        assert out.error == "" and out.token_ids == reference([second])[0]
        assert out.stats.tokens_reused_remote == 0, out.stats  # nothing came from the silent holder
        assert 500 <= out.stats.kv_wait_ms < 5000, out.stats  # it waited the holder timeout, not the default
        check_all(c)


def test_dead_decode_node_is_a_clear_error_for_the_caller():
    with LocalCluster(num_prefill=1, num_decode=1, node_args=REMOTE_ONLY, cluster="dead-decode") as c:
        client = c.client("decode-0")
        c.nodes["decode-0"].kill()
        start = time.monotonic()
        with pytest.raises(RequestFailed, match="stopped answering"):
            client.generate(prompt(5, 40), GREEDY, liveness_s=1.0)
        assert time.monotonic() - start < 10


def wait_until_published(cluster: LocalCluster, token_ids: list[int], num_blocks: int,
                         model: str = "tiny-llama") -> None:
    """Until some node's entries for the first ``num_blocks`` blocks of ``token_ids`` are in etcd (the nodes run
    ``model``)."""
    from kvmesh.metadata.block_index import BlockIndex
    from kvmesh.metadata.sealed_store import open_store
    from kvmesh.node.runtime import index_namespace

    engine = LLM(model, num_kv_blocks=64, progress=False).engine  # the nodes' model: the same hashes
    hashes = engine.kv.hash_prompt(token_ids)[:num_blocks]
    store = open_store(cluster.etcd_endpoint, cluster.token)
    index = BlockIndex(store, cluster.cluster, index_namespace(engine.namespace))
    try:
        wait_until(lambda: max(index.lookup_direct(hashes).values(), default=0) >= num_blocks)
    finally:
        index.close()
        store.close()


def wait_until(predicate, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_bad_requests_get_clear_errors(cluster):
    client = cluster.client("decode-0")
    out = client.generate([], GREEDY)
    assert "empty" in out.error and out.token_ids == []
    out = client.generate([1, 2, 99999], GREEDY)
    assert "vocabulary" in out.error
    assert "bogus" in client.submit(GenerateRequest("x", [1], {"max_tokens": 1, "bogus": 2})).get(timeout=10).error
    raw = cluster.auth.curve_client(zmq.Context.instance().socket(zmq.DEALER))
    raw.linger = 0
    raw.connect(f"tcp://{cluster.nodes['decode-0'].info['requests']}")
    raw.send(cluster.auth.seal(b"\xc1 not msgpack"))  # authenticated, but not a message
    assert raw.poll(10_000)
    assert "malformed" in decode(cluster.auth.open(raw.recv()), (TokenEvent,)).error
    raw.send(b"\xc1 not msgpack")  # no cluster MAC at all: refused before decoding
    assert raw.poll(10_000) and raw.recv() == REFUSED
    raw.close()
    check_all(cluster)
