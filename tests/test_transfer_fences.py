"""Fences: what a transfer that is given up, stalled or damaged may still do to our blocks (grants, quarantine,
landing slots), on real processes and both backends."""
from __future__ import annotations

import signal
import threading

import pytest
import torch

from kvmesh.transfer.errors import TransferTimeout
from kvmesh.transfer.peer_process import chain_hashes
from tests.transfer_support import BACKENDS, SHARED, Holder, kv_of, make_agent, pull_prefix, requester, wait_until  # noqa: F401


@pytest.mark.skipif("mooncake" not in BACKENDS, reason="landing slots are Mooncake's (one-sided writes)")
def test_a_push_longer_than_the_landing_zone_arrives_in_rounds():
    """5 landing slots, 12 blocks: three conversations of 5, 5 and 2 blocks, every byte in its block; and a
    14-block chain the holder holds 12 of stops after the round that came back short."""
    agent = make_agent("rounds", "mooncake", num_landing_slots=5)
    holder = Holder("mooncake", seed=21, requester=agent, chain=12)
    try:
        ids = agent.pool.allocate(12)
        outcome = agent.requester.push(holder.node_id, ids, chain_hashes(12), request_id="r", timeout_s=30)
        assert outcome.error is None and outcome.num_written == 12 and outcome.tainted_block_ids == []
        for i, block in enumerate(ids):
            assert torch.equal(agent.kv_buffer[block], holder.expected_block(i)), f"block {i}"
        assert agent.landing.num_landed == 12 and agent.landing.num_free == 5
        agent.pool.free(ids)
        ids = agent.pool.allocate(14)
        outcome = agent.requester.push(holder.node_id, ids, chain_hashes(14), request_id="s", timeout_s=30)
        assert outcome.num_written == 12 and agent.landing.num_landed == 24
        agent.pool.free(ids)
        agent.grants.check_integrity()
    finally:
        holder.close()
        agent.close()


@pytest.mark.parametrize("requester", BACKENDS, indirect=True)
def test_a_block_damaged_in_flight_is_not_kept(requester):
    """A bit flipped between the writer's memory and ours: blocks 0..4 are kept, 5 on are recomputed. One-sided
    writes: the flip is in the landing slot of block 5 (it never checks out, however often it is copied)."""
    holder = Holder(requester.engine.name, seed=13, requester=requester, chain=8)
    landing = requester.landing
    verify = requester.requester.verify
    land = landing.land if landing is not None else None
    damaged = []

    def flip_then_verify(block_ids, checksums):
        kv_of(requester)[block_ids[5]].view(-1)[3] += 1.0
        damaged.append(block_ids[5])
        return verify(block_ids, checksums)

    def flip_then_land(slots, block_ids, checksums):
        if len(slots) > 5 and not damaged:
            landing.tensor[slots[5]].view(-1)[3] += 1.0
            damaged.append(block_ids[5])
        return land(slots, block_ids, checksums)

    if landing is not None:
        landing.land = flip_then_land
    else:
        requester.requester.verify = flip_then_verify
    try:
        ids = pull_prefix(requester, holder.node_id, chain_hashes(8), timeout_s=30, request_id="v")
        assert len(ids) == 5 and damaged and damaged[0] not in ids  # blocks 0..4 kept; 5 on are recomputed
        assert requester.pool.match(chain_hashes(8)) == ids
        for i, block in enumerate(ids):
            assert torch.equal(kv_of(requester)[block], holder.expected_block(i))
        assert requester.requester.num_checksum_failures == 1
        requester.pool.free(ids)
        requester.grants.check_integrity()
    finally:
        requester.requester.verify = verify
        if landing is not None:
            del landing.land
        holder.close()


def stop_mid_push(requester, holder, then=lambda: None) -> tuple[threading.Thread, list]:
    """A thread that SIGSTOPs ``holder`` once some blocks of its push are confirmed (more to come), then runs
    ``then``; its outcome lands in the list (True, or the exception: a thread's failure is only a warning,
    so the test reads it)."""
    stopped: list = []

    def stop() -> None:
        try:
            wait_until(lambda: any(g.num_confirmed for g in list(requester.grants._grants.values())))
            holder.proc.send_signal(signal.SIGSTOP)
            then()
            stopped.append(True)
        except BaseException as e:
            stopped.append(e)

    thread = threading.Thread(target=stop)
    thread.start()
    return thread, stopped


@pytest.mark.parametrize("requester", [*BACKENDS, SHARED], indirect=True)
def test_stalled_then_resumed_holder_cannot_touch_reused_blocks(requester):
    """SIGSTOP a holder mid-push past the requester's timeout; the blocks it was granted are refilled with
    other data; SIGCONT: the other data stays intact (zmq refuses late writes; Mooncake's and shared memory's
    tainted blocks were quarantined and never handed out) and the quarantine lifts once the holder says it
    stopped."""
    holder = Holder(requester.engine.name, seed=18, requester=requester, chain=24, delay_ms=250)
    try:
        ids = requester.pool.allocate(24)

        stopper, stopped = stop_mid_push(requester, holder)
        outcome = requester.requester.push(holder.node_id, ids, chain_hashes(24), request_id="s", timeout_s=3,
                                           wait_ms=30_000)
        stopper.join()
        assert stopped == [True], stopped  # the holder really was stalled mid-push
        assert isinstance(outcome.error, TransferTimeout)
        tainted = set(outcome.tainted_block_ids)
        if requester.record.shared_memory:  # the holder copies in place: its unconfirmed blocks are quarantined
            assert tainted
        elif requester.grants.writes_refusable:
            assert not tainted  # the receiver refuses writes outside a live grant
        requester.pool.free(ids)
        reused = requester.pool.allocate(requester.pool.num_free_blocks)  # every block anyone may hand out
        assert not tainted & set(reused)
        kv = kv_of(requester)
        for b in reused:
            kv[b].fill_(float(b))
        holder.proc.send_signal(signal.SIGCONT)
        wait_until(lambda: requester.grants.num_quarantined_blocks == 0)
        wait_until(lambda: holder.check()["num_pinned"] == 0)
        for b in reused:
            assert torch.all(kv[b] == float(b)), f"block {b} was overwritten after its grant was revoked"
        requester.pool.free(reused)
        assert requester.pool.usage().num_used == 0
    finally:
        holder.close()


@pytest.mark.parametrize("ending", ["resumed", "killed"])
def test_a_stopped_same_host_writer_outliving_its_lease_cannot_touch_reused_blocks(ending):
    """A holder on this host is SIGSTOPped mid-push and its lease ends (peer_gone): it is not dead, and once
    resumed would finish the write it had begun. Its unconfirmed blocks stay quarantined while its process
    exists (the pool never hands them out), and are released by its final answer (resumed) or by its exit
    (killed). Without the liveness check the lease's end released them at once (chaos caught 6 corrupted)."""
    requester = make_agent("requester", SHARED)
    holder = Holder("zmq", seed=31, requester=requester, chain=24, delay_ms=250, shared_memory=True)
    try:
        ids = requester.pool.allocate(24)

        stopper, stopped = stop_mid_push(requester, holder, then=lambda: requester.peer_gone(holder.node_id))
        outcome = requester.requester.push(holder.node_id, ids, chain_hashes(24), request_id="lease", timeout_s=30,
                                           wait_ms=30_000)
        stopper.join()
        assert stopped == [True], stopped
        assert "left the cluster" in str(outcome.error) and outcome.tainted_block_ids
        tainted = set(outcome.tainted_block_ids)
        assert requester.grants.num_quarantined_blocks == len(tainted)
        requester.pool.free(ids)
        reused = requester.pool.allocate(requester.pool.num_free_blocks)
        assert not tainted & set(reused)
        kv = kv_of(requester)
        for b in reused:
            kv[b].fill_(float(b))
        assert requester.grants.num_quarantined_blocks == len(tainted)  # the IO thread's sweeps keep it
        if ending == "resumed":
            holder.proc.send_signal(signal.SIGCONT)
        else:
            holder.proc.send_signal(signal.SIGKILL)
            holder.proc.wait()
        wait_until(lambda: requester.grants.num_quarantined_blocks == 0)
        for b in reused:
            assert torch.all(kv[b] == float(b)), f"block {b} was overwritten after its grant was revoked"
        requester.pool.free(reused)
        assert requester.pool.usage().num_used == 0
        requester.pool.check_integrity()
        requester.grants.check_integrity()
    finally:
        holder.close()
        requester.close()
        requester.test_allocator.close()
