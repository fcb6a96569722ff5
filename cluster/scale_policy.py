"""ScalePolicy: when the cluster should grow by a node or shrink by one (``--roles auto --max-nodes N`` on Ray).

Moving a node between roles (``RoleBalancer``) costs nothing but a drain, so it comes first. This policy
answers the two cases a move cannot:

    add a node of role R      R's pressure is high (>= ``high``) and no node can be given to it: the other
                              role's pressure is not low (> ``low``: it needs its nodes), or it is at its
                              minimum; and the cluster has fewer than ``max_nodes`` (added ones still
                              starting included)
    remove a node             both pressures idle (<= ``idle``) and more nodes than the minimums: a prefill
                              node with nothing queued first (its role keeps its minimum), else the decode node
                              with the fewest streams, drained first (moved to prefill: its streams are handed
                              back and finish elsewhere), removed once its record says prefill

Hysteresis as the balancer's: the same verdict for ``sustain`` ticks in a row (``sustain_down`` for removals,
longer: a lull is not a trend), ``cooldown_s`` between actions, nothing while a node drains or an added one
is still starting. Pure: no I/O, the clock passed in; ``ScaleController`` in the router acts on the answers.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvmesh.cluster.role_balancer import NodeLoad


@dataclass(frozen=True)
class ScaleAction:
    kind: str  # add | remove
    role: str  # add: the new node's role; remove: the role of the node removed
    node_id: str = ""  # remove: which node
    reason: str = ""


@dataclass
class ScaleConfig:
    max_nodes: int = 0  # 0: never add or remove
    high: float = 0.8  # as the balancer's
    low: float = 0.5
    idle: float = 0.2  # both pressures at or below this: a node can go
    sustain: int = 3
    sustain_down: int = 10
    cooldown_s: float = 30.0
    min_prefill: int = 0
    min_decode: int = 1


@dataclass
class ScalePolicy:
    config: ScaleConfig = field(default_factory=ScaleConfig)
    _streak: tuple[str, int] = ("", 0)
    _last_action_at: float = float("-inf")
    num_added: int = 0
    num_removed: int = 0

    def observe(self, loads: list[NodeLoad], prefill: float, decode: float, now: float,
                num_pending: int = 0, num_nodes: int | None = None) -> ScaleAction | None:
        """One tick, given the balancer's pressures of it (``RoleBalancer.pressures``), how many changes are
        still under way (added nodes not registered yet, removals draining) and how many nodes are registered
        (default: those in ``loads``; a node whose stats did not come still counts against ``max_nodes``): the
        action to take now, if any (the caller says it did with ``acted``)."""
        cfg = self.config
        if cfg.max_nodes <= 0:
            return None
        count = {role: sum(n.role == role for n in loads) for role in ("prefill", "decode")}
        # A role short of capacity that no move can help: the other role needs its nodes or is at its minimum.
        wants_prefill = prefill >= cfg.high and (decode > cfg.low or count["decode"] <= cfg.min_decode)
        wants_decode = decode >= cfg.high and (prefill > cfg.low or count["prefill"] <= cfg.min_prefill)
        verdict = ""
        if wants_prefill or wants_decode:
            verdict = "add prefill" if wants_prefill and (not wants_decode or prefill >= decode) else "add decode"
        elif max(prefill, decode) <= cfg.idle:
            verdict = "remove"
        self._streak = (verdict, self._streak[1] + 1 if verdict == self._streak[0] else 1)
        needed = cfg.sustain_down if verdict == "remove" else cfg.sustain
        if not verdict or self._streak[1] < needed or now - self._last_action_at < cfg.cooldown_s:
            return None
        if num_pending or any(n.role == "draining" for n in loads):
            return None  # one change at a time
        reason = f"prefill pressure {prefill:.2f} and decode pressure {decode:.2f} of their SLOs for " \
                 f"{self._streak[1]} ticks"
        if verdict.startswith("add"):
            if (len(loads) if num_nodes is None else num_nodes) >= cfg.max_nodes:
                return None
            return ScaleAction("add", verdict.split()[1], reason=reason)
        prefill_nodes = [n for n in loads if n.role == "prefill" and n.queue_s == 0]
        if count["prefill"] > cfg.min_prefill and prefill_nodes:
            node = min(prefill_nodes, key=lambda n: n.node_id)
            return ScaleAction("remove", "prefill", node.node_id, reason)
        decode_nodes = [n for n in loads if n.role == "decode"]
        if count["decode"] > cfg.min_decode:
            node = min(decode_nodes, key=lambda n: (n.num_running, n.node_id))
            return ScaleAction("remove", "decode", node.node_id, reason)
        return None

    def acted(self, action: ScaleAction, now: float) -> None:
        """The action was taken (a node added, or its removal begun): the cooldown starts, the streak restarts."""
        self._last_action_at = now
        self._streak = ("", 0)
        if action.kind == "add":
            self.num_added += 1
        else:
            self.num_removed += 1
