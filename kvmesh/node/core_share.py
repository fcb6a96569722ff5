"""CoreShare: the compute threads of the nodes that share one machine's cores.

A launcher that starts several nodes on one machine (``kvmesh serve``, ``local-cluster``)
makes one small shared table (``CoreTable``: an unlinked file, its descriptor inherited by
the nodes, so nothing is left behind however the launcher ends) with a byte per node.
Each node's engine thread marks its byte while it has work and, before every step, sizes
its compute threads to the machine's cores divided among the nodes that have work right
then (``CoreShare.fit_threads``). A step that computes prompt tokens (long GEMMs) takes its
whole share; a decode-only step runs either on its whole share or on one core fewer, the core
left to the serving machinery (the router, etcd, every node's I/O threads), whichever its own
steps measure faster (``kvmesh/node/decode_threads.py``). A node that starts while another
is mid-step oversubscribes the cores for at most that step.

A node that dies with its byte marked leaves it marked until its restart clears it (the
others meanwhile compute on fewer threads, never on more).
"""
from __future__ import annotations

import fcntl
import mmap
import os
import tempfile
from contextlib import contextmanager

from kvmesh.node.decode_threads import DecodeThreadChooser

MAX_NODES = 64  # slots of one table; nodes started beyond it compute on fixed threads


def machine_cores() -> int:
    """The cores this process may run on (its affinity mask, not the machine's total)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class CoreTable:
    """The launcher's side: creates the table and hands out slots; ``close`` releases it."""

    def __init__(self, num_cores: int = 0):
        self.num_cores = num_cores or machine_cores()
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else None
        fd, path = tempfile.mkstemp(prefix="kvmesh-cores-", dir=folder)
        os.unlink(path)  # reachable only through the descriptor, which dies with the last process holding it
        os.ftruncate(fd, MAX_NODES)
        self.fd = fd
        self._slots: dict[str, int] = {}

    def slot_of(self, node_id: str) -> int | None:
        """The node's slot (the same one across restarts); None when the table is full."""
        if node_id not in self._slots and len(self._slots) < MAX_NODES:
            self._slots[node_id] = len(self._slots)
        return self._slots.get(node_id)

    def node_argument(self, node_id: str) -> str | None:
        """``--core-share``'s value for a node process that inherits ``fd`` (None: table full)."""
        slot = self.slot_of(node_id)
        return None if slot is None else f"{self.fd}:{slot}:{self.num_cores}"

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class CoreShare:
    """A node's side, used by its engine thread only."""

    def __init__(self, fd: int, slot: int, num_cores: int, chooser: DecodeThreadChooser | None = None):
        if not 0 <= slot < MAX_NODES or num_cores < 1:
            raise ValueError(f"core share slot {slot} of {MAX_NODES}, {num_cores} cores: out of range")
        self._map = mmap.mmap(fd, MAX_NODES)
        self._fd = fd
        self.slot = slot
        self.num_cores = num_cores
        self._busy = False
        self._map[slot] = 0  # a restart clears what a dead predecessor left marked
        self.num_threads = 0  # what this thread computes on now (0: not set yet)
        self.chooser = chooser or DecodeThreadChooser()
        self._step: tuple[int, int, int, int] | None = None  # the decode-only step sized last: (fewer, more,
        #                                                       threads, nodes with work then)
        self.num_mixed_steps = 0  # decode-only steps left out of the chooser: other nodes' work changed during them

    @classmethod
    def from_argument(cls, value: str) -> CoreShare:
        """From ``FD:SLOT:CORES`` (``CoreTable.node_argument``)."""
        try:
            fd, slot, cores = (int(x) for x in value.split(":"))
        except ValueError:
            raise ValueError(f"--core-share takes FD:SLOT:CORES, not {value!r}") from None
        return cls(fd, slot, cores)

    @contextmanager
    def alone(self):
        """Around a start-up measurement (``NodeRuntime``'s probe): waits while another node of this table measures,
        then holds every core: the table's other nodes see this one busy and step on their share, and this one
        computes on all of them. Start-up probes of nodes started together used to run at once, each on every core,
        and measured rates several times too slow. An exclusive ``flock`` on the table, reopened (a lock belongs to
        an open file, and the descriptor every node inherited is one open file); released however the node ends."""
        try:
            fd = os.open(f"/proc/self/fd/{self._fd}", os.O_RDWR)
        except OSError:  # no /proc: measured unserialised, as before
            fd = -1
        try:
            if fd >= 0:
                fcntl.flock(fd, fcntl.LOCK_EX)
            self.set_busy(True)
            self._set_threads(self.num_cores)
            yield
        finally:
            self.set_busy(False)
            if fd >= 0:
                os.close(fd)

    def _set_threads(self, n: int) -> None:
        if n != self.num_threads:
            import torch

            torch.set_num_threads(n)
            self.num_threads = n

    def set_busy(self, busy: bool) -> None:
        """Mark whether this node has work (written only when it changes)."""
        if busy != self._busy:
            self._map[self.slot] = 1 if busy else 0
            self._busy = busy

    def num_busy(self) -> int:
        """Nodes with work now, this one counted if it has."""
        return self._map[:].count(1)

    def decode_candidates(self, num_busy: int | None = None) -> tuple[int, int]:
        """A decode-only step's two thread counts: the share of the cores less the one left to the machinery,
        and the whole share (each at least 1), among ``num_busy`` nodes with work (None: the table now)."""
        busy = max(1, self.num_busy() if num_busy is None else num_busy)
        return max(1, (self.num_cores - 1) // busy), max(1, self.num_cores // busy)

    def threads_now(self, computes_prompts: bool = True) -> int:
        """The cores divided among the nodes with work; for a decode-only step, the candidate its chooser
        picks."""
        if computes_prompts:
            return max(1, self.num_cores // max(1, self.num_busy()))
        return self.chooser.pick(*self.decode_candidates())

    def fit_threads(self, computes_prompts: bool = True) -> int:
        """Before a step: set this thread's compute threads to ``threads_now()``; returns it. ``end_step`` after
        it hands a decode-only step's time to the chooser."""
        if computes_prompts:
            n, self._step = self.threads_now(), None
        else:
            busy = self.num_busy()  # one read: what the step is sized for is what its sample is checked against
            fewer, more = self.decode_candidates(busy)
            n = self.chooser.pick(fewer, more)
            self._step = (fewer, more, n, busy)
        self._set_threads(n)
        return n

    def end_step(self, seconds: float) -> None:
        """After the step ``fit_threads`` sized, with its wall time: a decode-only one's goes to the chooser, unless
        the nodes with work changed while it ran (another node's step shared the cores it was sized for: a sample
        of neither count, and a probe that kept it could pick the slower one for the whole hold)."""
        if self._step is not None:
            fewer, more, threads, busy = self._step
            if self.num_busy() == busy:
                self.chooser.record(fewer, more, threads, seconds)
            else:
                self.num_mixed_steps += 1
            self._step = None

    def close(self) -> None:
        """Unmark this node and unmap the table (again: nothing)."""
        if not self._map.closed:
            self.set_busy(False)
            self._map.close()
