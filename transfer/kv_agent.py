"""TransferAgent: a node's end of KV movement (docs/design.md §2, §6), composed of one part per job.

    side channel (authenticated ROUTER) ──> KVHolder      writes our blocks into peers' grants
    KVRequester (DEALERs, one IO thread) ──> peers         asks peers to write into our grants
    GrantTable                                            who may write which of our blocks (and slots)
    LandingZone                                           where one-sided network writes land (checked copy)
    TransferEngine                                        moves the bytes (Mooncake or zmq)
    SharedMemoryWriter                                    ... or one copy, to a peer on this host

The holder changes the pool only through BlockPool's own atomic pins
(``match(..., hold="pin")``); the requester writes into block ids its caller
allocated (a ``KVLease``'s, ``kvmesh/engine/kv_connector.py``) and never caches
them. Construction registers the KV buffer and binds the side channel; ``start``
starts the threads.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch

from kvmesh.auth import ClusterAuth
from kvmesh.kv.block_pool import BlockPool
from kvmesh.router_endpoint import RouterEndpoint
from kvmesh.transfer import messages as m
from kvmesh.transfer.engine import TransferEngine
from kvmesh.transfer.errors import TransferError
from kvmesh.transfer.grants import GrantTable
from kvmesh.transfer.holder import ComputeHook, KVHolder
from kvmesh.transfer.kv_checksummer import KVChecksummer
from kvmesh.transfer.kv_memory import choose_kv_memory
from kvmesh.transfer.landing import LandingZone, default_chunk_bytes, default_num_slots, leading_equal
from kvmesh.transfer.peers import PeerDirectory, PeerRecord
from kvmesh.transfer.requester import KVRequester, PushOutcome
from kvmesh.kv import fast_crc
from kvmesh.kv.block_checksums import BlockChecksums
from kvmesh.kv.shared_buffer import SharedRegion
from kvmesh.transfer.shared_memory import PeerProcesses, SharedMemoryWriter

log = logging.getLogger("kvmesh.transfer")


class TransferAgent:
    def __init__(self, node_id: str, pool: BlockPool, kv_buffer: torch.Tensor, engine: TransferEngine,
                 directory: PeerDirectory, auth: ClusterAuth | None = None, host: str = "127.0.0.1",
                 num_workers: int = 4, advertise: str | None = None, verify_kv: bool = False,
                 kv_memory: str = "auto", shared_region: SharedRegion | None = None, shared_writes: bool = True,
                 num_landing_slots: int = -1, landing_chunk_bytes: int = -1, tracer=None,
                 run_on_owner: Callable[[Callable[[], None]], None] | None = None,
                 checksummer: KVChecksummer | None = None, checksums: BlockChecksums | None = None,
                 tiers=None, compute: ComputeHook | None = None):
        """``verify_kv``: send a crc32 of every pushed block and check the ones received (registered memory
        the CPU can read); blocks through landing slots are checked always. ``kv_memory``: direct, host-staging
        or auto (``transfer/kv_memory.py``). ``shared_region``: where ``kv_buffer`` lives in shared memory
        (``SharedKVAllocator``): published so that peers on this host write into it directly. ``shared_writes``:
        write to such peers that way. ``num_landing_slots``: the landing zone of a one-sided engine (-1: sized
        from the buffer, ``transfer/landing.py``; ignored for an engine whose receiver refuses stray writes).
        ``landing_chunk_bytes``: pushes into those slots come in chunks of about this size, each copied and checked
        while the next is on the wire (-1: ``default_chunk_bytes`` for the transport and this machine; 0: whole).
        ``tracer``: the node's (``kvmesh/tracing.py``): its holder's pushes of traced requests are spans.
        ``run_on_owner``: runs a change of the pool on the thread that owns it (a node's engine thread, between
        steps; None: at once, on the caller's): the grant table's quarantine references go through it.
        ``checksummer`` / ``checksums``: the node's (``KVChecksummer`` over ``kv_buffer``, the ``BlockChecksums``
        of ``pool`` computed through it), which it closes; None: the agent's own. ``tiers``: the node's lower KV
        tiers (``TieredCache``): their host memory is registered and pushes read it. ``compute``: what serves
        ComputeAndPush conversations (a prefill node's; None: refused)."""
        self.node_id = node_id
        self.pool = pool
        self.engine = engine
        self.auth = auth or ClusterAuth()
        self.kv_buffer = kv_buffer
        self.block_bytes = kv_buffer[0].numel() * kv_buffer.element_size()
        self.num_blocks = kv_buffer.shape[0]
        self.memory = choose_kv_memory(kv_buffer, engine, kv_memory)
        self.base_addr = engine.register(self.memory.registered)
        log.info("%s: transfer engine %s at %s, transport %s (%s); KV memory %s (%s)", node_id, engine.name,
                 engine.endpoint, engine.transport, engine.transport_reason, self.memory.mode, self.memory.reason)
        registered_bytes = self.memory.registered.numel() * self.memory.registered.element_size()
        exposed = shared_region is not None and not self.memory.staged and \
            shared_region.num_bytes == registered_bytes and shared_region.pid == os.getpid()
        self.shared_region = shared_region if exposed else None
        # The engine's receiver refuses writes outside open grants (zmq), or one-sided writes land in slots.
        refusable = hasattr(engine, "set_write_guard")
        self.checksummer = checksummer or KVChecksummer(kv_buffer, node_id)
        # A push's checksums of cached blocks: computed once per block, kept while its bytes cannot change.
        # (From the KV buffer itself: a staged host mirror holds the same bytes once a push staged them out.)
        self.checksums = checksums or BlockChecksums(pool, self.checksummer.kv_blocks)
        for tensor in tiers.registered_tensors() if tiers is not None else ():  # pushes read them in place
            engine.register(tensor)
        self.landing: LandingZone | None = None
        if not refusable:
            slots = default_num_slots(self.num_blocks, self.block_bytes) if num_landing_slots < 0 else num_landing_slots
            self.landing = LandingZone(kv_buffer, slots, self.checksummer.kv_blocks, on_landed=self.checksums.remember,
                                       copy_and_check=None if kv_buffer.is_cuda else self._copy_and_check)
            if engine.register(self.landing.tensor) != self.landing.base_addr:
                raise TransferError("the transfer engine registered the landing zone at another address")
        self.grants = GrantTable(pool, self.base_addr, self.block_bytes, writes_refusable=refusable,
                                 landing=self.landing, run_on_owner=run_on_owner)
        if refusable:
            engine.set_write_guard(self.grants.guard_write)
        self._endpoint = RouterEndpoint(host, self._on_message, f"side-channel-{node_id}", self.auth,
                                        advertise=advertise)
        self.side_channel = self._endpoint.endpoint
        self.holder = KVHolder(node_id, pool, engine, self.base_addr, self.block_bytes, directory,
                               lambda identity, msg: self._endpoint.send(identity, m.encode(msg)), num_workers,
                               stage_out=self.memory.stage_out, tracer=tracer, tiers=tiers, compute=compute)
        self.shared_writer = SharedMemoryWriter(node_id) if shared_writes else None
        self.holder.shared = self.shared_writer
        self.requester = KVRequester(node_id, self.grants, directory, self.auth)
        self.peer_processes = PeerProcesses()  # same-host writers: quarantines outlive a stopped one's lease
        self.requester.writer_liveness = self.peer_processes.liveness
        self.requester.stage_in = self.memory.stage_in
        if self.landing is not None:
            chunk = default_chunk_bytes(engine.transport, os.cpu_count() or 1) if landing_chunk_bytes < 0 \
                else landing_chunk_bytes
            self.requester.landing_chunk_blocks = max(1, chunk // self.block_bytes) if chunk else 0
        self.requester.accepts_shared_writes = self.shared_region is not None
        self.holder.checksum = self._checksum_sends
        self.holder.checksum_all = verify_kv
        if verify_kv and self.memory.host_visible:
            self.requester.verify = self._verify_blocks
        self.num_malformed = 0

    def _checksum_sends(self, addrs: list[int]) -> list[int]:
        """crc32 of what a push sends: blocks of the registered KV memory (cached, pinned by the push) from their
        stored checksums (``BlockChecksums``), other memory (a lower tier's host blocks) computed now."""
        end = self.base_addr + self.num_blocks * self.block_bytes
        in_pool = [i for i, a in enumerate(addrs) if self.base_addr <= a < end]
        if not in_pool:
            return self.checksummer.addresses(addrs)
        out = [0] * len(addrs)
        stored = self.checksums.of_cached([(addrs[i] - self.base_addr) // self.block_bytes for i in in_pool])
        for i, value in zip(in_pool, stored):
            out[i] = value
        rest = [i for i, a in enumerate(addrs) if not self.base_addr <= a < end]
        for i, value in zip(rest, self.checksummer.addresses([addrs[i] for i in rest]) if rest else []):
            out[i] = value
        return out

    def _copy_and_check(self, pairs: list[tuple[int, int]]) -> list[int]:
        """Landing on the CPU: copy each (slot, block) pair's slot into its KV block and crc32 the block while its
        bytes are still in cache: one pass over memory per block, long runs split among threads."""
        slot_base, base, nbytes = self.landing.base_addr, self.kv_buffer.data_ptr(), self.block_bytes

        def run(part: list[tuple[int, int]]) -> list[int]:
            return fast_crc.copy_crc32_at([base + b * nbytes for _, b in part],
                                          [slot_base + s * nbytes for s, _ in part], nbytes)
        return self.checksummer.per_block(run, pairs)

    def _verify_blocks(self, block_ids: list[int], checksums: list[int]) -> int:
        """How many leading blocks of ours hold bytes whose crc32 is the writer's."""
        return leading_equal(self.checksummer.addresses([self.base_addr + b * self.block_bytes for b in block_ids]),
                             checksums)

    def start(self) -> TransferAgent:
        self.holder.start()
        self.requester.start()
        self._endpoint.start()
        return self

    @property
    def record(self) -> PeerRecord:
        """What peers need to write into us (published in etcd by nodes)."""
        return PeerRecord(self.node_id, self.side_channel, self.engine.endpoint, self.base_addr, self.num_blocks,
                          self.block_bytes, self.shared_region.encode() if self.shared_region else "",
                          self.landing.base_addr if self.landing is not None else 0,
                          self.landing.num_slots if self.landing is not None else 0)

    @property
    def num_unauthenticated(self) -> int:
        """Frames refused for a missing or wrong cluster token (side channel and transfer engine)."""
        return self._endpoint.num_refused + getattr(self.engine, "num_unauthenticated", 0)

    def reset_counters(self) -> None:
        """Bytes sent and received start from zero (after start-up probes, before the first real transfer)."""
        self.holder.bytes_sent = 0
        self.requester.bytes_received = 0
        if self.shared_writer is not None:
            self.shared_writer.num_writes = self.shared_writer.bytes_written = 0

    def peer_gone(self, node_id: str) -> None:
        """A peer left the cluster: end our conversations with it and let go of its shared memory."""
        self.requester.peer_gone(node_id)
        if self.shared_writer is not None:
            self.shared_writer.forget(node_id)

    @property
    def bytes_sent(self) -> int:
        return self.holder.bytes_sent

    @property
    def bytes_sent_shared_memory(self) -> int:
        """Of ``bytes_sent``, those copied into same-host peers' shared memory."""
        return self.shared_writer.bytes_written if self.shared_writer is not None else 0

    @property
    def bytes_received(self) -> int:
        return self.requester.bytes_received

    def _on_message(self, identity: bytes, payload: bytes) -> None:
        try:
            msg = m.decode(payload)
            if not isinstance(msg, (m.PushRequest, m.ComputeAndPush, m.Abort)):
                raise m.MessageError(f"{msg.TYPE} is not a request")
        except m.MessageError as e:
            self.num_malformed += 1
            log.warning("%s: refused a malformed side-channel message: %s", self.node_id, e)
            self._endpoint.send(identity, m.encode(m.Refused("", m.ErrorCode.MALFORMED.value, str(e))))
            return
        self.holder.on_message(identity, msg)

    def close(self) -> None:
        """Stop serving (pushes in progress end with SHUTTING_DOWN), then the requester and the engine."""
        self.holder.close()
        self._endpoint.close()
        self.requester.close()
        self.engine.close()
        if self.shared_writer is not None:
            self.shared_writer.close()
        self.checksummer.close()
        self.peer_processes.close()


__all__ = ["PushOutcome", "TransferAgent", "TransferError"]
