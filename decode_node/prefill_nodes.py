"""The prefill nodes as one decode node sees them: what a conversation with each costs, and the conversation.

Each prefill node's cost is fitted to this node's own conversations with it (``CostFit``: a fixed part
for the messaging, that node's step and the writes, plus the tokens at its rate), seeded from the
rate and decode step it published. ``best`` prices every registered prefill node for a number of
tokens, its work in flight from this node included, and returns the planner's ``PrefillOption``;
``compute_and_push`` (the connector's load: into a ``KVLease``'s block ids) runs one ``ComputeAndPush``
conversation at a time, the planned node first, moving on to the next candidate after a refusal or failure.
Thread-safe: admissions (engine thread) price while fetch threads converse.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from typing import NamedTuple

from kvmesh.decode_node.cost_model import PeerLinks
from kvmesh.node.planner import PrefillOption
from kvmesh.engine.kv_connector import KVLease
from kvmesh.rate_meter import CostFit
from kvmesh.transfer import messages as m
from kvmesh.transfer.errors import TransferRefused

log = logging.getLogger("kvmesh.decode")

MAX_CANDIDATES = 3  # prefill nodes one request tries before computing the rest here


class PrefillResult(NamedTuple):
    got: int  # the first block not received
    tainted: list[int]  # block ids a writer may still write
    reused: int  # received blocks the prefill nodes had cached rather than computed
    fences: list[str]  # per conversation, what fenced its writes (``transfer.grants.Fence``)
    num_rounds: int  # conversations in all (landing rounds included)
    first_token: tuple[int, float] | None = None  # the tail received: the token picked after the prompt, its logprob


class PrefillNodes:
    def __init__(self, node_id: str, membership, requester, links: PeerLinks, block_size: int,
                 prior_rtt_s: float, timeout_s: float):
        self._node_id = node_id
        self._membership = membership
        self._requester = requester
        self._links = links
        self._block_size = block_size
        self._prior_rtt_s = prior_rtt_s
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._turn = 0  # rotation among prefill nodes that rank equal
        self._in_flight: Counter[str] = Counter()  # conversations per prefill node
        self._tokens_in_flight: Counter[str] = Counter()  # ... and the prompt tokens they ask for
        self._costs: dict[str, CostFit] = {}
        self.num_refusals = 0
        self.num_fallbacks = 0

    def node_ids(self) -> list[str]:
        return sorted(self._membership.nodes("prefill"))

    def _cost(self, node_id: str, published_per_s: float, step_s: float) -> CostFit:
        """A conversation with ``node_id`` end to end, as this node sees it. Seeded with the rate the node
        published (its start-up probe) and, as the fixed part, the prior round trip plus one engine step there
        (a conversation costs that node at least one step of its own); refitted to every conversation that
        succeeded (caller holds ``_lock``)."""
        fit = self._costs.get(node_id)
        if fit is None:
            fixed = self._prior_rtt_s + step_s
            fit = self._costs[node_id] = CostFit([(n, fixed + n / published_per_s) for n in (64, 512)])
        return fit

    def best(self, num_tokens: int, hits: dict[str, int]) -> PrefillOption | None:
        """The prefill node that would finish ``num_tokens`` soonest (None: none registered with a rate)."""
        best, best_s = None, float("inf")
        with self._lock:
            for node_id, record in self._membership.nodes("prefill").items():
                priced = self._price(node_id, record)
                if priced is None:
                    continue
                rate, queue_s, fixed_s = priced
                finish_s = queue_s + fixed_s + num_tokens / rate
                if finish_s < best_s:
                    best_s = finish_s
                    best = PrefillOption(node_id, rate, queue_s, fixed_s, self._links.bytes_per_s(node_id),
                                         hits.get(node_id, 0))
        return best

    def _price(self, node_id: str, record) -> tuple[float, float, float] | None:
        """(tokens per second, seconds of work already sent there from here, fixed seconds per conversation)
        of a prefill node's registry record; None without a published rate (caller holds ``_lock``)."""
        if record is None or not record.probe.prefill_tokens_per_s > 0:
            return None
        published = record.probe.prefill_tokens_per_s
        fit = self._cost(node_id, published, record.probe.decode_step_s)
        # Never faster than the node measured itself computing: a quicker conversation found the
        # prompt cached there (an index not yet updated), which says nothing about the next one.
        rate = min(fit.per_s, published)
        return rate, self._tokens_in_flight[node_id] / rate, fit.fixed_s

    def expected_s(self, node_id: str, num_tokens: int) -> float:
        """When ``node_id`` should have delivered ``num_tokens`` sent now, behind what this node already sent it
        (0.0 when it published no rate)."""
        with self._lock:
            priced = self._price(node_id, self._membership.nodes("prefill").get(node_id))
        if priced is None:
            return 0.0
        rate, queue_s, fixed_s = priced
        return queue_s + fixed_s + num_tokens / rate

    def any_option(self, hits: dict[str, int]) -> PrefillOption | None:
        """The first candidate, unpriced (placements that do not price: any will do; ``reserve`` moves the
        rotation on, so consecutive conversations from here take turns among equals)."""
        first = next(iter(self.candidates(hits)), None)
        return None if first is None else PrefillOption(first, 0.0, 0.0, 0.0, 0.0, hits.get(first, 0))

    def reserve(self, node_id: str, num_tokens: int) -> None:
        """Count a planned conversation as in flight from the moment it is planned (engine thread), so that the
        next admission prices ``node_id`` with it; ``compute_and_push`` takes the reservation over."""
        with self._lock:
            self._in_flight[node_id] += 1
            self._tokens_in_flight[node_id] += num_tokens
            self._turn += 1

    def release(self, node_id: str, num_tokens: int) -> None:
        """Undo ``reserve`` (a planned conversation that will not run, or one that has ended)."""
        with self._lock:
            self._in_flight[node_id] -= 1
            self._tokens_in_flight[node_id] -= num_tokens

    def candidates(self, hits: dict[str, int], *first: str) -> list[str]:
        """Prefill nodes, best first: ``first`` (the plan's choice), the longest cached prefix, the fewest
        prompts this node has in flight there, then rotation (advanced by each ``reserve``)."""
        nodes = self.node_ids()
        if not nodes:
            return []
        rank: dict[str, int] = {}
        for node_id in first:
            if node_id and node_id not in rank:  # the first mention ranks
                rank[node_id] = len(rank)
        with self._lock:
            load = dict(self._in_flight)
            turn = self._turn % len(nodes)
        rotation = {n: (i - turn) % len(nodes) for i, n in enumerate(nodes)}
        return sorted(nodes, key=lambda n: (rank.get(n, len(rank)), -hits.get(n, 0), load.get(n, 0), rotation[n]))

    def compute_and_push(self, lease: KVLease, start: int, end: int, order: list[str], local_s: float,
                         reserved: tuple[str, int] | None = None, trace_context: str = "") -> PrefillResult:
        """Blocks ``[start, end)`` of the lease's prompt computed by prefill nodes in ``order`` (at most
        MAX_CANDIDATES) and pushed into its block ids (stopping once the lease is cancelled), and its tail after
        them where the lease has one and ``end`` reaches it; returns the first block not received, block ids a
        writer may still write, how many of the received blocks the prefill nodes had cached rather than computed,
        how the writes were fenced, and with the tail the token the prefill node picked after the prompt.

        ``local_s``: the plan's cost without peers (``FetchPlan.local_cost``: the time it takes here and the wait
        that puts on the streams decoding here; 0: forced, no limit): a prefill node that cannot deliver sooner,
        its backlog from every decode node included, refuses (BUSY); one that accepted is given that long plus the
        prefill timeout before this node computes the blocks itself. A forced conversation is given the
        time the node is expected to take (``expected_s``) plus the timeout. ``reserved``: the (node, tokens)
        ``reserve``d when this conversation was planned, released here as each conversation counts its own."""
        if reserved is not None:
            self.release(*reserved)
        asked, got, tainted, reused = time.perf_counter(), start, [], 0
        fences, rounds, first = [], 0, None
        last = end + 1 if lease.tail and end == lease.end else end  # the tail: the block after ``end``
        for node_id in order[:MAX_CANDIDATES]:
            if lease.cancelled():
                break
            wanted_within_s = max(1e-3, local_s - (time.perf_counter() - asked)) if local_s > 0 else 0.0
            num_tokens = (end - got) * self._block_size
            # A prefill node that accepts promises to beat ``wanted_within_s``; giving up on one that is late but
            # still computing would only start the whole prompt again here. The timeout is the grace past that
            # promise, or past the node's expected time where nothing was promised (a forced conversation).
            patience_s = wanted_within_s if local_s > 0 else self.expected_s(node_id, num_tokens)
            timeout_s = min(self._timeout_s + patience_s, m.MAX_WAIT_MS / 1000)
            with self._lock:
                self._in_flight[node_id] += 1
                self._tokens_in_flight[node_id] += num_tokens
            started = time.perf_counter()
            try:
                outcome = self._requester.compute_and_push(
                    node_id, list(lease.block_ids[got:last]), list(lease.prompt_token_ids), got,
                    request_id=f"{lease.request_id}/prefill", timeout_s=timeout_s,
                    wanted_within_s=wanted_within_s, cache_salt=lease.cache_salt,
                    trace_context=trace_context, with_tail=last > end)
            finally:
                with self._lock:
                    self._in_flight[node_id] -= 1
                    self._tokens_in_flight[node_id] -= num_tokens
            if outcome.error is None and node_id in self._costs:
                with self._lock:  # the whole conversation: its queueing and the transfer included
                    self._costs[node_id].record(num_tokens, time.perf_counter() - started)
            self._links.record_transfer(node_id, outcome.num_written, outcome.write_s)
            tainted += outcome.tainted_block_ids
            got += outcome.num_written
            reused += outcome.num_reused
            fences.append(outcome.fence)
            rounds += outcome.num_rounds
            if got >= last > end:  # the tail arrived: the token after the prompt with it
                first = outcome.first_token
            if outcome.error is None:
                break
            if isinstance(outcome.error, TransferRefused):
                self.num_refusals += 1
            else:
                self.num_fallbacks += 1
            busy = isinstance(outcome.error, TransferRefused) and outcome.error.code == m.ErrorCode.BUSY.value
            log.log(logging.INFO if busy else logging.WARNING, "%s: prefill node %s for %s: %s", self._node_id,
                    node_id, lease.request_id, outcome.error)  # busy: a decision (computed here), not a fault
            if got >= last or outcome.tainted_block_ids:
                break  # tainted blocks cannot be granted again: compute the rest here
        return PrefillResult(got, tainted, reused, fences, rounds, first)

    def stats(self) -> dict:
        with self._lock:
            rates = {n: f.per_s for n, f in self._costs.items()}
            fixed_ms = {n: f.fixed_s * 1e3 for n, f in self._costs.items()}
        return {"prefill_node_tokens_per_s": rates, "prefill_node_fixed_ms": fixed_ms,
                "prefill_node_ids": self.node_ids(),  # what this node can send work to
                "num_fallbacks": self.num_fallbacks, "num_prefill_refusals": self.num_refusals}
