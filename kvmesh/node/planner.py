"""The KV placement planner: where a prompt's uncached blocks come from (docs/design.md §2).

One pure function of what is known when a request arrives — the blocks this node caches, the
run below them in its own lower tiers, which peers hold how long a prefix and over which link,
the best prefill node's rate and queue, this node's own rate and queue — to a ``FetchPlan`` that
names every part and its estimated seconds:

    blocks [0, num_local)                   cached here (tier 0): free
           [num_local, promote_end)         this node's host/disk tiers   read rate
           [promote_end, holders_end)       ``holder`` pushes them        its round trip + bytes / its link
           [holders_end, end)               ``prefill_node`` computes and its fixed cost + queue + max(tokens / its
                                            pushes them (or nobody)       rate, bytes / its link), after the prefix
           block end, but its last token    the prefill node too, with    (``tail_tokens``)
                                            its blocks; else computed here
           [compute_from, prompt)           computed here                 after the queue here, at this node's rate

Holders and the prefill node work at the same time; what is computed here waits for the prefix
it attends to. A plan's cost is its estimate plus the wait it puts on the sequences running here
(``num_streams``: streams decoding, prompts being computed): the steps that compute its blocks here
hold each of them up that long (``stall_s``). Every candidate plan is priced and the cheapest taken; computing everything here
is always a candidate, so no plan costs more than it (``tests/test_planner.py`` checks that as a
property), and with no streams running here no plan's estimate exceeds it. No I/O, no threads,
no clocks: decode nodes plan admissions with it, prefill nodes plan "get the prefix" with it (no
prefill option), the router prices each decode node with it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


PRIOR_BYTES_PER_S = 2**30  # a link nobody has measured yet (nodes: --transfer-gib-per-s)
PRIOR_RTT_S = 0.010  # ... and its fetch overhead beyond the bytes (nodes: --transfer-rtt-ms)


@dataclass(frozen=True, slots=True)
class HolderOption:
    """A peer whose cache holds the prompt's blocks ``[0, end)`` (the global index), and its link to us."""

    node_id: str
    end: int
    bytes_per_s: float
    rtt_s: float  # a fetch's cost beyond its bytes


@dataclass(frozen=True, slots=True)
class PrefillOption:
    """A prefill node as this node sees it: its conversations' fitted cost and its work in flight from us."""

    node_id: str
    tokens_per_s: float
    queue_s: float  # the work already sent to it, at that rate
    fixed_s: float  # a conversation's cost beyond its tokens (messaging, its step, the final answer)
    bytes_per_s: float  # its link to us
    holds: int = 0  # blocks [0, holds) of the prompt it caches itself (no need to fetch them first)


@dataclass(frozen=True, slots=True)
class PlanRequest:
    """What a plan is a function of. Blocks are counted from the prompt's start; ``end`` is the block holding
    the prompt's last token, whose logits are always computed here. That block's ``tail_tokens`` before the last
    token are computed here too, unless a prefill node computes blocks up to ``end``: it sends them with its
    blocks (``KVLease.tail``)."""

    num_local: int
    end: int
    block_size: int
    bytes_per_token: int
    local_tokens_per_s: float
    local_queue_s: float = 0.0  # the prompt tokens queued here before this one, at the local rate
    num_lower: int = 0  # blocks [num_local, num_local + num_lower) are in this node's lower tiers
    lower_read_s: float = 0.0  # ... and reading them back takes this long
    holders: tuple[HolderOption, ...] = ()
    prefill: PrefillOption | None = None
    num_streams: int = 0  # sequences running here (decoding or computing a prompt): each waits while this node
    #                       computes the prompt's blocks
    local_step_tokens: int = 0  # with streams decoding here: the prompt tokens a step computes beside them, at most
    local_decode_step_s: float = 0.0  # ... and what each such step spends on their decodes (0: no cap, nothing)
    tail_tokens: int = 0  # block ``end``'s tokens before the prompt's last (see above)


class FetchPlan(NamedTuple):
    num_local: int
    promote_end: int  # [num_local, promote_end) from this node's lower tiers
    holder: str  # who pushes [promote_end, holders_end) ("" none)
    holders_end: int
    prefill_node: str  # who computes and pushes [holders_end, end) ("" none: computed here)
    end: int
    promote_s: float  # reading the lower tiers back (before the rest: counted in series)
    holders_s: float  # the holder's push
    prefill_s: float  # the prefill node's conversation (the prefix it must fetch first included)
    ready_s: float  # after promotion, until all of [promote_end, end) is in place here: the queue here, the KV
    #                 it waits for, the blocks it computes (prefill and holders work in parallel)
    seconds: float  # promote_s + ready_s: the plan's estimate
    local_seconds: float  # the best plan without peers (promotion, then compute here): what fetching must beat
    stall_s: float = 0.0  # the sequences running here, waiting while it computes blocks here: num_streams x that time
    local_stall_s: float = 0.0  # ... and what the best plan without peers would make them wait

    @property
    def cost(self) -> float:
        """What plans are compared by: this request's estimate and the wait it puts on the streams here."""
        return self.seconds + self.stall_s

    @property
    def local_cost(self) -> float:
        """The cost of the best plan without peers: a fetch delivering within it is no worse than computing here
        (a prefill node is asked to beat it, ``ComputeAndPush.wanted_within_ms``)."""
        return self.local_seconds + self.local_stall_s

    @property
    def use_prefill(self) -> bool:
        return bool(self.prefill_node)

    @property
    def compute_from(self) -> int:
        """The first block this node computes itself."""
        return self.end if self.prefill_node else self.holders_end

    @property
    def needs_fetch(self) -> bool:
        """Peers are involved (a fetch thread); a plan that only promotes runs on the engine thread."""
        return self.holders_end > self.promote_end or bool(self.prefill_node)


def prompt_tokens_ahead(queued: list[int], slice_tokens: int, own_tokens: int) -> int:
    """Prompt tokens a node computes before a new prompt of ``own_tokens`` (uncached) is done, with prompts of
    ``queued`` uncached tokens each admitted before it. A node that slices prompts (``slice_tokens`` per prompt
    per step; 0: no cap) advances every prompt in step with the new one, so each queued prompt delays it by at
    most the tokens it computes meanwhile, ``max(slice_tokens, own_tokens)``; without slicing they go first, whole."""
    if slice_tokens <= 0:
        return sum(queued)
    cap = max(slice_tokens, own_tokens)
    return sum(min(tokens, cap) for tokens in queued)


def worth_a_lookup(num_tokens: int, local_tokens_per_s: float, rtt_s: float, local_queue_s: float = 0.0,
                   num_streams: int = 0) -> bool:
    """False when computing ``num_tokens`` here (after the queue here, and the wait it puts on ``num_streams``
    sequences running here) costs less than one round trip, so no fetch can win and the index need not be read."""
    return local_queue_s + (1 + num_streams) * num_tokens / max(local_tokens_per_s, 1e-9) > rtt_s


def plan_fetch(req: PlanRequest) -> FetchPlan:
    """The cheapest plan for blocks ``[req.num_local, req.end)``. Raises ValueError on a local rate that is not
    positive; holders and prefill nodes without a positive rate are not considered."""
    if req.local_tokens_per_s <= 0:
        raise ValueError("the local prefill rate must be positive")
    bs, start, queue_s = req.block_size, req.num_local, req.local_queue_s

    spreads = req.num_streams > 0 and req.local_step_tokens > 0

    def compute_here(tokens: int) -> float:  # until the request's tokens are computed here: beside streams over
        #                                      capped steps, each after the first also decoding them
        more_steps = max(0, -(-tokens // req.local_step_tokens) - 1) if spreads else 0
        return tokens / req.local_tokens_per_s + more_steps * req.local_decode_step_s

    def stall(tokens: int) -> float:  # what the streams here wait: the compute alone (they decode in those steps)
        return req.num_streams * tokens / req.local_tokens_per_s

    def here_from(block: int) -> int:  # the tokens computed here when blocks [block, end) are (the tail with them)
        return (req.end - block) * bs + req.tail_tokens

    promote_end, promote_s = start, 0.0
    if req.num_lower and req.lower_read_s < compute_here(req.num_lower * bs):
        promote_end, promote_s = start + req.num_lower, req.lower_read_s
    alone = queue_s + compute_here(here_from(promote_end))
    local, local_stall = promote_s + alone, stall(here_from(promote_end))
    best = FetchPlan(start, promote_end, "", promote_end, "", req.end, promote_s, 0.0, 0.0, alone, local, local,
                     local_stall, local_stall)
    options: list[HolderOption | None] = [None]
    options += [h for h in req.holders if min(h.end, req.end) > promote_end and h.bytes_per_s > 0]
    for holder in options:
        held_end = promote_end if holder is None else min(holder.end, req.end)
        holder_id = "" if holder is None else holder.node_id
        from_holder = 0.0 if holder is None else \
            holder.rtt_s + _move(held_end - promote_end, bs, req.bytes_per_token, holder.bytes_per_s)
        if holder is not None:
            ready = max(from_holder, queue_s) + compute_here(here_from(held_end))
            best = _cheaper(best, FetchPlan(start, promote_end, holder_id, held_end, "", req.end, promote_s,
                                            from_holder, 0.0, ready, promote_s + ready, local,
                                            stall(here_from(held_end)), local_stall))
        pf = req.prefill
        if pf is None or pf.tokens_per_s <= 0 or pf.bytes_per_s <= 0 or held_end >= req.end:
            continue
        rest = req.end - held_end
        its_prefix = 0.0 if pf.holds >= held_end else from_holder
        remote = pf.fixed_s + pf.queue_s + its_prefix + max(here_from(held_end) / pf.tokens_per_s,
                                                            _move(rest + (req.tail_tokens > 0), bs,
                                                                  req.bytes_per_token, pf.bytes_per_s))
        ready = max(from_holder, remote, queue_s)
        best = _cheaper(best, FetchPlan(start, promote_end, holder_id, held_end, pf.node_id, req.end, promote_s,
                                        from_holder, remote, ready, promote_s + ready, local, 0.0, local_stall))
    return best


def _move(blocks: int, block_size: int, bytes_per_token: int, bytes_per_s: float) -> float:
    return blocks * block_size * bytes_per_token / bytes_per_s


def _cheaper(a: FetchPlan, b: FetchPlan) -> FetchPlan:
    return b if b.cost < a.cost else a
