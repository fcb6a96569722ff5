"""EngineLoop: the one thread that touches a node's engine and scheduler.

Other threads hand it work with ``call_soon``; between commands it steps the
engine while there is work (idle, it sleeps until a command arrives: no poll),
reports finished requests (``on_finish``), requests failed by a broken step
(``on_failed``: exactly that step's batch, already FAILED and freed) and runs
``after_step`` (the block publisher's drain); ``after_commands`` runs once the
commands waiting between two steps have run, before the next step (what they
streamed leaves then, not a step later).
With a ``CoreShare`` it marks whether the node has work and sizes the step's compute
threads to the cores the machine's other nodes leave (``kvmesh/node/core_share.py``).
Construction starts nothing; ``start`` starts the thread.
"""
from __future__ import annotations

import logging
import queue
import threading
from collections import Counter
from collections.abc import Callable

import torch

from kvmesh.engine.engine import LLMEngine, StepFailed
from kvmesh.engine.request_state import RequestStatus
from kvmesh.engine.sequence import Sequence
from kvmesh.model.tp_shard import TensorParallelError
from kvmesh.node.core_share import CoreShare
from kvmesh.node.step_clock import StepClock

log = logging.getLogger("kvmesh.node")


def _nothing() -> None:
    """A command that only wakes the loop."""


class EngineLoop:
    def __init__(self, engine: LLMEngine, name: str, on_finish: Callable[[Sequence], None],
                 on_failed: Callable[[Sequence, str], None], after_step: Callable[[], None],
                 cores: CoreShare | None = None, on_broken: Callable[[str], None] | None = None,
                 after_commands: Callable[[], None] | None = None):
        """``on_broken(why)``: a step failed because the model's tensor-parallel group broke (called before the
        batch's ``on_failed``): the engine cannot step again."""
        self.engine = engine
        self.name = name
        self._on_finish = on_finish
        self._on_failed = on_failed
        self._after_step = after_step
        self._after_commands = after_commands
        self._on_broken = on_broken
        self._cores = cores
        self._commands: queue.Queue[Callable[[], None]] = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kvmesh-engine-{name}", daemon=True)
        self.num_failed_steps = 0
        self.clock = StepClock()  # where the steps' time goes: on a core, waiting for one, asleep (the GIL)
        # Compute threads of the last step that computed prompt tokens and of the last decode-only step (with
        # fixed threads: those of every step).
        self.compute_threads = {"prompt": 0, "decode": 0}
        # Decode-only steps by the compute threads they ran on: how many, and their wall seconds.
        self.decode_steps_by_threads: Counter[int] = Counter()
        self.decode_seconds_by_threads: Counter[int] = Counter()

    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the engine thread (the only one that touches the engine)."""
        self._commands.put(fn)

    def run_as_owner(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` as the engine's owner: while the loop runs, on its thread between steps, in order behind the
        commands sent before it (``call_soon``); at once where the caller is that thread or no loop runs yet
        (start-up probes own the engine then) or any more."""
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self.call_soon(fn)
        else:
            fn()

    def decode_thread_choices(self) -> dict[str, int]:
        """What the node's decode-only steps measured best per pair of candidate thread counts (``"1-2"`` -> 2;
        empty with fixed threads or before a probe ends)."""
        return self._cores.chooser.choices() if self._cores is not None else {}

    def decode_steps(self) -> dict[str, list[float]]:
        """Any thread: decode-only steps by their compute threads (``"2"`` -> [steps, wall seconds])."""
        steps, seconds = dict(self.decode_steps_by_threads), dict(self.decode_seconds_by_threads)
        return {str(n): [steps[n], seconds.get(n, 0.0)] for n in sorted(steps)}

    def wake(self) -> None:
        """Any thread: run one more loop round (its ``after_step``: something else changed what the node
        publishes)."""
        self._commands.put(_nothing)

    def _run(self) -> None:
        scheduler = self.engine.scheduler
        self.clock.start()
        if self._cores is None:  # fixed threads: what every step runs on
            self.compute_threads = dict.fromkeys(self.compute_threads, torch.get_num_threads())
        while not self._stop.is_set():
            busy = scheduler.has_runnable()
            try:
                # Idle: sleep until a command arrives (every way work reaches the engine is a command; ``close``
                # sends one too), never a timed poll.
                fn = self._commands.get_nowait() if busy else self._commands.get()
                fn()
                while True:
                    self._commands.get_nowait()()
            except queue.Empty:
                pass
            except Exception:
                log.exception("%s: command failed", self.name)
            if self._after_commands is not None:
                self._after_commands()
            has_work = scheduler.has_runnable()
            if self._cores is not None:
                self._cores.set_busy(has_work)
            if has_work:
                computes_prompts = bool(scheduler.waiting or scheduler.kv_landed) or \
                    any(s.is_prefilling for s in scheduler.running)
                if self._cores is not None:
                    self.compute_threads["prompt" if computes_prompts else "decode"] = \
                        self._cores.fit_threads(computes_prompts)
                self.clock.begin(decode_only=not computes_prompts)
                try:
                    for seq in self.engine.step():
                        if seq.status is RequestStatus.FAILED:
                            self._on_failed(seq, seq.error)
                        else:
                            self._on_finish(seq)
                except StepFailed as e:
                    self.num_failed_steps += 1
                    log.exception("%s: %s (%d requests failed)", self.name, e, len(e.failed))
                    if isinstance(e.__cause__, TensorParallelError) and self._on_broken is not None:
                        self._on_broken(str(e))
                    for seq in e.failed:
                        self._on_failed(seq, str(e))
                seconds = self.clock.end()
                if not computes_prompts:
                    threads = self.compute_threads["decode"]
                    self.decode_steps_by_threads[threads] += 1
                    self.decode_seconds_by_threads[threads] += seconds
                if self._cores is not None:
                    self._cores.end_step(seconds)
            self._after_step()
        self.clock.close()
        if self._cores is not None:
            self._cores.set_busy(False)

    def close(self) -> None:
        self._stop.set()
        self._commands.put(_nothing)  # wakes an idle loop
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        if self._cores is not None and not self._thread.is_alive():
            self._cores.close()
