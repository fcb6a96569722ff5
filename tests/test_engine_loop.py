"""EngineLoop, the one thread of a node's engine: idle, it sleeps until a command arrives (no timed poll), and
commands from other threads run and step the engine."""
from __future__ import annotations

import queue
import threading
import time

from kvmesh import LLM, SamplingParams
from kvmesh.node.engine_loop import EngineLoop


class RecordingQueue(queue.Queue):
    """A command queue that remembers every blocking wait's timeout."""

    def __init__(self):
        super().__init__()
        self.timeouts: list[float | None] = []

    def get(self, block=True, timeout=None):
        if block:
            self.timeouts.append(timeout)
        return super().get(block, timeout)


def thread_cpu_s(thread: threading.Thread) -> float:
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


def test_an_idle_loop_sleeps_until_a_command_and_steps_what_the_command_added():
    llm = LLM("tiny-llama", progress=False)
    finished = []
    loop = EngineLoop(llm.engine, "t", finished.append, lambda seq, why: None, lambda: None)
    loop._commands = commands = RecordingQueue()
    loop.start()
    try:
        deadline = time.monotonic() + 30
        while not commands.timeouts and time.monotonic() < deadline:  # wait for the loop to go idle
            time.sleep(0.01)
        cpu_before = thread_cpu_s(loop._thread)
        time.sleep(0.3)
        assert thread_cpu_s(loop._thread) - cpu_before < 0.01  # asleep, not polling
        assert commands.timeouts and all(t is None for t in commands.timeouts)
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        added = []
        loop.call_soon(lambda: added.append(llm.engine.add_request([1, 2, 3, 4, 5], params)))
        while not finished and time.monotonic() < deadline:
            time.sleep(0.01)
        assert finished == added and len(finished[0].output_token_ids) == 4
    finally:
        loop.close()
    assert not loop._thread.is_alive()  # close woke the sleeping loop
    llm.engine.check_integrity()


def test_the_step_clock_splits_the_steps_wall_time():
    llm = LLM("tiny-llama", progress=False)
    finished = []
    loop = EngineLoop(llm.engine, "t", finished.append, lambda seq, why: None, lambda: None).start()
    try:
        params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        loop.call_soon(lambda: [llm.engine.add_request([1, 2, 3, i], params) for i in range(4)])
        deadline = time.monotonic() + 30
        while len(finished) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        loop.close()
    stats = loop.clock.stats()
    assert stats["engine_steps_timed"] >= 16  # one prompt step, then a decode step per token
    shares = [stats[f"engine_{part}_share"] for part in ("on_cpu", "runnable", "asleep")]
    assert all(0.0 <= share <= 1.0 for share in shares) and abs(sum(shares) - 1.0) < 1e-6
    assert stats["engine_on_cpu_share"] > 0.0 and stats["engine_step_s"] > 0.0
    assert 10 <= stats["engine_decode_steps"] < stats["engine_steps_timed"]  # the prompt step is not one
    assert 0.0 < stats["engine_decode_step_s"] < stats["engine_step_s"]


def test_changes_as_the_owner_run_on_the_engine_thread_in_order_and_at_once_where_no_loop_runs():
    """``run_as_owner``: from another thread, on the engine thread, after what was sent before it (a grant's
    quarantine reference must be taken before the load that reports its blocks lands); before the loop starts,
    at once on the caller's thread."""
    llm = LLM("tiny-llama", progress=False)
    loop = EngineLoop(llm.engine, "t", lambda seq: None, lambda seq, why: None, lambda: None)
    ran: list[tuple[str, str]] = []
    loop.run_as_owner(lambda: ran.append(("before start", threading.current_thread().name)))
    assert ran == [("before start", threading.current_thread().name)]
    loop.start()
    try:
        release = threading.Event()
        loop.call_soon(release.wait)  # the engine thread is busy: what follows must queue behind it
        loop.call_soon(lambda: ran.append(("sent first", threading.current_thread().name)))
        loop.run_as_owner(lambda: ran.append(("as owner", threading.current_thread().name)))
        loop.call_soon(lambda: loop.run_as_owner(lambda: ran.append(("from the engine thread", "at once"))))
        assert len(ran) == 1  # nothing ran on this thread
        release.set()
        deadline = time.monotonic() + 30
        while len(ran) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ran[1:] == [("sent first", "kvmesh-engine-t"), ("as owner", "kvmesh-engine-t"),
                           ("from the engine thread", "at once")]
    finally:
        loop.close()


def test_what_commands_queue_leaves_before_the_next_step():
    """``after_commands`` runs once the commands waiting between two steps have run, before the step they start:
    what they streamed (a first token that came with its KV, streamed by the landing, a command) leaves at once,
    not a step later."""
    llm = LLM("tiny-llama", progress=False)
    finished, seen, state = [], [], {}
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)

    def command() -> None:
        llm.engine.add_request([1, 2, 3, 4, 5], params)
        state["steps_then"] = llm.engine.num_steps

    def after_commands() -> None:
        if "steps_then" in state and not seen:
            seen.append(llm.engine.num_steps)

    loop = EngineLoop(llm.engine, "t", finished.append, lambda seq, why: None, lambda: None,
                      after_commands=after_commands)
    loop.start()
    try:
        loop.call_soon(command)
        deadline = time.monotonic() + 30
        while not finished and time.monotonic() < deadline:
            time.sleep(0.01)
        assert finished and seen == [state["steps_then"]]  # before the request's first step, not after it
    finally:
        loop.close()
    llm.engine.check_integrity()
