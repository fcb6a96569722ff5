"""What the transfer tests share: a holder in its own process, requester agents, the fixture, waits."""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import time

import pytest
import torch

from kvmesh.auth import TOKEN_ENV, ClusterAuth
from kvmesh.cluster.node_forkserver import start_module
from kvmesh.kv.block_pool import BlockPool
from kvmesh.transfer.engine import create_transfer_engine, mooncake_available
from kvmesh.transfer.kv_agent import TransferAgent
from kvmesh.transfer.peer_process import BLOCK_SHAPE, seeded_buffer
from kvmesh.transfer.peers import PeerRecord, StaticPeers
from kvmesh.kv.shared_buffer import SharedKVAllocator

BACKENDS = ["zmq"] + (["mooncake"] if mooncake_available() else [])
SHARED = "shared-memory"  # a requester whose KV buffer a holder on this host writes by one copy (engine: zmq)
TOKEN = "transfer-test-token"
AUTH = ClusterAuth(TOKEN)


class Holder:
    """kvmesh.transfer.peer_process as a subprocess that trusts ``requester``."""

    def __init__(self, backend: str, seed: int, requester: TransferAgent | None, chain: int = 20, delay_ms: int = 0,
                 num_blocks: int = 64, token: str = TOKEN, kv_memory: str = "auto", shared_memory: bool | None = None):
        """``shared_memory``: the holder's KV buffer in a published memfd (default: when the requester's is, as
        nodes on one host do; a requester fences in-place copies by the writer's process, known through it)."""
        if shared_memory is None:
            shared_memory = bool(requester is not None and requester.record.shared_memory)
        self.seed, self.num_blocks = seed, num_blocks
        trusted = ["--requester", json.dumps(dataclasses.asdict(requester.record))] if requester else []
        self.proc = start_module(
            "kvmesh.transfer.peer_process", ["--backend", backend, "--seed", str(seed), "--chain", str(chain),
                                             "--delay-ms", str(delay_ms), "--num-blocks", str(num_blocks),
                                             "--kv-memory", kv_memory, *trusted,
                                             *(["--shared-memory"] if shared_memory else [])],
            {**os.environ, TOKEN_ENV: token}, secret_env=(TOKEN_ENV,), stderr=subprocess.DEVNULL)
        self.info = json.loads(self.proc.stdout.readline())
        self.record = PeerRecord(**self.info["record"])
        self.node_id = self.record.node_id
        if requester is not None:
            requester.requester.directory.add(self.record)
        if not delay_ms:  # serving the whole chain before the test asks for it (no race with caching)
            wait_until(lambda: self.check()["num_cached"] == chain)

    def check(self) -> dict:
        self.proc.stdin.write("check\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def wire_seconds(self, num_blocks: int, requester_id: str) -> float | None:
        """A bare engine write of its first blocks into the requester's landing slots (the bench's wire alone)."""
        self.proc.stdin.write(f"wire {num_blocks} 1 {requester_id}\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())["wire_s"]

    def expected_block(self, i: int) -> torch.Tensor:
        return seeded_buffer(self.num_blocks, self.seed)[self.info["chain_ids"][i]]

    def close(self) -> None:
        if self.proc.poll() is None:
            if self.proc.returncode is None:
                self.proc.send_signal(signal.SIGCONT)
            self.proc.stdin.write("quit\n")
            self.proc.stdin.flush()
            self.proc.wait(timeout=10)


def make_agent(name: str, backend: str, num_blocks: int = 48, kv: torch.Tensor | None = None,
               kv_memory: str = "auto", num_landing_slots: int = -1, landing_chunk_bytes: int = -1) -> TransferAgent:
    """``backend`` SHARED: the zmq engine, and the KV buffer in shared memory published to same-host writers."""
    shared = SharedKVAllocator() if backend == SHARED else None
    if shared is not None:
        backend, kv = "zmq", shared.allocate((num_blocks, *BLOCK_SHAPE), torch.float32)
    kv = torch.zeros((num_blocks, *BLOCK_SHAPE)) if kv is None else kv
    agent = TransferAgent(name, BlockPool(kv.shape[0]), kv, create_transfer_engine(backend, auth=AUTH), StaticPeers(),
                          AUTH, verify_kv=True, kv_memory=kv_memory, shared_region=shared and shared.region,
                          num_landing_slots=num_landing_slots, landing_chunk_bytes=landing_chunk_bytes).start()
    agent.test_allocator = shared
    return agent


@pytest.fixture
def requester(request):
    backend = request.param if hasattr(request, "param") else "zmq"
    agent = make_agent("requester", backend)
    yield agent
    agent.close()
    agent.pool.check_integrity()
    agent.grants.check_integrity()
    if agent.test_allocator is not None:
        agent.test_allocator.close()


def kv_of(agent: TransferAgent) -> torch.Tensor:
    return agent.kv_buffer


def wait_until(predicate, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def pull_prefix(agent: TransferAgent, peer_id: str, block_hashes: list, *, timeout_s: float,
                request_id: str) -> list[int]:
    """The longest prefix of ``block_hashes`` that ``peer_id`` holds, pushed into new blocks of ``agent``'s pool
    and cached there, one reference each (the caller's); the rest freed. Raises the push's error when nothing
    arrived."""
    block_ids = agent.pool.allocate(len(block_hashes))
    outcome = agent.requester.push(peer_id, block_ids, block_hashes, request_id=request_id, timeout_s=timeout_s)
    kept = block_ids[:outcome.num_written]
    agent.pool.free(block_ids[outcome.num_written:])
    if not kept and outcome.error is not None:
        raise outcome.error
    return agent.pool.cache(kept, block_hashes[:len(kept)])
