"""The node fork server: a forked child gets the launcher's environment, pipes and descriptors, not the server's;
exit codes (signals included) reach the launcher; the server's end never leaves a child unwaited."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile

import pytest

from kvmesh.auth import TOKEN_ENV
from kvmesh.cluster.node_forkserver import ForkServer


@pytest.fixture(scope="module")
def server():
    server = ForkServer({**os.environ, "KVMESH_PROBE": "the server's"})
    yield server
    server.close()


def _start(server, code: int, env_extra: dict, pass_fds=(), argv_extra=()):
    env = {**os.environ, **env_extra}
    proc = server.spawn("tests.fork_probe", [str(code), *argv_extra], env, pass_fds, name="probe-node-with-a-long-name")
    return proc, json.loads(proc.stdout.readline())


def test_a_child_gets_the_launchers_environment_pipes_and_descriptors_and_default_signals(server):
    with tempfile.TemporaryFile() as f:
        f.write(b"hello")
        f.flush()
        fd = os.dup(f.fileno())
        try:
            proc, seen = _start(server, 3, {"KVMESH_PROBE": "the launcher's", TOKEN_ENV: "s3cret"},
                                pass_fds=(fd,), argv_extra=(str(fd),))
        finally:
            os.close(fd)
    assert seen["probe"] == "the launcher's" and seen["token"] == "s3cret"
    assert "s3cret" not in open(f"/proc/{seen['pid']}/cmdline").read()
    assert seen["passed"] == "hello", "a passed descriptor must keep its number in the child"
    assert seen["sigint_default"] and seen["sigterm_default"], "the server's ignored signals leaked into a child"
    assert seen["torch_loaded"], "the child did not start from the server's imports"
    assert seen["comm"] == "probe-node-with"[:15] and seen["pid"] == proc.pid
    proc.stdin.write("ping\n")
    assert proc.stdout.readline() == "echo ping\n"
    assert proc.poll() is None
    proc.stdin.close()
    assert proc.wait(timeout=30) == 3 and proc.returncode == 3


def test_a_signal_ends_a_child_with_popens_negative_code_and_a_timeout_raises(server):
    proc, _ = _start(server, 0, {})
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.2)
    proc.send_signal(signal.SIGSTOP)  # stopped, not ended
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.2)
    proc.kill()
    assert proc.wait(timeout=30) == -signal.SIGKILL
    proc.kill()  # an ended child: nothing to signal, no error


def test_children_outlive_a_killed_server_and_their_end_is_still_seen():
    server = ForkServer(dict(os.environ), preload=())
    proc, _ = _start(server, 0, {})
    server.proc.kill()
    server.proc.wait()
    assert proc.poll() is None, "the child must not depend on the server to keep running"
    proc.stdin.close()  # as a launcher stops a node
    assert proc.wait(timeout=30) is not None


def test_the_launcher_going_away_ends_the_server():
    code = ("import os, sys; from kvmesh.cluster.node_forkserver import ForkServer; "
            "s = ForkServer(dict(os.environ), preload=()); print(s.proc.pid, flush=True); os._exit(0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    pid = int(out.stdout.split()[0])
    deadline = __import__("time").monotonic() + 30
    while os.path.exists(f"/proc/{pid}") and "Z" not in open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]:
        assert __import__("time").monotonic() < deadline, "the fork server outlived its launcher"
        __import__("time").sleep(0.05)


def test_start_module_sends_stderr_where_asked_and_runs_under_a_prefix(tmp_path):
    """``prefix`` wraps the server (as ``ip netns exec HOST`` does), so its children run under it too; a child
    writes its errors to the descriptor given, not to the launcher's stderr."""
    from kvmesh.cluster.node_forkserver import ForkedProcess, start_module

    log = tmp_path / "err.log"
    with open(log, "w") as err:
        proc = start_module("tests.fork_probe", ["7", "-1", "boom"], dict(os.environ), stderr=err.fileno(),
                            prefix=("env", "KVMESH_PROBE=under the prefix"))
    assert isinstance(proc, ForkedProcess)
    seen = json.loads(proc.stdout.readline())
    assert seen["probe"] is None, "the launcher's environment, not the prefix's, reaches the child"
    assert seen["torch_loaded"]
    proc.stdin.close()
    assert proc.wait(timeout=30) == 7
    assert log.read_text() == "stderr boom\n"
    fresh = start_module("tests.fork_probe", ["0"], dict(os.environ), fork=False)
    assert isinstance(fresh, subprocess.Popen) and not json.loads(fresh.stdout.readline())["torch_loaded"]
    fresh.stdin.close()
    assert fresh.wait(timeout=30) == 0
