"""Where a peer's KV memory is: resolved from the node directory, never from a message (docs/design.md §6).

A holder writes only to the transfer endpoint and base (or landing) address that
the requester published in etcd, and only into block ids below the requester's
published buffer (or landing zone) size.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class PeerRecord:
    node_id: str
    side_channel: str  # "host:port" of its TransferAgent
    transfer_endpoint: str  # where writes into its buffer go
    base_addr: int  # its registered KV buffer
    num_blocks: int
    block_bytes: int
    shared_memory: str = ""  # where a writer on its host can open its KV buffer ("": nowhere; shared_memory.py)
    landing_addr: int = 0  # its landing zone, where one-sided writes go (transfer/landing.py)
    num_landing_slots: int = 0  # 0: it has none (its backend refuses stray writes)


class PeerDirectory(Protocol):
    def get(self, node_id: str) -> PeerRecord | None:
        """The peer's current record, or None when it is not (or no longer) registered."""


class StaticPeers:
    """A fixed set of peers (tests, the transfer benchmark's holder process)."""

    def __init__(self, records: list[PeerRecord] | None = None):
        self._records = {r.node_id: r for r in records or []}

    def add(self, record: PeerRecord) -> None:
        self._records[record.node_id] = record

    def get(self, node_id: str) -> PeerRecord | None:
        return self._records.get(node_id)


class FunctionPeers:
    """A directory backed by a lookup function (nodes: their etcd NodeDirectory)."""

    def __init__(self, lookup: Callable[[str], PeerRecord | None]):
        self._lookup = lookup

    def get(self, node_id: str) -> PeerRecord | None:
        return self._lookup(node_id)
