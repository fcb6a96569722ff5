"""ServingNode: a node process, the runtime's parts with both roles' work, one role taken at a time.

Every node can serve streams (``DecodeRole``) and prefill conversations (``PrefillRole``) over one engine
and one pool; its ``NodeRole`` (``kvmesh/node/roles.py``) says which it takes now and is published in its
record, which is what the router and the decode nodes route by. ``SetRole`` changes it at run time without
a restart or a reload: prefill -> decode at once; decode -> prefill through DRAINING (no new streams; those
without a token yet and no KV on its way are handed back to the router at once, the running ones and those
whose KV is being fetched finish, those left at the drain deadline are handed back too; the router
continues each on another decode node). Every role change is applied on the engine thread, at a step
boundary; the record is re-published off it, one write at a time, each with the role of that moment (so
a slow write can never leave an older role published last).
"""
from __future__ import annotations

import logging
import threading
import time

from kvmesh.decode_node.worker import DecodeRole
from kvmesh.engine.sequence import Sequence
from kvmesh.node import messages as nm
from kvmesh.node.roles import NodeRole, RoleChangeRefused, RoleState
from kvmesh.node.runtime import NodeConfig, NodeRuntime
from kvmesh.prefill_node.worker import PrefillRole
from kvmesh.wire import encode

log = logging.getLogger("kvmesh.node")


class ServingNode(NodeRuntime):
    def __init__(self, cfg: NodeConfig):
        if cfg.role not in ("prefill", "decode"):
            raise ValueError(f"unknown node role {cfg.role!r} (prefill or decode)")
        super().__init__(cfg)
        self.role = NodeRole(RoleState(cfg.role))
        self._record_lock = threading.Lock()
        self.decode = DecodeRole(self)
        self.prefill = PrefillRole(self)  # the holder's ComputeAndPush conversations reach it through the node
        self._take_role()

    @property
    def role_name(self) -> str:
        return self.role.state.value

    def _take_role(self) -> None:
        """Engine thread (or before it starts): each role's work on or off as the state says; prompts sliced
        where streams decode beside them."""
        self.decode.accepting = self.role.takes_streams
        self.prefill.accepting = self.role.takes_prefills
        self.slice_prompts(self.role.state is not RoleState.PREFILL)

    # ---- role changes (engine thread) ------------------------------------------------------------------------
    def _set_role(self, identity: bytes, msg: nm.SetRole) -> None:
        error, before = "", self.role.state
        try:
            if self.role.request(msg.role, msg.drain_timeout_s):
                log.info("%s: role %s -> %s", self.cfg.node_id, before.value, self.role.state.value)
                self._take_role()
                if self.role.state is RoleState.DRAINING:  # a stream not started yet runs sooner elsewhere
                    self.decode.hand_back("the node is becoming a prefill node", unstarted_only=True)
                self._finish_draining()
                self._publish_role()
        except RoleChangeRefused as e:
            error = str(e)
        self.endpoint.send(identity, encode(nm.RoleReply(msg.request_id, self.cfg.node_id, self.role.state.value,
                                                         error)))

    def _finish_draining(self) -> None:
        """DRAINING with no stream left, or past its deadline (its streams handed back): a prefill node now."""
        if self.role.state is not RoleState.DRAINING:
            return
        if self.decode.num_streams and time.monotonic() < self.role.drain_deadline:
            return
        if self.decode.num_streams:
            log.info("%s: %d streams still running at the drain deadline go back to the router", self.cfg.node_id,
                     self.decode.num_streams)
            self.decode.hand_back("the node became a prefill node")
        self.role.transition(RoleState.PREFILL)
        self._take_role()
        self._publish_role()

    def _publish_role(self) -> None:
        if self.membership.registry is not None:  # (not registered yet: ``start`` registers it with the role)
            self.workers.submit(self._write_record)

    def _write_record(self) -> None:
        """Worker thread: the record as it is now, one write at a time."""
        with self._record_lock:
            try:
                self.membership.registry.update(self.record())
            except Exception:  # etcd down: the lease's keep-alive re-writes the record when it is back
                log.exception("%s: publishing the role %s failed", self.cfg.node_id, self.role.state.value)

    def _after_step(self) -> None:
        super()._after_step()
        if self.role.state is RoleState.DRAINING:
            self._finish_draining()

    # ---- the runtime's hooks -------------------------------------------------------------------------------
    def handle(self, identity: bytes, msg) -> None:
        if isinstance(msg, nm.SetRole):
            self.call_soon(lambda: self._set_role(identity, msg))
        elif not self.decode.handle(identity, msg):
            super().handle(identity, msg)

    def before_serving(self) -> None:
        self.decode.before_serving()

    def on_token(self, seq: Sequence, token_id: int) -> None:
        if not self.prefill.prompt_computed(seq):  # a prefill's one token: its prompt's tail held for the holder
            self.decode.on_token(seq, token_id)

    def on_finish(self, seq: Sequence) -> None:
        self.decode.on_finish(seq)  # (a prefill's blocks stay cached; its conversation ends on its own)

    def on_failed(self, seq: Sequence, error: str) -> None:
        self.decode.on_failed(seq, error)

    def abandon_requests(self, why: str) -> None:
        self.decode.abandon_requests(why)

    def role_stats(self) -> dict:
        return {"role": self.role.state.value, "num_role_changes": self.role.num_changes, **self.decode.stats(),
                **self.prefill.stats()}

    def close(self) -> None:
        super().close()
        self.decode.close()
