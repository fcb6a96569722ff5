"""Transfer layer: real processes, every byte checked, coalescing, failures, malformed input."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgpack
import pytest
import torch
import zmq

from kvmesh.kv.block_pool import BlockPool
from kvmesh.transfer import messages as m
from kvmesh.transfer.coalesce import BlockRun, coalesce, to_descriptors
from kvmesh.transfer.engine import create_transfer_engine, mooncake_available
from kvmesh.transfer.errors import TransferError, TransferTimeout, check_status
from kvmesh.transfer.kv_agent import PeerInfo, TransferAgent
from kvmesh.transfer.rdma_devices import choose_transport
from kvmesh.transfer.peer_process import BLOCK_SHAPE, chain_hashes, seeded_buffer

BACKENDS = ["zmq"] + (["mooncake"] if mooncake_available() else [])


class Holder:
    """tests/transfer_peer.py as a subprocess."""

    def __init__(self, backend: str, seed: int, chain: int = 20, delay_ms: int = 0, num_blocks: int = 64):
        self.seed, self.num_blocks = seed, num_blocks
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvmesh.transfer.peer_process", "--backend", backend, "--seed", str(seed),
             "--chain", str(chain), "--delay-ms", str(delay_ms), "--num-blocks", str(num_blocks)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self.info = json.loads(self.proc.stdout.readline())
        self.peer = PeerInfo(self.info["node_id"], self.info["side_channel"])

    def check(self) -> dict:
        self.proc.stdin.write("check\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def expected_block(self, i: int) -> torch.Tensor:
        return seeded_buffer(self.num_blocks, self.seed)[self.info["chain_ids"][i]]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.flush()
            self.proc.wait(timeout=10)


@pytest.fixture
def requester(request):
    backend = request.param if hasattr(request, "param") else "zmq"
    kv = torch.zeros((48, *BLOCK_SHAPE))
    pool = BlockPool(48)
    agent = TransferAgent("requester", pool, kv, create_transfer_engine(backend))
    yield agent
    agent.close()
    pool.check_integrity()


def test_coalescing_exact_runs():
    assert coalesce([5, 6, 7, 12, 13], [2, 3, 4, 8, 9]) == [BlockRun(5, 2, 3), BlockRun(12, 8, 2)]
    assert coalesce([1, 2, 3], [7, 9, 10]) == [BlockRun(1, 7, 1), BlockRun(2, 9, 2)]
    assert coalesce([3, 2, 1], [4, 5, 6]) == [BlockRun(3, 4, 1), BlockRun(2, 5, 1), BlockRun(1, 6, 1)]
    assert coalesce([], []) == []
    assert to_descriptors([BlockRun(5, 2, 3)], 1000, 5000, 10) == [(1050, 5020, 30)]
    assert to_descriptors([BlockRun(5, 2, 3)], 1000, 5000, 10, max_bytes=20) == [(1050, 5020, 20), (1070, 5040, 10)]
    with pytest.raises(ValueError):
        coalesce([1], [1, 2])


@pytest.mark.parametrize("requester", BACKENDS, indirect=True)
def test_every_byte_arrives_scattered_ids(requester):
    holder = Holder(requester.engine.name, seed=11)
    try:
        hashes = chain_hashes(20)
        dst = [40, 3, 4, 5, 17, 18, 30, 31, 32, 33, 0, 1, 2, 44, 45, 46, 9, 8, 7, 6]  # scattered on purpose
        requester.pool.allocate(48)  # own all blocks so the ids above are ours to use
        before = requester.kv_buffer.clone()
        written = requester.request_push(holder.peer, dst, hashes, timeout_s=20)
        assert written == [True] * 20
        for i, block in enumerate(dst):
            assert torch.equal(requester.kv_buffer[block], holder.expected_block(i)), f"block {i}"
        untouched = sorted(set(range(48)) - set(dst))
        assert torch.equal(requester.kv_buffer[untouched], before[untouched])
        assert holder.check() == {"ok": True, "num_pinned": 0, "num_malformed": 0}
        requester.pool.free(list(range(48)))
    finally:
        holder.close()


@pytest.mark.parametrize("requester", BACKENDS, indirect=True)
def test_pull_prefix_caches_what_the_peer_holds(requester):
    holder = Holder(requester.engine.name, seed=12, chain=6)
    try:
        hashes = chain_hashes(10)  # the holder has only the first 6
        ids = requester.pull_prefix(holder.peer, hashes, timeout_s=20)
        assert len(ids) == 6
        assert requester.pool.match(hashes) == ids
        for i, block in enumerate(ids):
            assert torch.equal(requester.kv_buffer[block], holder.expected_block(i))
        requester.pool.free(ids)
        requester.pool.check_integrity()
    finally:
        holder.close()


def test_holder_waits_for_blocks_still_being_computed(requester):
    holder = Holder("zmq", seed=13, chain=8, delay_ms=150)  # one block every 150 ms
    try:
        start = time.monotonic()
        ids = requester.pull_prefix(holder.peer, chain_hashes(8), timeout_s=20, wait_ms=5000)
        assert len(ids) == 8 and time.monotonic() - start > 0.5
        for i, block in enumerate(ids):
            assert torch.equal(requester.kv_buffer[block], holder.expected_block(i))
        requester.pool.free(ids)
    finally:
        holder.close()


def test_killed_holder_gives_a_typed_error_and_frees_blocks(requester):
    holder = Holder("zmq", seed=14, chain=8, delay_ms=2000)  # still "prefilling"
    free_before = requester.pool.num_free_blocks
    holder.proc.send_signal(signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(TransferTimeout, match="holder-14"):
        requester.pull_prefix(holder.peer, chain_hashes(8), timeout_s=1.5, wait_ms=10000)
    assert time.monotonic() - start < 5
    assert requester.pool.num_free_blocks == free_before
    requester.pool.check_integrity()


def test_requester_abort_unpins_on_the_holder(requester):
    holder = Holder("zmq", seed=15, chain=8, delay_ms=300)
    try:
        with pytest.raises(TransferTimeout):  # gives up early and sends Abort
            requester.pull_prefix(holder.peer, chain_hashes(8), timeout_s=0.5, wait_ms=20000)
        time.sleep(0.5)
        assert holder.check()["num_pinned"] == 0
        requester.pool.check_integrity()
    finally:
        holder.close()


def test_holder_abort_reaches_the_requester():
    kv = torch.randn((16, *BLOCK_SHAPE))
    holder_pool, req_pool = BlockPool(16), BlockPool(16)
    holder = TransferAgent("h", holder_pool, kv, create_transfer_engine("zmq"))
    req = TransferAgent("r", req_pool, torch.zeros_like(kv), create_transfer_engine("zmq"))
    try:
        timer = threading.Timer(0.3, holder.abort, args=("req-1", "holder shutting down"))
        timer.start()
        with pytest.raises(TransferError, match="holder shutting down|aborted"):
            req.pull_prefix(holder.info, chain_hashes(4), request_id="req-1", timeout_s=5, wait_ms=3000)
        holder_pool.check_integrity()
        req_pool.check_integrity()
        assert req_pool.num_free_blocks == 16
    finally:
        holder.close()
        req.close()


def test_malformed_messages_are_refused_and_the_holder_keeps_serving(requester):
    holder = Holder("zmq", seed=16, chain=4)
    try:
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.connect(f"tcp://{holder.peer.side_channel}")
        bad = [b"\xc1garbage", msgpack.packb([1, 2]), msgpack.packb({"type": "nope"}),
               msgpack.packb({"type": "push_request", "request_id": 5}),
               msgpack.packb({"type": "push_request", "request_id": "x", "requester_id": "y",
                              "transfer_endpoint": "z", "dst_base_addr": 0, "block_bytes": 64,
                              "dst_block_ids": [1], "block_hashes": [b"short"]})]
        for payload in bad:
            sock.send(payload)
            reply = m.decode(sock.recv())
            assert isinstance(reply, m.Abort) and "malformed" in reply.reason
        sock.close()
        ids = requester.pull_prefix(holder.peer, chain_hashes(4), timeout_s=10)
        assert len(ids) == 4
        requester.pool.free(ids)
        assert holder.check()["num_malformed"] == len(bad)
    finally:
        holder.close()


@pytest.mark.parametrize("payload,match", [
    (b"\xc1", "not a msgpack"), (msgpack.packb(3), "expected a map"), (msgpack.packb({"type": "x"}), "unknown or unexpected message"),
    (msgpack.packb({"type": "abort"}), "missing fields"),
    (msgpack.packb({"type": "abort", "request_id": "a", "extra": 1}), "unknown fields"),
    (msgpack.packb({"type": "prefill_done", "request_id": "a", "first_token": True, "logprob": 0.0,
                    "num_computed_tokens": 1}), "first_token"),
])
def test_message_validation(payload, match):
    with pytest.raises(m.MessageError, match=match):
        m.decode(payload)


def test_messages_round_trip():
    for msg in (m.PushRequest("r", "n", "h:1", 4096, 128, [1, 2], [b"a" * 16, b"b" * 16], 50),
                m.PushResult("r", [True, False], final=False), m.PrefillDone("r", 42, -0.5, 17), m.Abort("r", "why")):
        assert m.decode(m.encode(msg)) == msg


def test_transport_is_reported_and_rdma_without_device_says_so(tmp_path, caplog):
    empty = tmp_path / "infiniband"
    empty.mkdir()
    choice = choose_transport("rdma", sysfs=empty)
    assert choice.protocol == "tcp" and "no RDMA device" in choice.reason
    (empty / "rxe0").mkdir()
    assert choose_transport("auto", sysfs=empty).protocol == "rdma"
    assert choose_transport("tcp", sysfs=empty).protocol == "tcp"
    engine = create_transfer_engine("zmq")
    assert engine.transport == "zmq-tcp"
    engine.close()
    if mooncake_available():
        mc = create_transfer_engine("mooncake", transport="rdma")
        assert mc.transport == ("rdma" if choose_transport("auto").devices else "tcp")
        assert "no RDMA device" in mc.transport_reason or mc.transport == "rdma"


def test_native_status_codes_become_typed_errors():
    check_status(0, what="x")
    with pytest.raises(TransferError, match=r"write failed \(request r1, peer p:1, status -1\)"):
        check_status(-1, what="write", request_id="r1", peer="p:1")


def test_softroce_script_explains_what_is_missing():
    script = Path(__file__).resolve().parents[1] / "deploy" / "softroce.sh"
    res = subprocess.run(["bash", str(script), "no-such-if0"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 1
    assert "softroce:" in res.stderr and ("no network interface 'no-such-if0'" in res.stderr
                                          or "run as root" in res.stderr)


def test_stale_index_entry_is_advisory(requester):
    """The index claims 10 blocks; the holder has evicted all but 6: 6 arrive, the rest is computed."""
    from kvmesh.metadata.block_index import BlockIndex, BlockPublisher
    from kvmesh.metadata.memory_store import MemoryStore

    holder = Holder("zmq", seed=17, chain=6)
    store = MemoryStore()
    publisher = BlockPublisher(store, "c", "ns", holder.peer.node_id)
    publisher.set_lease(store.grant_lease(10))
    index = BlockIndex(store, "c", "ns")
    try:
        hashes = chain_hashes(10)
        publisher.publish(hashes)  # what the holder once had
        assert publisher.flush() and index.mirror.wait_healthy(5)
        assert index.lookup(hashes) == {holder.peer.node_id: 10}
        ids = requester.pull_prefix(holder.peer, hashes[:10], timeout_s=10)
        assert len(ids) == 6
        for i, block in enumerate(ids):
            assert torch.equal(requester.kv_buffer[block], holder.expected_block(i))
        requester.pool.free(ids)
        assert holder.check()["num_pinned"] == 0
    finally:
        publisher.close()
        index.close()
        holder.close()
