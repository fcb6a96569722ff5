"""DecodeThreadChooser: how many compute threads a node's decode-only steps run on, chosen by measuring.

A decode-only step is a string of short OpenMP regions, each as fast as its slowest thread: where the
serving machinery (router, etcd, every node's I/O threads) shares the cores, a thread descheduled for a
token's delivery stalls the whole step, and one thread fewer than the node's share of the cores can
decode faster; on another machine (or under another load) the whole share is faster. Neither holds
everywhere, so each node measures on its own steps: given the two candidate counts (``fewer``: the share
less the core left to the machinery, ``more``: the whole share), a probe alternates them step by step
until each has ``probe_steps`` steps, keeps the count whose median step was faster (``more`` must win by
``margin``: it takes a core from everything else on the machine), and holds that choice for
``hold_steps`` decode-only steps before probing again, since batch, context and load move. Steps of
another pair of candidates (the share changed as other nodes started or stopped work) keep their own
probe and choice.

Policy only: it never sets threads itself (``CoreShare.fit_threads`` does) and owns no lock (the engine
thread is its only caller).
"""
from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass, field

log = logging.getLogger("kvmesh.node")


@dataclass
class _PairState:
    """One pair of candidate counts: a probe's samples (seconds per step, by count) or the held choice."""

    samples: dict[int, list[float]] = field(default_factory=dict)
    choice: int = 0  # 0: probing
    num_held: int = 0  # decode-only steps since the choice was made


class DecodeThreadChooser:
    def __init__(self, probe_steps: int = 12, hold_steps: int = 400, margin: float = 0.05):
        if probe_steps < 1 or hold_steps < 1 or not 0 <= margin < 1:
            raise ValueError(f"probe_steps {probe_steps}, hold_steps {hold_steps}, margin {margin}: out of range")
        self.probe_steps = probe_steps
        self.hold_steps = hold_steps
        self.margin = margin
        self._pairs: dict[tuple[int, int], _PairState] = {}
        self.num_probes = 0  # probes finished (each one a choice made)

    def pick(self, fewer: int, more: int) -> int:
        """The count the next decode-only step runs on, given the pair of candidates."""
        if fewer >= more:
            return more
        state = self._pairs.setdefault((fewer, more), _PairState({fewer: [], more: []}))
        if state.choice and state.num_held >= self.hold_steps:  # held long enough: probe again
            state.choice, state.samples = 0, {fewer: [], more: []}
        if state.choice:
            return state.choice
        return fewer if len(state.samples[fewer]) <= len(state.samples[more]) else more

    def record(self, fewer: int, more: int, threads: int, seconds: float) -> None:
        """A decode-only step picked for this pair ran ``seconds`` on ``threads``."""
        state = self._pairs.get((fewer, more))
        if state is None:
            return
        if state.choice:
            state.num_held += 1
            return
        if threads not in state.samples:
            return
        state.samples[threads].append(seconds)
        if min(len(state.samples[fewer]), len(state.samples[more])) < self.probe_steps:
            return
        fewer_s, more_s = (statistics.median(state.samples[n]) for n in (fewer, more))
        state.choice = more if more_s < fewer_s * (1 - self.margin) else fewer
        state.num_held = 0
        self.num_probes += 1
        log.info("decode-only steps on %d threads (median step %.1f ms on %d, %.1f ms on %d)",
                 state.choice, fewer_s * 1e3, fewer, more_s * 1e3, more)

    def choices(self) -> dict[str, int]:
        """The held choice per pair (``"fewer-more"`` -> threads; pairs still probing are left out)."""
        return {f"{f}-{m}": s.choice for (f, m), s in list(self._pairs.items()) if s.choice}
