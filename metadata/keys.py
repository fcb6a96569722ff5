"""The etcd key layout of docs/design.md §5 (``<c>`` = cluster name):

    /kvmesh/<c>/nodes/<node_id>                          -> NodeRecord (msgpack), on the node's lease
    /kvmesh/<c>/holdings/<ns>/<node_id>/l/<seq>          -> a log record of the blocks the node holds (added,
                                                            with their tier, or gone), on the holder's lease
    /kvmesh/<c>/holdings/<ns>/<node_id>/s/<seq>/<part>-<num_parts>
                                                         -> a part of a snapshot of them (metadata/holdings.py)
    /kvmesh/<c>/pins/<ns>/<prefix_id>                    -> PinRecord (msgpack), no lease (until unpinned)

Every name that becomes a key segment is checked, so a ``/`` can never shift the layout.
"""
from __future__ import annotations

import re
from typing import NamedTuple

from kvmesh.errors import KvmeshError

_SAFE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
_HASH_HEX = re.compile(r"[0-9a-f]{32}")
_SEQ_HEX = re.compile(r"[0-9a-f]{16}")
_PART = re.compile(r"([0-9a-f]{4})-([0-9a-f]{4})")


class InvalidNameError(KvmeshError, ValueError):
    """A cluster, node or namespace name that is not safe as a key segment."""


def check_name(kind: str, name: str) -> str:
    if not isinstance(name, str) or not _SAFE.fullmatch(name):
        raise InvalidNameError(f"{kind} name {name!r} is not allowed: use 1-128 of A-Z a-z 0-9 _ . - "
                               "(starting with a letter or digit)")
    return name


class HoldingsKey(NamedTuple):
    namespace: str
    node_id: str
    kind: str  # "l": a log record, "s": a snapshot part
    seq: int
    part: int = 0  # snapshot parts only
    num_parts: int = 1


DEFAULT_CLUSTER = "kvmesh"  # every command's default --cluster


class KeyLayout:
    def __init__(self, cluster: str):
        self.cluster = check_name("cluster", cluster)
        self.root = f"/kvmesh/{cluster}/"
        self.nodes_prefix = f"{self.root}nodes/"
        self.holdings_prefix = f"{self.root}holdings/"
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

    def holdings_of_namespace(self, namespace: str) -> str:
        return f"{self.holdings_prefix}{check_name('namespace', namespace)}/"

    def holdings_log(self, namespace: str, node_id: str, seq: int) -> str:
        return f"{self.holdings_of_namespace(namespace)}{check_name('node', node_id)}/l/{seq:016x}"

    def holdings_snapshot(self, namespace: str, node_id: str, seq: int, part: int, num_parts: int) -> str:
        if not 0 <= part < num_parts <= 0xFFFF:
            raise ValueError(f"snapshot part {part} of {num_parts}: at most 65,535 parts")
        return f"{self.holdings_of_namespace(namespace)}{check_name('node', node_id)}/s/{seq:016x}/" \
               f"{part:04x}-{num_parts:04x}"

    def parse_node(self, key: str) -> str | None:
        """The node id of a node key, or None if the key does not fit the layout."""
        if not key.startswith(self.nodes_prefix):
            return None
        node_id = key[len(self.nodes_prefix):]
        return node_id if _SAFE.fullmatch(node_id) else None

    def parse_holdings(self, key: str) -> HoldingsKey | None:
        """The parts of a holdings key, or None if the key does not fit the layout."""
        if not key.startswith(self.holdings_prefix):
            return None
        parts = key[len(self.holdings_prefix):].split("/")
        if len(parts) < 4 or not _SAFE.fullmatch(parts[0]) or not _SAFE.fullmatch(parts[1]) \
                or not _SEQ_HEX.fullmatch(parts[3]):
            return None
        if parts[2] == "l" and len(parts) == 4:
            return HoldingsKey(parts[0], parts[1], "l", int(parts[3], 16))
        match = _PART.fullmatch(parts[4]) if parts[2] == "s" and len(parts) == 5 else None
        if match is None:
            return None
        part, num_parts = int(match.group(1), 16), int(match.group(2), 16)
        if not part < num_parts:
            return None
        return HoldingsKey(parts[0], parts[1], "s", int(parts[3], 16), part, num_parts)
