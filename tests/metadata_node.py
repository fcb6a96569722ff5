"""A node in its own process for the metadata tests: registers, publishes a chain, answers lookups.

stdin commands: ``lookup <salt> <n>`` -> JSON of its index's answer for that chain; ``quit``.
"""
from __future__ import annotations

import json
import sys

from kvmesh.kv.block_hash import hash_blocks, root_hash
from kvmesh.metadata.block_index import BlockIndex, BlockPublisher
from kvmesh.metadata.etcd_store import EtcdStore
from kvmesh.metadata.records import NodeRecord
from kvmesh.metadata.registry import NodeRegistry


def chain(salt: str, n: int) -> list[bytes]:
    return hash_blocks(root_hash(salt.encode()), list(range(n * 16)), 16)


def main() -> None:
    endpoint, cluster, node_id, salt, n, ttl = sys.argv[1:7]
    store = EtcdStore(endpoint)
    registry = NodeRegistry(store, cluster, ttl_s=int(ttl))
    publisher = BlockPublisher(store, cluster, "ns", node_id)
    registry.on_new_lease(publisher.set_lease)
    registry.register(NodeRecord(node_id, "decode", "127.0.0.1", "127.0.0.1:1", "127.0.0.1:2"))
    index = BlockIndex(store, cluster, "ns")
    index.mirror.wait_healthy(10)
    publisher.publish(chain(salt, int(n)))
    while not publisher.flush():
        pass
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if cmd[0] == "lookup":
            print(json.dumps(index.lookup(chain(cmd[1], int(cmd[2])))), flush=True)
        elif cmd[0] == "quit":
            break
    publisher.close()
    registry.deregister()
    index.close()


if __name__ == "__main__":
    main()
