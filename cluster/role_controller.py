"""RoleController: the router's thread that lets the cluster choose its prefill:decode ratio (``--roles auto``).

Every ``interval_s`` it reads each node's stats (the router's connections), turns them into the
balancer's ``NodeLoad`` (a decode node's recent decode-only step from its step clock's totals since the last tick,
its KV use and streams; a prefill node's queue), asks ``RoleBalancer`` for a move and makes it with
``SetRole``. Every decision and its reason is logged and counted (``/metrics``:
``kvmesh_role_changes_total{to}``); a refused or unanswered move is logged and retried by a later tick.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable

from kvmesh.cluster.role_balancer import NodeLoad, RoleBalancer, RoleMove

log = logging.getLogger("kvmesh.router")


class RoleController:
    def __init__(self, balancer: RoleBalancer, status: Callable[[], list[dict]],
                 set_role: Callable[[str, str, float], object], interval_s: float = 2.0,
                 drain_timeout_s: float = 30.0):
        """``status()``: the router's view of every node (``Router.status``); ``set_role(node_id, role,
        drain_timeout_s)``: the answer of that node (None: none)."""
        self.balancer = balancer
        self._status = status
        self._set_role = set_role
        self.interval_s = interval_s
        self.drain_timeout_s = drain_timeout_s
        # node -> its decode-only steps' (seconds, count) at the last tick
        self._steps: dict[str, tuple[float, int]] = {}
        self.moves: Counter[str] = Counter()  # role moved to -> how many times
        self.history: list[tuple[float, str, str, str]] = []  # (time, node, role, reason)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvmesh-role-balancer", daemon=True)

    def start(self) -> RoleController:
        self._thread.start()
        return self

    def loads(self, entries: list[dict]) -> list[NodeLoad]:
        """The balancer's inputs from ``Router.status`` entries (nodes that did not answer are left out)."""
        out = []
        for entry in entries:
            stats = entry["stats"]
            if not stats:
                continue
            node_id = entry["node_id"]
            # Decode-only steps: a stream's next token when no prompt shares the step (steps computing prompt
            # tokens are prefill work, whoever does it).
            wall, steps = stats.get("engine_decode_step_s", 0.0), stats.get("engine_decode_steps", 0)
            before = self._steps.get(node_id, (wall, steps))
            self._steps[node_id] = (wall, steps)
            step_s = (wall - before[0]) / (steps - before[1]) if steps > before[1] else 0.0
            used, total = stats.get("num_used_blocks", 0), stats.get("num_kv_blocks", 0)
            out.append(NodeLoad(
                node_id, entry["role"], queue_s=stats.get("prefill_queue_s", 0.0), step_s=step_s,
                kv_used=used / total if total else 0.0, num_running=stats.get("num_running", 0),
                max_num_seqs=stats.get("max_num_seqs", 0),
                prompt_tokens_computed=stats.get("prompt_tokens_computed", 0),
                prompt_tokens_total=stats.get("prompt_tokens_total", 0)))
        return out

    def tick(self, now: float) -> RoleMove | None:
        """One look at the cluster; the move made, if any."""
        move = self.balancer.observe(self.loads(self._status()), now)
        if move is None:
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
