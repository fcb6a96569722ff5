"""The etcd key layout of docs/design.md §5 (``<c>`` = cluster name):

    /kvmesh/<c>/nodes/<node_id>                          -> NodeRecord (msgpack), on the node's lease
    /kvmesh/<c>/blocks/<ns>/<hash_hex>/<node_id>         -> BlockEntry (msgpack), on the holder's lease
    /kvmesh/<c>/pins/<ns>/<prefix_id>                    -> PinRecord (msgpack), no lease (until unpinned)

Every name that becomes a key segment is checked, so a ``/`` can never shift the layout.
"""
from __future__ import annotations

import re
from typing import NamedTuple

from kvmesh.errors import KvmeshError

_SAFE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
_HASH_HEX = re.compile(r"[0-9a-f]{32}")


class InvalidNameError(KvmeshError, ValueError):
    """A cluster, node or namespace name that is not safe as a key segment."""


def check_name(kind: str, name: str) -> str:
    if not isinstance(name, str) or not _SAFE.fullmatch(name):
        raise InvalidNameError(f"{kind} name {name!r} is not allowed: use 1-128 of A-Z a-z 0-9 _ . - "
                               "(starting with a letter or digit)")
    return name


class BlockKey(NamedTuple):
    namespace: str
    block_hash: bytes
    node_id: str


DEFAULT_CLUSTER = "kvmesh"  # every command's default --cluster


class KeyLayout:
    def __init__(self, cluster: str):
        self.cluster = check_name("cluster", cluster)
        self.root = f"/kvmesh/{cluster}/"
        self.nodes_prefix = f"{self.root}nodes/"
        self.blocks_prefix = f"{self.root}blocks/"
        self.pins_prefix = f"{self.root}pins/"

    def pins_of_namespace(self, namespace: str) -> str:
        return f"{self.pins_prefix}{check_name('namespace', namespace)}/"

    def pin(self, namespace: str, prefix_id: str) -> str:
        if not _HASH_HEX.fullmatch(prefix_id):
            raise InvalidNameError(f"pin id {prefix_id!r} is not a 32-digit lowercase hex block hash")
        return self.pins_of_namespace(namespace) + prefix_id

    def parse_pin(self, key: str, namespace: str) -> str | None:
        """The prefix id of a pin key of ``namespace``, or None if the key does not fit the layout."""
        prefix = self.pins_of_namespace(namespace)
        pin_id = key[len(prefix):] if key.startswith(prefix) else ""
        return pin_id if _HASH_HEX.fullmatch(pin_id) else None

    def node(self, node_id: str) -> str:
        return self.nodes_prefix + check_name("node", node_id)

    def blocks_of_namespace(self, namespace: str) -> str:
        return f"{self.blocks_prefix}{check_name('namespace', namespace)}/"

    def block(self, namespace: str, block_hash: bytes, node_id: str) -> str:
        return f"{self.blocks_of_namespace(namespace)}{block_hash.hex()}/{check_name('node', node_id)}"

    def parse_node(self, key: str) -> str | None:
        """The node id of a node key, or None if the key does not fit the layout."""
        if not key.startswith(self.nodes_prefix):
            return None
        node_id = key[len(self.nodes_prefix):]
        return node_id if _SAFE.fullmatch(node_id) else None

    def parse_block(self, key: str) -> BlockKey | None:
        """The parts of a block key, or None if the key does not fit the layout."""
        if not key.startswith(self.blocks_prefix):
            return None
        parts = key[len(self.blocks_prefix):].split("/")
        if len(parts) != 3 or not _SAFE.fullmatch(parts[0]) or not _HASH_HEX.fullmatch(parts[1]) \
                or not _SAFE.fullmatch(parts[2]):
            return None
        return BlockKey(parts[0], bytes.fromhex(parts[1]), parts[2])
