"""Lower KV tiers in real node processes with a real etcd: promotion, pushes from a host tier, a corrupted
disk block recomputed, and a restart that re-adopts and re-publishes its disk tier."""
from __future__ import annotations

import random
import time

import pytest

from kvmesh import LLM, SamplingParams
from kvmesh.cluster.local_launcher import LocalCluster
from kvmesh.kv.block_hash import hash_blocks
from kvmesh.kv.tiers.media import DiskLayout, DiskMedium
from kvmesh.metadata.sealed_store import open_store
from kvmesh.metadata.keys import KeyLayout
from kvmesh.metadata.block_index import read_holdings
from kvmesh.metadata.records import NodeRecord
from tests.conftest import assert_same_kv

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
BLOCK_BYTES = 8192  # tiny-llama, float32, 16 tokens per block
TIER0 = ["--num-kv-blocks", "12", "--transfer-backend", "zmq", "--host-kv-gib", "0"]


def gib(num_blocks: int) -> str:
    return repr(num_blocks * BLOCK_BYTES / 2**30)


def prompt(seed: int, length: int = 80) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(length)]


@pytest.fixture(scope="module")
def reference():
    llm = LLM("tiny-llama", num_kv_blocks=1024, progress=False)

    def run(prompts: list[list[int]]) -> list[list[int]]:
        return [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]

    run.llm = llm  # its cached KV is the KV-level oracle's reference
    return run


def wait_until(predicate, timeout_s: float = 60.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def check_all(cluster: LocalCluster) -> None:
    for node_id in cluster.nodes:
        stats = cluster.client(node_id).stats(check=True)  # pools and tiers consistent
        assert stats["num_pinned"] == 0


def run(cluster: LocalCluster, node_id: str, prompts: list[list[int]]):
    out = cluster.client(node_id).generate_many(prompts, GREEDY)
    assert [c.error for c in out] == [""] * len(prompts)
    return out


def run_each(cluster: LocalCluster, node_id: str, prompts: list[list[int]], counter: str) -> None:
    """One prompt at a time, each time until the demoter copied its 5 cached blocks (80 + 10 tokens)."""
    for i, p in enumerate(prompts):
        run(cluster, node_id, [p])
        wait_until(lambda n=5 * (i + 1): cluster.client(node_id).stats()[counter] >= n, what=counter)


def index_of(cluster: LocalCluster, node_id: str) -> dict[int, int]:
    """What etcd's global index lists for ``node_id``: block key (``holdings.block_key``) -> tier."""
    store = open_store(cluster.etcd_endpoint, cluster.token)
    try:
        nodes = read_holdings(store, KeyLayout(cluster.cluster)).table.nodes
    finally:
        store.close()
    return nodes[node_id].blocks.as_dict() if node_id in nodes else {}


def record_of(cluster: LocalCluster, node_id: str) -> NodeRecord:
    store = open_store(cluster.etcd_endpoint, cluster.token)
    try:
        items, _ = store.get_prefix(KeyLayout(cluster.cluster).node(node_id))
    finally:
        store.close()
    return NodeRecord.decode(items[0].value)


def test_host_tier_promotes_locally_and_serves_peers(reference):
    args = TIER0 + ["--host-kv-gib", gib(48), "--kv-placement", "threshold:0"]
    with LocalCluster(num_prefill=0, num_decode=2, node_args=args, cluster="tiers-host") as c:
        prompts = [prompt(i) for i in range(4)]  # 6 blocks each with the answer: 24 > tier 0's 12
        run_each(c, "decode-0", prompts, "tier_demoted_host")
        again = run(c, "decode-0", prompts[:1])[0]
        assert again.token_ids == reference(prompts[:1])[0]
        assert again.stats.tokens_reused_host == 64  # its 4 full prompt blocks came back from host memory
        assert again.stats.tokens_computed == 16
        assert_same_kv(c.client("decode-0"), reference.llm, prompts[0], min_blocks=4)  # promoted into place
        # decode-1 has nothing: decode-0 pushes blocks that are in its host tier only (published as tier 1)
        wait_until(lambda: 1 in index_of(c, "decode-0").values(), what="host-tier blocks in the index")
        pulled = run(c, "decode-1", prompts[1:2])[0]
        assert pulled.token_ids == reference(prompts[1:2])[0]
        assert pulled.stats.tokens_reused_remote == 64
        assert_same_kv(c.client("decode-1"), reference.llm, prompts[1], min_blocks=4)  # pushed from host memory
        stats = c.client("decode-0").stats()
        assert stats["tier_served_host"] > 0 and stats["tier_corrupt"] == 0
        check_all(c)


def test_disk_tier_corruption_is_recomputed_and_a_restart_re_adopts(reference, tmp_path):
    args = TIER0 + ["--disk-kv-gib", gib(64), "--disk-kv-path", str(tmp_path), "--no-global-pool",
                    "--kv-placement", "threshold:0"]
    with LocalCluster(num_prefill=0, num_decode=1, node_args=args, cluster="tiers-disk") as c:
        prompts = [prompt(10 + i) for i in range(4)]
        run_each(c, "decode-0", prompts, "tier_demoted_disk")
        root = bytes.fromhex(record_of(c, "decode-0").model.root_hash)
        hashes = hash_blocks(root, prompts[0][:64], 16)
        medium = DiskMedium(tmp_path / "decode-0.kvtier", DiskLayout(root, BLOCK_BYTES, 64))
        slots = {h.block_hash: h.slot for h in medium.scan()}
        assert all(h in slots for h in hashes)
        medium.corrupt(slots[hashes[1]], offset=100)  # block 1 of prompt 0, behind the node's back
        medium.close()
        again = run(c, "decode-0", prompts[:1])[0]
        assert again.token_ids == reference(prompts[:1])[0]  # recomputed, never served corrupted
        assert again.stats.tokens_reused_disk == 16  # block 0 only
        stats = c.client("decode-0").stats(check=True)
        assert stats["tier_corrupt"] == 1
        # Restart under the same id: the disk file is re-adopted and its blocks published again (tier 2).
        wait_until(lambda: c.client("decode-0").stats()["tier_disk_blocks"] == len(index_of(c, "decode-0")),
                   what="every published block on disk")
        before = set(index_of(c, "decode-0"))
        node = c.nodes["decode-0"]
        node.proc.stdin.write("quit\n")
        node.proc.stdin.flush()
        node.proc.wait(timeout=30)
        c._clients.pop("decode-0").close()
        c.start_node("decode", "decode-0")
        wait_until(lambda: set(index_of(c, "decode-0")) == before, what="re-publishing the disk tier")
        after = index_of(c, "decode-0")
        assert set(after.values()) == {2}
        assert c.client("decode-0").stats()["tier_disk_blocks"] == len(after)
        third = run(c, "decode-0", prompts[2:3])[0]
        assert third.token_ids == reference(prompts[2:3])[0]
        assert third.stats.tokens_reused_disk == 64
        assert_same_kv(c.client("decode-0"), reference.llm, prompts[2], min_blocks=4)  # re-adopted from disk
        check_all(c)
