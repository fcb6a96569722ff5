"""Placement policies: which plan a node takes for a request's uncached blocks (``--kv-placement``).

The planner (``kvmesh.node.planner``) prices; a placement policy decides, and the nodes ask it
without knowing which one they hold:

    cost          (the default) the cheapest plan by the planner's costs: this request's estimate plus
                  the wait its blocks computed here put on the sequences running here; never costlier,
                  by them, than computing here; the index is not even read when computing here costs
                  less than one round trip
    cost:request  the same by this request's estimate alone (the streams' wait not counted): never
                  slower, by the estimates, for the request itself
    threshold:N   conditional disaggregation by prompt length: when more than N uncached tokens remain
                  after this node's lower tiers, fetch from the longest holder and send the rest to a
                  prefill node (any: unpriced, in rotation); else compute here. ``threshold:0`` always
                  disaggregates (what a deployment with dedicated prefill capacity may want, and how the
                  transfer paths are exercised); a large N never does.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

from kvmesh.node.planner import FetchPlan, PlanRequest, plan_fetch, worth_a_lookup


class Placement(Protocol):
    name: str
    prices_prefill_nodes: bool  # True: the plan needs the best-priced prefill node; False: any will do

    def worth_a_lookup(self, num_tokens: int, local_tokens_per_s: float, rtt_s: float,
                       local_queue_s: float, num_streams: int = 0) -> bool:
        """Whether reading the global index for holders can change this request's plan (``num_streams``:
        sequences running here)."""

    def plan(self, req: PlanRequest) -> FetchPlan:
        """The plan for blocks ``[req.num_local, req.end)``."""


@dataclass(frozen=True)
class CostPlacement:
    counts_streams: bool = True  # False: ``cost:request``, the request's own estimate alone
    name: str = "cost"
    prices_prefill_nodes: bool = True

    def worth_a_lookup(self, num_tokens: int, local_tokens_per_s: float, rtt_s: float,
                       local_queue_s: float, num_streams: int = 0) -> bool:
        return worth_a_lookup(num_tokens, local_tokens_per_s, rtt_s, local_queue_s,
                              num_streams if self.counts_streams else 0)

    def plan(self, req: PlanRequest) -> FetchPlan:
        return plan_fetch(req if self.counts_streams else replace(req, num_streams=0))


@dataclass(frozen=True)
class ThresholdPlacement:
    max_local_tokens: int
    name: str = "threshold"
    prices_prefill_nodes: bool = False

    def worth_a_lookup(self, num_tokens: int, local_tokens_per_s: float, rtt_s: float,
                       local_queue_s: float, num_streams: int = 0) -> bool:
        return num_tokens > self.max_local_tokens

    def plan(self, req: PlanRequest) -> FetchPlan:
        """Promote what the lower tiers hold, then fetch from the longest holder and a prefill node when more than
        ``max_local_tokens`` tokens are left, else compute. Its estimates are not priced (all 0)."""
        bs, start = req.block_size, req.num_local
        promote_end = start + req.num_lower
        fetch = (req.end - promote_end) * bs > self.max_local_tokens
        holder = max(req.holders, key=lambda h: (h.end, h.node_id), default=None)
        held_end = max(promote_end, min(holder.end, req.end)) if holder is not None and fetch else promote_end
        return FetchPlan(start, promote_end, holder.node_id if held_end > promote_end else "", held_end,
                         req.prefill.node_id if fetch and req.prefill is not None else "", req.end,
                         0.0, 0.0, 0.0, 0.0, 0.0, 0.0)


def make_placement(spec: str) -> Placement:
    """``cost``, ``cost:request`` or ``threshold:N`` (N >= 0 tokens); ValueError names what is accepted."""
    if spec == "cost":
        return CostPlacement()
    if spec == "cost:request":
        return CostPlacement(counts_streams=False)
    kind, _, value = spec.partition(":")
    if kind == "threshold" and value.isdigit():
        return ThresholdPlacement(int(value))
    raise ValueError(f"unknown placement {spec!r}: expected 'cost', 'cost:request' or 'threshold:N' (N >= 0 tokens)")
