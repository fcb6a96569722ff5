"""StepClock: where the engine thread's time goes during its steps, as the kernel accounts it.

A step's wall time splits three ways (Linux: ``/proc/thread-self/schedstat``, read with one ``pread``):

    on_cpu     the thread ran (Python, and its share of the forward's compute threads' work)
    runnable   it could run but waited for a core (other threads and processes had them)
    asleep     it blocked: on the GIL while another thread of the process held it, or at the end of a
               parallel region for slower compute threads (a CPU step waits on no I/O)

``asleep`` bounds the GIL's share of a step from above: if it is small, sharing the process with the
node's I/O threads costs the engine little; if it is large, the engine core wants a process of its own.
Decode-only steps (no prompt token computed) are totalled apart: a stream's next token when no prompt
shares the step, what the role balancer weighs a decode node by. Where schedstat is missing the clock
reports the decode-only totals alone. Engine thread only: ``start`` opens the file of
the thread that calls it.
"""
from __future__ import annotations

import os
import time


class StepClock:
    def __init__(self):
        self._fd: int | None = None
        self.num_steps = 0
        self.wall_s = self.on_cpu_s = self.runnable_s = 0.0
        self.num_decode_steps = 0  # steps that computed no prompt token, and their wall time: what a stream's
        self.decode_wall_s = 0.0  # next token waits for when no prompt shares the step
        self._at: tuple[int, int] | None = None  # schedstat (on a core, runnable) when the step began
        self._began, self._decode_only = 0.0, False

    def start(self) -> None:
        """On the engine thread, once: open its schedstat (nothing is measured where that fails)."""
        try:
            self._fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
            self._read()
        except OSError:
            self._fd = None

    def _read(self) -> tuple[int, int]:
        on_cpu_ns, runnable_ns, _ = os.pread(self._fd, 128, 0).split()
        return int(on_cpu_ns), int(runnable_ns)

    def begin(self, decode_only: bool = False) -> None:
        """A step starts (``decode_only``: it computes no prompt token)."""
        self._decode_only = decode_only
        self._began = time.perf_counter()
        if self._fd is not None:
            self._at = self._read()

    def end(self) -> float:
        """The step ended; returns its wall seconds."""
        elapsed = time.perf_counter() - self._began
        if self._decode_only:
            self.num_decode_steps += 1
            self.decode_wall_s += elapsed
        if self._fd is None or self._at is None:
            return elapsed
        on_cpu, runnable = self._at
        now_on_cpu, now_runnable = self._read()
        self.wall_s += elapsed
        self.on_cpu_s += (now_on_cpu - on_cpu) / 1e9
        self.runnable_s += (now_runnable - runnable) / 1e9
        self.num_steps += 1
        self._at = None
        return elapsed

    def stats(self) -> dict:
        """Shares of the steps' wall time so far (engine thread or not: plain floats, read as they are)."""
        wall = self.wall_s
        decode = {"engine_decode_step_s": self.decode_wall_s, "engine_decode_steps": self.num_decode_steps}
        if not wall:
            return {"engine_step_s": 0.0, "engine_steps_timed": 0, **decode}
        # The kernel's clock and ours tick apart: where the two parts overrun the wall time a little, they are
        # scaled back to fill it (asleep 0), so the three shares always sum to one.
        accounted = max(wall, self.on_cpu_s + self.runnable_s)
        on_cpu, runnable = self.on_cpu_s / accounted, self.runnable_s / accounted
        return {**decode, "engine_step_s": wall, "engine_steps_timed": self.num_steps,
                "engine_on_cpu_share": on_cpu, "engine_runnable_share": runnable,
                "engine_asleep_share": max(0.0, 1.0 - on_cpu - runnable)}

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
