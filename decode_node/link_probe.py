"""The start-up measurement of a decode node's shared-memory fetch round trip (docs/design.md §2).

A fetch from holders on this host costs a few milliseconds of messaging beyond its bytes; the planner
needs that number before the first real fetch. A decode node whose KV buffer is in shared memory
fetches a few blocks from itself through the whole holder path (side channel, holder, the
shared-memory write, the final answer), the best of a few tries. Talking to itself says nothing
about another host, so network links keep their prior.
"""
from __future__ import annotations

import logging
import time

from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.kv.cache_stats import PrefixCacheStats

log = logging.getLogger("kvmesh.decode")

PROBE_FETCH_BLOCKS = 4
PROBE_FETCH_TRIES = 3


def probe_shared_memory_round_trip(node_id: str, engine, agent) -> float | None:
    """Seconds of the best probe fetch (None: it failed). Call before serving: it runs the engine on this
    thread, and leaves the pool, the cache statistics and the agent's counters as if nothing had run."""
    pool, bs = engine.pool, engine.config.block_size
    num_blocks = max(1, min(PROBE_FETCH_BLOCKS, pool.num_blocks // 4))
    seq = engine.add_request([(11 * i + 3) % 250 for i in range(num_blocks * bs + 1)],
                             SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    while not seq.is_finished:
        engine.step()
    best: float | None = float("inf")
    for attempt in range(PROBE_FETCH_TRIES):
        block_ids = pool.allocate(num_blocks)
        started = time.perf_counter()
        outcome = agent.requester.push(node_id, block_ids, seq.block_hashes[:num_blocks],
                                       request_id=f"{node_id}/rtt-probe-{attempt}", timeout_s=5.0)
        took = time.perf_counter() - started
        pool.free(block_ids)
        if outcome.error is not None or outcome.num_written != num_blocks or outcome.tainted_block_ids:
            log.warning("%s: round-trip probe failed (%s): the shared-memory link keeps --transfer-rtt-ms",
                        node_id, outcome.error)
            best = None
            break
        best = min(best, took)
    pool.evict(pool.num_blocks)  # as after the compute probe: nothing of this is published
    pool.take_changes()
    engine.kv.stats = PrefixCacheStats()
    agent.reset_counters()
    return best
