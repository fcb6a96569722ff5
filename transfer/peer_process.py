"""A KV holder in its own process (``python -m kvmesh.transfer.peer_process``), for tests and benchmarks.

Fills a block-major buffer with seeded random data, caches a chain of blocks
under known hashes (optionally one block every --delay-ms, like a prefill in
progress), serves push requests from the requesters named by ``--requester``
(PeerRecord JSON: its static directory; the cluster token comes from
$KVMESH_CLUSTER_TOKEN), prints its own PeerRecord as JSON, and answers commands
on stdin: ``check`` -> integrity of its pool and how many blocks are pinned; ``wire N REPEAT REQUESTER`` -> the
seconds a bare engine write of its first N chain blocks into that requester's landing slots takes (median of
REPEAT after one more: the wire alone, no conversation, no fence; null where the engine refuses writes
without a grant); ``quit``.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time

import torch

from kvmesh.auth import ClusterAuth, token_from_env
from kvmesh.kv.block_hash import hash_blocks, root_hash
from kvmesh.kv.block_pool import BlockPool
from kvmesh.transfer.coalesce import address_descriptors
from kvmesh.transfer.engine import create_transfer_engine
from kvmesh.transfer.kv_agent import TransferAgent
from kvmesh.transfer.peers import PeerRecord, StaticPeers
from kvmesh.kv.shared_buffer import SharedKVAllocator

BLOCK_SHAPE = (2, 2, 16, 2, 8)  # layers, K/V, block_size, kv heads, head dim


def seeded_buffer(num_blocks: int, seed: int, shape=BLOCK_SHAPE) -> torch.Tensor:
    """Random blocks, the same in every process for the same seed (the receiver checks against it)."""
    return torch.randn((num_blocks, *shape), generator=torch.Generator().manual_seed(seed))


def chain_hashes(num_blocks: int, salt: bytes = b"peer-test") -> list[bytes]:
    return hash_blocks(root_hash(salt), list(range(num_blocks * 16)), 16)


def wire_seconds(agent: TransferAgent, requester: PeerRecord, block_ids: list[int], repeat: int) -> float | None:
    """A bare engine write of these blocks into the requester's first landing slots, as a push cuts it."""
    if requester is None or not requester.num_landing_slots or agent.engine.name != "mooncake":
        return None
    bb = agent.block_bytes
    descriptors = address_descriptors([agent.base_addr + b * bb for b in block_ids],
                                      [requester.landing_addr + i * bb for i in range(len(block_ids))], bb,
                                      agent.engine.max_descriptor_bytes)
    times = []
    for _ in range(repeat + 1):
        start = time.perf_counter()
        agent.engine.write(requester.transfer_endpoint, descriptors, timeout_s=60)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--backend", default="zmq")
    p.add_argument("--num-blocks", type=int, default=64)
    p.add_argument("--chain", type=int, default=20, help="blocks of the cached chain")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--delay-ms", type=int, default=0)
    p.add_argument("--block-elems", type=int, default=0, help="fp32 elements per block (default: a small model's)")
    p.add_argument("--contiguous", action="store_true", help="the chain in blocks 0..chain-1, not shuffled")
    p.add_argument("--kv-memory", default="auto", help="direct, host-staging or auto (transfer/kv_memory.py)")
    p.add_argument("--requester", action="append", default=[], help="PeerRecord JSON of a node allowed to ask")
    p.add_argument("--shared-memory", action="store_true", help="its own KV buffer in a memfd, published")
    args = p.parse_args()
    peers = StaticPeers([PeerRecord(**json.loads(r)) for r in args.requester])
    shape = (args.block_elems,) if args.block_elems else BLOCK_SHAPE
    kv = seeded_buffer(args.num_blocks, args.seed, shape)
    shared = SharedKVAllocator() if args.shared_memory else None
    if shared is not None:
        kv = shared.allocate(tuple(kv.shape), kv.dtype).copy_(kv)
    pool = BlockPool(args.num_blocks)
    auth = ClusterAuth(token_from_env())
    agent = TransferAgent(f"holder-{args.seed}", pool, kv, create_transfer_engine(args.backend, auth=auth), peers,
                          auth, verify_kv=True, kv_memory=args.kv_memory,
                          shared_region=shared.region if shared else None).start()
    # Scattered source ids: the chain lives in a shuffled set of blocks.
    everything = pool.allocate(args.num_blocks)
    order = torch.randperm(args.num_blocks, generator=torch.Generator().manual_seed(args.seed + 1)).tolist()
    pool.free(everything)
    chain_ids = list(range(args.chain)) if args.contiguous else order[: args.chain]
    pool.touch(chain_ids)
    hashes = chain_hashes(args.chain)

    def announce() -> None:
        print(json.dumps({"record": dataclasses.asdict(agent.record), "chain_ids": chain_ids,
                          "transport": agent.engine.transport}), flush=True)

    if args.delay_ms:  # a holder still "prefilling": announced first, its chain cached block by block afterwards
        announce()
    parent = -1
    for block, h in zip(chain_ids, hashes):
        if args.delay_ms:
            time.sleep(args.delay_ms / 1000)
        parent = pool.cache([block], [h], parent)[0]
        agent.holder.blocks_cached()
    pool.free(chain_ids)  # cached and free: matchable, evictable only when unpinned
    if not args.delay_ms:  # announced only once it can serve its whole chain
        announce()
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "check":
            pool.check_integrity()
            print(json.dumps({"ok": True, "num_pinned": pool.usage().num_pinned,
                              "num_malformed": agent.num_malformed, "num_cached": len(pool.match(hashes)),
                              "bytes_sent_shared_memory": agent.bytes_sent_shared_memory}), flush=True)
        elif cmd.startswith("wire "):
            _, n, repeat, requester = cmd.split()
            print(json.dumps({"wire_s": wire_seconds(agent, peers.get(requester), chain_ids[:int(n)], int(repeat))}),
                  flush=True)
        elif cmd == "quit":
            break
    agent.close()


if __name__ == "__main__":
    main()
