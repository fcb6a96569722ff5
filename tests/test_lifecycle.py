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
