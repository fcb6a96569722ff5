"""A node's role: which work it takes, and the one state machine that changes it at run time.

    PREFILL ──to decode──> DECODE                 at once (prefill conversations in progress finish)
    DECODE ──to prefill──> DRAINING ──drained──> PREFILL

DECODE takes streams (the router routes them to it), PREFILL takes ComputeAndPush conversations (decode
nodes choose it), DRAINING takes neither: streams without a token yet go back to the router at once, the
running ones finish, and those still running at the drain deadline go back too; the router continues each
on another decode node. The role is published in the node's record (``draining`` too, so nobody sends it
work meanwhile); its cached blocks stay in the pool and in the index throughout. A change asked for while
DRAINING is refused (never interleaved); a change to the role a node has already is a no-op. ``transition``
is the only place the state changes.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from enum import Enum


class RoleState(Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    DRAINING = "draining"


_ALLOWED = {RoleState.PREFILL: {RoleState.DECODE}, RoleState.DECODE: {RoleState.DRAINING},
            RoleState.DRAINING: {RoleState.PREFILL}}


class RoleChangeRefused(Exception):
    """A role change that cannot start now (another is in progress)."""


@dataclass
class NodeRole:
    state: RoleState
    drain_deadline: float = 0.0  # time.monotonic() after which DRAINING hands its streams back
    num_changes: int = 0  # role changes completed (DRAINING -> PREFILL and PREFILL -> DECODE)

    @property
    def takes_streams(self) -> bool:
        return self.state is RoleState.DECODE

    @property
    def takes_prefills(self) -> bool:
        return self.state is RoleState.PREFILL

    def transition(self, to: RoleState) -> None:
        if to not in _ALLOWED[self.state]:
            raise RoleChangeRefused(f"a {self.state.value} node cannot become {to.value} now")
        self.state = to
        if to is not RoleState.DRAINING:
            self.num_changes += 1

    def request(self, role: str, drain_timeout_s: float) -> bool:
        """Start a change to ``role`` ("prefill" | "decode"); returns whether anything changed. Raises
        ``RoleChangeRefused`` while a change is in progress."""
        wanted = RoleState(role)
        if self.state is RoleState.DRAINING:
            raise RoleChangeRefused(f"already changing to prefill (draining streams): {role} refused")
        if wanted is self.state:
            return False
        if wanted is RoleState.PREFILL:
            self.transition(RoleState.DRAINING)
            self.drain_deadline = time.monotonic() + drain_timeout_s
        else:
            self.transition(RoleState.DECODE)
        return True
