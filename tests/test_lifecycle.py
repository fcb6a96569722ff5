"""`kvmesh serve` leaves nothing behind (no node, no etcd, no temp dir) on SIGINT, SIGTERM or SIGKILL."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def alive(pid: int) -> bool:
    """Running (a zombie waiting for a parent that never reaps it counts as gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return not any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
    except OSError:
        return False


def children_of(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except (OSError, ValueError, IndexError):
                pass
    return out


def cmdline(pid: int) -> list[str]:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().decode().split("\0")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=["SIGINT", "SIGTERM", "SIGKILL"])
def test_serve_leaves_nothing_behind(sig):
    proc = subprocess.Popen([sys.executable, "-m", "kvmesh.cli", "serve", "--model", "tiny-llama",
                             "--dtype", "float32", "--grpc-port",
                             "0", "--http-port", "0"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    url = json.loads(proc.stdout.readline())["http"].removesuffix("/v1")
    with _NO_PROXY.open(url + "/ready", timeout=10) as r:
        processes = json.loads(r.read())["supervisor"]["nodes"]
    keeper = processes["etcd"]["pid"]
    data_dir = cmdline(keeper)[cmdline(keeper).index("--remove") + 1]
    pids = [p["pid"] for p in processes.values()] + children_of(keeper)  # nodes, the keeper, etcd itself
    assert len(pids) == 4 and all(alive(p) for p in pids) and os.path.isdir(data_dir)
    proc.send_signal(sig)
    code = proc.wait(timeout=60)
    assert code == (-signal.SIGKILL if sig == signal.SIGKILL else 0)
    deadline = time.monotonic() + 30
    while any(alive(p) for p in pids) or os.path.exists(data_dir):
        assert time.monotonic() < deadline, (f"left behind after {sig.name}: "
                                             f"{[p for p in pids if alive(p)]}, {os.path.exists(data_dir)}")
        time.sleep(0.1)


def test_one_sigterm_to_the_process_group_ends_serve_and_restarts_nothing(tmp_path):
    """Service managers signal the whole group: the nodes stop at the same moment as serve, and its supervisor
    must take that for a shutdown, not for deaths to repair."""
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "kvmesh.cli", "serve", "--model", "tiny-llama",
                                 "--dtype", "float32", "--grpc-port", "0", "--http-port", "0"],
                                stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True)
    url = json.loads(proc.stdout.readline())["http"].removesuffix("/v1")
    with _NO_PROXY.open(url + "/ready", timeout=10) as r:
        processes = json.loads(r.read())["supervisor"]["nodes"]
    pids = [p["pid"] for p in processes.values()] + children_of(processes["etcd"]["pid"])
    body = json.dumps({"prompt": "x" * 32, "max_tokens": 900, "stream": True}).encode()
    request = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    stream = _NO_PROXY.open(request, timeout=60)  # in flight when the signal comes: the front end drains it
    assert stream.readline().startswith(b"data:")
    os.killpg(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=30) == 0, "one SIGTERM to the group did not end serve within 30 s"
    deadline = time.monotonic() + 30
    while any(alive(p) for p in pids):
        assert time.monotonic() < deadline, f"left behind: {[p for p in pids if alive(p)]}"
        time.sleep(0.1)
    stream.close()
    text = log_path.read_text()
    assert "restarting" not in text and "restarted" not in text, text[-2000:]


def test_a_stopping_process_restarts_no_child():
    """The first SIGTERM / SIGINT sets ``lifecycle.stopping``; a child seen dead after that stays down."""
    from types import SimpleNamespace

    from kvmesh import lifecycle
    from kvmesh.cluster.supervisor import ProcessState, Supervisor

    started = []
    dead = SimpleNamespace(role="decode", proc=SimpleNamespace(poll=lambda: 0, returncode=0, pid=1))
    cluster = SimpleNamespace(nodes={"decode-0": dead}, supervises_etcd=False,
                              start_node=lambda role, name: started.append(name))
    lifecycle.stopping.set()
    try:
        supervisor = Supervisor(cluster, base_backoff_s=0.0).start()
        supervisor._thread.join(timeout=10)
        assert not supervisor._thread.is_alive(), "the supervisor kept watching a stopping process's children"
        supervisor._restart(supervisor._procs["decode-0"])  # a restart already due when the signal came
        assert started == [] and supervisor._procs["decode-0"].state is not ProcessState.FAILED
    finally:
        lifecycle.stopping.clear()
        supervisor.close()


def test_the_front_ends_take_a_signal_as_an_event_never_as_an_exception_inside_the_loop():
    """A SIGTERM while the router's event loop runs its own code (here: inside a critical section) raises nothing
    there: it sets the loop's stop event and ``lifecycle.stopping``, and the loop winds down intact; the
    process's own handlers come back afterwards."""
    import asyncio
    import threading

    from kvmesh import lifecycle
    from kvmesh.cluster.serve import _signals_set

    previous = {sig: signal.signal(sig, lifecycle.sigterm_handler()) for sig in (signal.SIGTERM, signal.SIGINT)}
    lock = threading.Lock()

    async def main() -> bool:
        stop = asyncio.Event()
        with _signals_set(asyncio.get_running_loop(), stop):
            with lock:
                os.kill(os.getpid(), signal.SIGTERM)
                sum(range(100_000))  # the handler runs here, between two bytecodes of the loop's thread
            await asyncio.wait_for(stop.wait(), 10)
            return stop.is_set()

    try:
        try:
            assert asyncio.run(main())
        except KeyboardInterrupt:
            pytest.fail("the signal raised KeyboardInterrupt inside the event loop")
        assert lifecycle.stopping.is_set() and not lock.locked()
        assert signal.getsignal(signal.SIGTERM) is lifecycle.sigterm_handler()
    finally:
        lifecycle.stopping.clear()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def test_supervisor_backoff_doubles_and_max_restarts_count_within_the_window():
    """The restart policy on its own clock: 0.5, 1, 2 s backoffs (capped), left down at the window's limit;
    restarts older than the window no longer count."""
    from collections import deque
    from types import SimpleNamespace

    from kvmesh.cluster.supervisor import ProcessState, Supervisor

    proc = SimpleNamespace(returncode=-9, pid=1)
    cluster = SimpleNamespace(nodes={"decode-0": SimpleNamespace(role="decode", proc=proc)}, supervises_etcd=False)
    sup = Supervisor(cluster, max_restarts=3, window_s=60.0, base_backoff_s=0.5, max_backoff_s=1.5)
    s = sup._procs["decode-0"]
    waits = []
    for now in (100.0, 101.0, 103.0):
        sup._died(s, now)
        assert s.state is ProcessState.RESTARTING and s.last_exit == -9
        waits.append(s.next_start - now)
        s.restarts.append(s.next_start)  # what _restart records
    assert waits == [0.5, 1.0, 1.5]  # doubling, capped at max_backoff_s
    sup._died(s, 106.0)  # a fourth death within 60 s of the first restart
    assert s.state is ProcessState.FAILED and sup.status()["degraded"]
    s.state, s.restarts = ProcessState.UP, deque([10.0, 20.0, 30.0])
    sup._died(s, 100.0)  # those restarts are older than the window: the count starts over
    assert s.state is ProcessState.RESTARTING and s.next_start == 100.5 and list(s.restarts) == []


_BENCH_PARENT = """
import sys, time
from kvmesh.bench.serve_bench import _process
from kvmesh.lifecycle import stop_on_sigterm
stop_on_sigterm()  # as `kvmesh bench serve` does
with _process([sys.executable, "-c", "import time; time.sleep(600)"]) as server:
    print(server.pid, flush=True)
    time.sleep(600)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_a_server_that_bench_serve_started_stops_with_it(sig):
    """`kvmesh bench serve` starts each target (`kvmesh serve`, llama-server) in a session of its own: a SIGTERM
    to the benchmark stops it on the way out, and a SIGKILL through the kernel (the child's parent-death signal)."""
    bench = subprocess.Popen([sys.executable, "-c", _BENCH_PARENT], stdout=subprocess.PIPE, text=True)
    server = int(bench.stdout.readline())
    try:
        assert alive(server)
        bench.send_signal(sig)
        bench.wait(timeout=60)
        deadline = time.monotonic() + 60
        while alive(server):
            assert time.monotonic() < deadline, "the server outlived the benchmark"
            time.sleep(0.05)
    finally:
        if alive(server):
            os.kill(server, signal.SIGKILL)
