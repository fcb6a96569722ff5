"""Supervisor: keeps a LocalCluster's processes (nodes and the embedded etcd) running.

A process that dies is restarted after a backoff that doubles with each restart
inside the window (``base_backoff_s`` .. ``max_backoff_s``); past
``max_restarts`` restarts within ``window_s`` it is left down (FAILED) and the
cluster serves degraded. ``status()`` says so, for /ready, /metrics and
ClusterStatus. A restarted node registers again under its node id (new
endpoints), the router follows the directory; a restarted etcd keeps its ports
and data, and nodes re-register and re-publish when their leases are renewed.

    UP ──process exits──> RESTARTING ──backoff, start ok──> UP
                              │  └──start failed──> RESTARTING (next backoff)
                              └──too many restarts in the window──> FAILED
"""
from __future__ import annotations

import enum
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from kvmesh import lifecycle
from kvmesh.cluster.local_launcher import LocalCluster

log = logging.getLogger("kvmesh.supervisor")


class ProcessState(enum.Enum):
    UP = "up"
    RESTARTING = "restarting"
    FAILED = "failed"


@dataclass(slots=True)
class _Supervised:
    name: str
    role: str  # "prefill" | "decode" | "etcd"
    state: ProcessState = ProcessState.UP
    restarts: deque = field(default_factory=deque)  # monotonic times of recent restarts
    num_restarts: int = 0
    next_start: float = 0.0
    last_exit: int | None = None


class Supervisor:
    def __init__(self, cluster: LocalCluster, max_restarts: int = 5, window_s: float = 60.0,
                 base_backoff_s: float = 0.5, max_backoff_s: float = 10.0):
        self.cluster = cluster
        self.max_restarts, self.window_s = max_restarts, window_s
        self.base_backoff_s, self.max_backoff_s = base_backoff_s, max_backoff_s
        self._procs = {n: _Supervised(n, p.role) for n, p in cluster.nodes.items()}
        if cluster.supervises_etcd:
            self._procs["etcd"] = _Supervised("etcd", "etcd")
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvmesh-supervisor", daemon=True)

    def start(self) -> Supervisor:
        self._thread.start()
        return self

    # ---- the loop ------------------------------------------------------------------------------------
    def _alive(self, s: _Supervised) -> bool:
        if s.role == "etcd":
            return self.cluster.etcd_running
        return self.cluster.nodes[s.name].proc.poll() is None

    def _stopping(self) -> bool:
        """Closing, or this process got SIGTERM / SIGINT (its children likely got it too): restart nothing."""
        return self._stop.is_set() or lifecycle.stopping.is_set()

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            if lifecycle.stopping.is_set():
                return
            now = time.monotonic()
            for s in list(self._procs.values()):
                if s.state is ProcessState.UP and not self._alive(s):
                    self._died(s, now)
                elif s.state is ProcessState.RESTARTING and now >= s.next_start:
                    self._restart(s)

    def _died(self, s: _Supervised, now: float) -> None:
        s.last_exit = None if s.role == "etcd" else self.cluster.nodes[s.name].proc.returncode
        while s.restarts and now - s.restarts[0] > self.window_s:
            s.restarts.popleft()
        with self._lock:
            if len(s.restarts) >= self.max_restarts:
                s.state = ProcessState.FAILED
                log.error("%s exited (%s) %d times in %.0f s: left down, the cluster serves degraded", s.name,
                          s.last_exit, len(s.restarts) + 1, self.window_s)
                return
            backoff = min(self.max_backoff_s, self.base_backoff_s * 2 ** len(s.restarts))
            s.state, s.next_start = ProcessState.RESTARTING, now + backoff
        log.warning("%s exited (%s); restarting in %.1f s", s.name, s.last_exit, backoff)

    def _restart(self, s: _Supervised) -> None:
        if self._stopping():
            return
        s.restarts.append(time.monotonic())
        try:
            if s.role == "etcd":
                self.cluster.restart_etcd()
            else:
                self.cluster.start_node(s.role, s.name)  # waits until it is registered
        except Exception as e:  # it died again during start-up: the next backoff applies
            log.warning("restarting %s failed: %s", s.name, e)
            self._died(s, time.monotonic())
            return
        with self._lock:
            s.state = ProcessState.UP
            s.num_restarts += 1
        log.warning("%s restarted", s.name)

    # ---- what the front ends show --------------------------------------------------------------------
    def status(self) -> dict:
        """{"nodes": {name: {role, state, restarts, pid, last_exit}}, "degraded": bool}."""
        with self._lock:
            procs = {n: {"role": s.role, "state": s.state.value, "restarts": s.num_restarts,
                         "last_exit": s.last_exit,
                         "pid": (self.cluster.nodes[n].proc.pid if s.role != "etcd" else self.cluster.etcd_pid)}
                     for n, s in self._procs.items()}
        return {"nodes": procs, "degraded": any(p["state"] != "up" for p in procs.values())}

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=120)  # a restart in progress finishes first

    def __enter__(self) -> Supervisor:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()  # before the cluster closes: stopping nodes must not look like deaths
