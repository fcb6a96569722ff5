"""RoleController: the router's thread that lets the cluster choose its prefill:decode ratio (``--roles auto``).

Every ``interval_s`` it reads each node's stats (the router's connections), turns them into the
balancer's ``NodeLoad`` (a decode node's recent decode-only step from its step clock's totals since the last tick,
its KV use and streams; a prefill node's queue), asks ``RoleBalancer`` for a move and makes it with
``SetRole``. Every decision and its reason is logged and counted (``/metrics``:
``kvmesh_role_changes{to}``); a refused or unanswered move is logged and retried by a later tick.

With a ``NodeSupply`` (Ray: ``RayCluster``) and a ``ScalePolicy`` it also grows and shrinks the cluster when
no move can help: it adds a node of the role short of capacity, and removes an idle one (a decode node is
drained first: moved to prefill, removed once its record says so). Counted in ``kvmesh_nodes_scaled{action}``.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Protocol

from kvmesh.cluster.role_balancer import NodeLoad, RoleBalancer, RoleMove
from kvmesh.cluster.scale_policy import ScalePolicy

log = logging.getLogger("kvmesh.router")


class NodeSupply(Protocol):
    """Where nodes come from and go (``kvmesh.cluster.ray_launcher.RayCluster`` on Ray)."""

    def add_node(self, role: str) -> str | None:
        """Start a node of this role (it registers by itself later); its id, or None when there is no room (the
        supply logs why)."""

    def remove_node(self, node_id: str) -> None:
        """Stop that node for good (it deregisters; its conversations end with the writer shutting down)."""

    def num_starting(self, registered: set[str]) -> int:
        """How many nodes it added that are not among ``registered`` yet."""


class RoleController:
    def __init__(self, balancer: RoleBalancer, status: Callable[[], list[dict]],
                 set_role: Callable[[str, str, float], object], interval_s: float = 2.0,
                 drain_timeout_s: float = 30.0, scaler: ScalePolicy | None = None, supply: NodeSupply | None = None):
        """``status()``: the router's view of every node (``Router.status``); ``set_role(node_id, role,
        drain_timeout_s)``: the answer of that node (None: none); ``scaler`` and ``supply``: nodes added and
        removed as well (both or neither)."""
        self.balancer = balancer
        self._status = status
        self._set_role = set_role
        self.interval_s = interval_s
        self.drain_timeout_s = drain_timeout_s
        # node -> its decode-only steps' (seconds, count) at the last tick, and when that was
        self._steps: dict[str, tuple[float, int, float]] = {}
        self.moves: Counter[str] = Counter()  # role moved to -> how many times
        self.history: list[tuple[float, str, str, str]] = []  # (time, node, role or add/remove, reason)
        self.scaler, self.supply = (scaler, supply) if scaler is not None and supply is not None else (None, None)
        self.scaled: Counter[str] = Counter()  # add | remove -> how many
        self._retiring: set[str] = set()  # decode nodes draining on their way out
        self._removed: set[str] = set()  # removed, until the directory stops listing them
        self._no_room_said_at = float("-inf")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvmesh-role-balancer", daemon=True)

    def start(self) -> RoleController:
        self._thread.start()
        return self

    def loads(self, entries: list[dict], now: float | None = None) -> list[NodeLoad]:
        """The balancer's inputs from ``Router.status`` entries read at ``now`` (default: the monotonic clock);
        nodes that did not answer are left out."""
        now = time.monotonic() if now is None else now
        out = []
        for entry in entries:
            load = entry["load"]
            if load is None:
                continue
            node_id = entry["node_id"]
            # Decode-only steps: a stream's next token when no prompt shares the step (steps computing prompt
            # tokens are prefill work, whoever does it).
            wall, steps = load.engine_decode_step_s, load.engine_decode_steps
            before = self._steps.get(node_id, (wall, steps, now))
            self._steps[node_id] = (wall, steps, now)
            step_s = (wall - before[0]) / (steps - before[1]) if steps > before[1] else 0.0
            busy_share = min(1.0, max(0.0, wall - before[0]) / (now - before[2])) if now > before[2] else None
            used, total = load.num_used_blocks, load.num_kv_blocks
            out.append(NodeLoad(
                # Every node reports both (its prefill role's accepted prompts, its engine's own prompt backlog;
                # the first are usually in the second once admitted): the longer is how long a prompt waits there.
                node_id, entry["role"],
                queue_s=max(load.prefill_queue_s, load.prompt_queue_s), step_s=step_s,
                kv_used=used / total if total else 0.0, num_running=load.num_running, max_num_seqs=load.max_num_seqs,
                prompt_tokens_computed=load.prompt_tokens_computed, prompt_tokens_total=load.prompt_tokens_total,
                prompt_tokens_always_here=load.prompt_tokens_always_here, busy_share=busy_share))
        return out

    def tick(self, now: float) -> RoleMove | None:
        """One look at the cluster; the move made, if any (else, with a supply, perhaps a node added or
        removed)."""
        entries = self._status()
        loads = self.loads(entries, now)
        if self.supply is not None:
            roles = {e["node_id"]: e["role"] for e in entries}
            self._finish_retirements(roles)
            self._removed &= set(roles)  # gone from the directory: forgotten
            loads = [n for n in loads if n.node_id not in self._removed]
        held = self.balancer.unhelpful
        move = self.balancer.observe(loads, now)
        if self.balancer.unhelpful and self.balancer.unhelpful != held:
            prefill, decode = self.balancer.last_pressures
            log.info("role balancer: the last move to %s did not relieve it (pressure now: prefill %.2f, decode %.2f); "
                     "no more nodes move that way until it falls", self.balancer.unhelpful, prefill, decode)
        if move is None or self._retiring:
            if self.scaler is not None:
                self._scale(loads, now, num_nodes=len(entries))
            return None
        log.info("role balancer: %s -> %s (%s)", move.node_id, move.to_role, move.reason)
        reply = self._set_role(move.node_id, move.to_role, self.drain_timeout_s)
        if reply is None or getattr(reply, "error", ""):
            log.warning("role balancer: %s did not take %s (%s)", move.node_id, move.to_role,
                        getattr(reply, "error", "") or "no answer")
            return None
        self.balancer.moved(move, now)
        self.moves[move.to_role] += 1
        self.history.append((time.time(), move.node_id, move.to_role, move.reason))
        return move

    def _scale(self, loads: list[NodeLoad], now: float, num_nodes: int) -> None:
        pending = self.supply.num_starting({n.node_id for n in loads}) + len(self._retiring) + len(self._removed)
        action = self.scaler.observe(loads, *self.balancer.last_pressures, now, pending,
                                     num_nodes=num_nodes - len(self._removed))
        if action is None:
            return
        node_id = action.node_id
        if action.kind == "add":
            node_id = self.supply.add_node(action.role)
            if node_id is None:
                if now - self._no_room_said_at >= self.scaler.config.cooldown_s:
                    self._no_room_said_at = now
                    log.warning("role balancer: a %s node is wanted (%s) but the cluster has no room for one",
                                action.role, action.reason)
                return
        elif action.role == "prefill":
            self.supply.remove_node(node_id)
            self._removed.add(node_id)
        else:  # a decode node hands its streams back first: it becomes a prefill node, then goes
            reply = self._set_role(node_id, "prefill", self.drain_timeout_s)
            if reply is None or getattr(reply, "error", ""):
                log.warning("role balancer: %s did not start draining to be removed (%s)", node_id,
                            getattr(reply, "error", "") or "no answer")
                return
            self._retiring.add(node_id)
        log.info("role balancer: %s %s node %s (%s)", "added" if action.kind == "add" else "removing",
                 action.role, node_id, action.reason)
        self.scaler.acted(action, now)
        self.scaled[action.kind] += 1
        self.history.append((time.time(), node_id, action.kind, action.reason))

    def _finish_retirements(self, roles: dict[str, str]) -> None:
        """Decode nodes on their way out that finished draining (their record says prefill) are removed; one that
        left by itself is forgotten."""
        for node_id in sorted(self._retiring):
            if roles.get(node_id) == "prefill":
                self.supply.remove_node(node_id)
                self._removed.add(node_id)
                log.info("role balancer: removed %s (drained)", node_id)
            if roles.get(node_id) in (None, "prefill"):
                self._retiring.discard(node_id)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.tick(time.monotonic())
            except Exception:  # a tick that fails (a node going away mid-read) must not end the balancing
                log.exception("role balancer tick failed")

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
