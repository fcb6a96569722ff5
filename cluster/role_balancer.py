"""RoleBalancer: the policy that moves one node at a time between prefill and decode as the load shifts.

Each tick the router hands it what the nodes measured (``NodeLoad``, from their stats) and it answers
with at most one ``RoleMove``. Two pressures are compared, each as a share of its SLO:

    prefill pressure  the longest prompt queue at a node (seconds of queued prompt tokens at its rate: a
                      prefill node's accepted prompts, a decode node's own) over the TTFT SLO; and, where decode
                      nodes compute prompts themselves beside prefill nodes, the share
                      of prompt tokens they computed since the last tick that a prefill node could have
                      (left out: what of each prompt's last block no other node could compute for them)
    decode pressure   the slowest decode node's recent decode-only step (one output token per stream) over the TPOT
                      SLO, or its KV blocks in use, or its streams over its ``max_num_seqs``, whichever is
                      highest
    decode busy       the busiest decode node's share of wall time in decode-only steps since the last tick: its
                      load where a step's time is not (a step has a floor, the weights read once per step, that on a
                      CPU is a good part of the TPOT SLO however few streams it carries)

A decode node moves to prefill when prefill pressure is high (>= ``high``) and decode pressure low
(<= ``low``), and back the other way; also when one role is idle (its pressure <= ``idle``, or for decode nodes
within ``low`` of their SLO and stepping ``idle_busy`` of the time or less) while the other works at ``low`` or
more, short of its SLO: a node doing nothing serves the work better where the work is
(clients waiting on their answers get them sooner, whatever the SLO's headroom). The node moved is the least
loaded of its role. A cluster without a
prefill node is a special case both ways: the last prefill node leaves only when decode nodes miss their SLO
(decode pressure >= 1, not only ``high``), and with none left a decode node moves back on prefill
pressure alone (the decode nodes compute every prompt then, so their own pressure is partly the load a
prefill node takes off them, and waiting for it to fall would keep the cluster all-decode). Hysteresis keeps
it from flapping: the same verdict must hold for ``sustain`` ticks in a row, no move within
``cooldown_s`` of the last one (a drain and the router's view settle first), none while a node is
draining, and each role keeps its minimum. A move is judged by its effect: at the first tick past its
cooldown, the pressure it was made for must have fallen by ``helped`` (a share of what it was); if it has
not, no further node moves that way (the role's capacity was not what held it back: nodes sharing cores or
memory bandwidth, a load that a node more does not spread) until that pressure falls to ``low`` or a node
moves the other way. With one node there is nothing to balance: it serves colocated (a decode node
computes its own prompts). Pure: no I/O, the clock passed in.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class NodeLoad:
    """One node as its stats describe it at a tick."""

    node_id: str
    role: str  # prefill | decode | draining
    queue_s: float = 0.0  # its prompt tokens still to compute (a prefill node's accepted ones), at its rate
    step_s: float = 0.0  # decode: its mean decode-only step since the last tick (0: none)
    kv_used: float = 0.0  # decode: share of its KV blocks held by running requests
    num_running: int = 0
    max_num_seqs: int = 0
    prompt_tokens_computed: int = 0  # decode: prompt tokens it computed itself, ever
    prompt_tokens_total: int = 0  # decode: prompt tokens of its finished requests, ever
    prompt_tokens_always_here: int = 0  # decode: of those, each prompt's tail no other node could compute, ever
    busy_share: float | None = None  # decode: share of wall time in decode-only steps since the last tick (None: unknown)


@dataclass(frozen=True)
class RoleMove:
    node_id: str
    to_role: str
    reason: str


@dataclass
class BalancerConfig:
    ttft_slo_s: float = 2.0
    tpot_slo_s: float = 0.1
    high: float = 0.8  # a pressure at or above this share of its SLO asks for capacity
    low: float = 0.5  # ... and one at or below this can give a node away
    idle: float = 0.1  # a role this far below its SLO gives a node to the other role if that one is at ``low``
    idle_busy: float = 0.25  # ... as do decode nodes within ``low`` of theirs that step this share of the time or less
    sustain: int = 3  # ticks in a row the same verdict must hold
    cooldown_s: float = 30.0  # after a move, before the next
    min_prefill: int = 0
    min_decode: int = 1
    helped: float = 0.1  # a move's pressure must fall by this share of itself for another move the same way


@dataclass
class RoleBalancer:
    config: BalancerConfig = field(default_factory=BalancerConfig)
    _streak: tuple[str, int] = ("", 0)  # the verdict of the last ticks and how many in a row
    _last_move_at: float = float("-inf")
    # decode node -> (computed, total, always here) at the last tick
    _last_counts: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    num_moves: int = 0
    last_reason: str = ""
    last_pressures: tuple[float, float] = (0.0, 0.0)  # (prefill, decode) of the last tick
    _judging: tuple[str, float] | None = None  # the last move's role and the pressure it was made for, until judged
    unhelpful: str = ""  # a role the last move to did not relieve: no more moves to it for now

    def pressures(self, loads: list[NodeLoad]) -> tuple[float, float]:
        """(prefill pressure, decode pressure) of this tick, each as a share of its SLO (see the module)."""
        cfg = self.config
        # Prompts queued anywhere: at prefill nodes, or at decode nodes computing them themselves (a cluster left
        # with no prefill node still sees its prompt work, and can move a node back to prefill).
        prefill = max((n.queue_s for n in loads), default=0.0) / cfg.ttft_slo_s
        computed = total = 0
        for n in loads:
            if n.role != "decode":
                continue
            now = (n.prompt_tokens_computed, n.prompt_tokens_total, n.prompt_tokens_always_here)
            before = self._last_counts.get(n.node_id, now)
            # Tokens a prefill node could have computed (what of each tail only this node could compute left out).
            computed += max(0, (now[0] - before[0]) - (now[2] - before[2]))
            total += (now[1] - before[1]) - (now[2] - before[2])
            self._last_counts[n.node_id] = now
        if total > 0 and any(n.role == "prefill" for n in loads):  # decode nodes computing prompts themselves
            prefill = max(prefill, computed / total)
        decode = max((max(n.step_s / cfg.tpot_slo_s, n.kv_used, n.num_running / n.max_num_seqs if n.max_num_seqs
                          else 0.0) for n in loads if n.role == "decode"), default=0.0)
        return prefill, decode

    def observe(self, loads: list[NodeLoad], now: float) -> RoleMove | None:
        """One tick: the move to make now, if any (the caller makes it and says so with ``moved``)."""
        cfg = self.config
        prefill, decode = self.last_pressures = self.pressures(loads)
        if self._judging is not None and now - self._last_move_at >= cfg.cooldown_s:
            role, before = self._judging
            self._judging = None
            if self._pressure_of(role) > before * (1.0 - cfg.helped):
                self.unhelpful = role
        if self.unhelpful and self._pressure_of(self.unhelpful) <= cfg.low:
            self.unhelpful = ""  # that load is gone: the next rise is judged afresh
        num_prefill = sum(n.role == "prefill" for n in loads)
        busy = [n.busy_share for n in loads if n.role == "decode"]
        decode_idle = decode <= cfg.idle or (decode <= cfg.low and bool(busy) and None not in busy
                                             and max(busy) <= cfg.idle_busy)
        verdict = ""
        if (prefill >= cfg.high and (decode <= cfg.low or num_prefill == 0)) or (prefill >= cfg.low and decode_idle):
            verdict = "prefill"
        elif (decode >= cfg.high and prefill <= cfg.low) or (decode >= cfg.low and prefill <= cfg.idle):
            verdict = "decode"
        self._streak = (verdict, self._streak[1] + 1 if verdict == self._streak[0] else 1)
        if not verdict or self._streak[1] < cfg.sustain or now - self._last_move_at < cfg.cooldown_s:
            return None
        if verdict == self.unhelpful:
            return None  # the last node moved that way did not relieve it
        if verdict == "decode" and num_prefill == 1 and decode < 1.0:
            return None  # an all-decode cluster computes every prompt on its decode nodes: only for a missed SLO
        if any(n.role == "draining" for n in loads):
            return None  # one change at a time
        givers = [n for n in loads if n.role == ("decode" if verdict == "prefill" else "prefill")]
        minimum = cfg.min_decode if verdict == "prefill" else cfg.min_prefill
        if len(givers) <= minimum:
            return None
        node = min(givers, key=lambda n: (n.num_running, n.queue_s, n.node_id))  # the least loaded
        reason = (f"prefill pressure {prefill:.2f} and decode pressure {decode:.2f} of their SLOs for "
                  f"{self._streak[1]} ticks")
        return RoleMove(node.node_id, verdict, reason)

    def _pressure_of(self, role: str) -> float:
        """The last tick's pressure of ``role`` (prefill or decode)."""
        return self.last_pressures[0 if role == "prefill" else 1]

    def moved(self, move: RoleMove, now: float) -> None:
        """The move was made: the cooldown starts, the streak restarts, and the move is judged after the cooldown by
        the pressure it was made for (this tick's)."""
        self._last_move_at = now
        self._judging = (move.to_role, self._pressure_of(move.to_role))
        if self.unhelpful and self.unhelpful != move.to_role:
            self.unhelpful = ""
        self._streak = ("", 0)
        self.num_moves += 1
        self.last_reason = f"{move.node_id} -> {move.to_role}: {move.reason}"
