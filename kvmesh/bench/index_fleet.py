"""The simulated fleet of ``kvmesh bench index``: which node caches which chains, and the truth of a lookup.

Every node caches chains of ``chain_blocks`` blocks; a chain's first ``shared_blocks`` are a system
prompt shared with the other nodes of its group (``nodes // 4`` groups), the rest its own. A node keeps
its group's prefix from its first chain on and evicts whole chains, oldest first (tail first, so what
a node holds of a chain is always a prefix). Block keys are a bijective mix of (prefix or chain, position):
distinct, and as random as hash bytes.
"""
from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass

MAX_CHAIN_BLOCKS = 2048
_MASK = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64's finaliser: a bijection of 64-bit integers."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK
    return x ^ (x >> 31)


@dataclass(frozen=True)
class FleetShape:
    nodes: int
    blocks: int  # asked for; ``FleetTruth.num_blocks`` is what the chains add up to
    seed: int = 0

    @property
    def chain_blocks(self) -> int:
        return max(2, min(MAX_CHAIN_BLOCKS, self.blocks // self.nodes))

    @property
    def shared_blocks(self) -> int:
        return max(1, self.chain_blocks // 16)

    @property
    def chains_per_node(self) -> int:
        own = self.chain_blocks - self.shared_blocks
        return max(1, round((self.blocks / self.nodes - self.shared_blocks) / own))

    @property
    def num_prefixes(self) -> int:
        return max(1, self.nodes // 4)

    def node_id(self, n: int) -> str:
        return f"node-{n:04d}"

    def prefix_of(self, n: int) -> int:
        return n % self.num_prefixes

    def shared_keys(self, prefix_id: int) -> list[int]:
        base = (1 << 60) | (self.seed << 44) | (prefix_id << 12)
        return [_mix(base | i) for i in range(self.shared_blocks)]

    def own_keys(self, chain_id: int) -> list[int]:
        base = (2 << 60) | (self.seed << 56) | (chain_id << 12)
        return [_mix(base | i) for i in range(self.shared_blocks, self.chain_blocks)]


def chain_hashes(shape: FleetShape, chain_id: int, prefix_id: int) -> list[bytes]:
    """The chain's block hashes as a node would hash them (the index reads their first 8 bytes)."""
    keys = shape.shared_keys(prefix_id) + shape.own_keys(chain_id)
    return [k.to_bytes(8, "little") + bytes(8) for k in keys]


class FleetTruth:
    def __init__(self, shape: FleetShape):
        self.shape = shape
        self._chains: list[deque[int]] = [deque() for _ in range(shape.nodes)]
        self._owner: dict[int, int] = {}
        self._next_chain = 0

    def add_chain(self, node: int) -> list[int]:
        """Node ``node`` caches a new chain: the keys it newly holds (its group's prefix with its first)."""
        chain_id, self._next_chain = self._next_chain, self._next_chain + 1
        first = not self._chains[node]
        self._chains[node].append(chain_id)
        self._owner[chain_id] = node
        keys = self.shape.own_keys(chain_id)
        return self.shape.shared_keys(self.shape.prefix_of(node)) + keys if first else keys

    def evict_oldest(self, node: int) -> list[int]:
        """Node ``node`` evicts its oldest chain (the prefix stays): the keys it no longer holds, tail first."""
        chain_id = self._chains[node].popleft()
        del self._owner[chain_id]
        return self.shape.own_keys(chain_id)[::-1]

    def num_blocks(self) -> int:
        own = self.shape.chain_blocks - self.shape.shared_blocks
        return sum(self.shape.shared_blocks + len(c) * own for c in self._chains if c)

    def random_chain(self, rng: random.Random) -> tuple[int, int, int]:
        """(chain id, prefix id, owner) of a chain some node holds now."""
        chain_id = rng.choice(list(self._owner))
        owner = self._owner[chain_id]
        return chain_id, self.shape.prefix_of(owner), owner

    def truth(self, chain_id: int, prefix_id: int) -> dict[str, int]:
        """What a lookup of the chain should promise: node id -> blocks of it held."""
        shape, out = self.shape, {}
        for n, chains in enumerate(self._chains):
            if chains and shape.prefix_of(n) == prefix_id:
                out[shape.node_id(n)] = shape.shared_blocks
        owner = self._owner.get(chain_id)
        if owner is not None:
            out[shape.node_id(owner)] = shape.chain_blocks
        return out


def fleet_truth(shape: FleetShape) -> FleetTruth:
    return FleetTruth(shape)
