"""Node processes forked from one process that has already imported the model stack.

A node process spends most of its start-up CPU importing torch and the engine, and a cluster of N nodes on one
machine paid that N times (and again at every restart), all at once on the same cores. A ``ForkServer`` is a
process started once (per launcher and environment) that imports all of it, then forks every node from itself:
the child starts with everything imported and runs ``kvmesh.cli.main(argv)`` with the environment, stdin and
stdout pipes and inherited descriptors the launcher gave it, as ``python -m kvmesh.cli`` would.

    server = fork_server(env)                                  # shared by every LocalCluster of this process
    proc = server.spawn("kvmesh.cli", argv, env, pass_fds)     # a ForkedProcess: the part of Popen launchers use

Safety of fork: the server starts no Python thread, touches no device (CUDA stays uninitialised: every child
initialises its own) and ignores SIGINT and SIGTERM (its life is the launcher's socket: EOF ends it); each child
gets default handlers back, a fresh numpy seed (``random`` reseeds itself at fork) and its node id as its name
in ``ps -o comm``. The environment (the cluster token among it) travels over the private socket pair, never argv.
"""
from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import gc
import json
import logging
import os
import runpy
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings

logger = logging.getLogger(__name__)
PRELOAD = ("torch", "kvmesh.cli", "kvmesh.cluster.node_main", "kvmesh.node.runtime", "kvmesh.cluster.serving_node")
_MAX_FDS = 16
_MAX_MESSAGE = 1 << 20
_PR_SET_NAME = 15


class ForkServerError(RuntimeError):
    """The fork server could not start or died: the launcher starts nodes as plain processes instead."""


# --- server side: runs as ``python -m kvmesh.cluster.node_forkserver --fd N`` ---------------------------------


class _Child:
    """What a forked child runs once it has left the server's loop: ``python -m module argv``."""

    def __init__(self, module: str, argv: list[str]):
        self.module, self.argv = module, argv


def _send(sock: socket.socket, message: dict) -> None:
    sock.send(json.dumps(message).encode())


def _reply(sock: socket.socket, message: dict) -> bool:
    """Send to the launcher; False once it is gone (the server then ends quietly)."""
    try:
        _send(sock, message)
    except OSError:
        return False
    return True


def serve(sock: socket.socket, preload: tuple[str, ...] = PRELOAD) -> _Child | None:
    """Fork a child per request until the launcher's end closes; returns only in a child (its job) or at EOF."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    for module in preload:
        __import__(module)
    torch = sys.modules.get("torch")
    if (torch is not None and torch.cuda.is_initialized()) or threading.active_count() != 1:
        raise ForkServerError("importing the model stack started a device or a thread: forking it is unsafe")
    gc.collect()
    gc.freeze()  # the imported objects stay out of every child's collections (and unwritten: shared pages)
    _send(sock, {"ready": os.getpid()})
    selector = selectors.DefaultSelector()
    selector.register(sock, selectors.EVENT_READ)
    pidfds: dict[int, int] = {}  # pidfd -> child pid
    while True:
        for key, _ in selector.select():
            if key.fileobj is not sock:
                pid = pidfds.pop(key.fd)
                selector.unregister(key.fd)
                os.close(key.fd)
                _, status = os.waitpid(pid, 0)
                if not _reply(sock, {"pid": pid, "returncode": os.waitstatus_to_exitcode(status)}):
                    return None
                continue
            try:
                message, fds, _, _ = socket.recv_fds(sock, _MAX_MESSAGE, _MAX_FDS)
            except OSError:
                message = b""
            if not message:
                return None  # the launcher is gone: its children stop on their closed stdin
            request = json.loads(message)
            try:
                pid = os.fork()
            except OSError as e:  # no process to be had now: the launcher hears why
                for fd in fds:
                    os.close(fd)
                if not _reply(sock, {"seq": request["seq"], "error": f"fork: {e}"}):
                    return None
                continue
            if pid == 0:
                selector.close()
                sock.close()
                for pidfd in pidfds:
                    os.close(pidfd)
                return _become_child(request, fds)
            for fd in fds:
                os.close(fd)
            pidfd = os.pidfd_open(pid)
            pidfds[pidfd] = pid
            selector.register(pidfd, selectors.EVENT_READ)
            if not _reply(sock, {"seq": request["seq"], "pid": pid}):
                return None


def _become_child(request: dict, fds: list[int]) -> _Child:
    """In the fork: the received descriptors on their numbers (stdin, stdout, stderr if sent, then
    ``pass_fds``), the requested environment, default signal handlers."""
    targets = [0, 1, *([2] if request["stderr"] else []), *request["pass_fds"]]
    high = [_dup_above(fd, 1024) for fd in fds]  # off every target number before any lands
    for fd in fds:
        os.close(fd)
    for fd, target in zip(high, targets):
        os.dup2(fd, target)
        os.close(fd)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.environ.clear()
    os.environ.update(request["env"])
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    name = request.get("name", "")[:15].encode()
    if name and sys.platform.startswith("linux"):
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").prctl(_PR_SET_NAME, name, 0, 0, 0)
    return _Child(request["module"], request["argv"])


def _dup_above(fd: int, lowest: int) -> int:
    import fcntl

    return fcntl.fcntl(fd, fcntl.F_DUPFD, lowest)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="kvmesh's node fork server (started by launchers, not by hand)")
    parser.add_argument("--fd", type=int, required=True, help="this end of the launcher's socket pair")
    parser.add_argument("--preload", default=",".join(PRELOAD), help="modules to import before forking")
    args = parser.parse_args(argv)
    child = serve(socket.socket(fileno=args.fd), tuple(m for m in args.preload.split(",") if m))
    if child is None:
        return 0
    sys.argv = [child.module, *child.argv]
    # Preloaded, the module runs again as __main__ (as `python -m` runs a module something imported first)
    warnings.filterwarnings("ignore", message=".*found in sys.modules after import of package", category=RuntimeWarning)
    runpy.run_module(child.module, run_name="__main__", alter_sys=True)  # its own sys.exit ends the child
    return 0


# --- launcher side -------------------------------------------------------------------------------------------


class ForkedProcess:
    """A node forked by the server: the part of ``subprocess.Popen`` that launchers and tests use (``pid``,
    ``stdin``, ``stdout``, ``returncode``, ``poll``, ``wait``, ``send_signal``, ``terminate``, ``kill``).

    Exit codes come from the server, which reaps the child (negative: the signal that ended it, as Popen's).
    Signals go through a pidfd, so a pid the kernel reused after the child ended is never signalled."""

    def __init__(self, server: ForkServer, pid: int, stdin, stdout, argv: list[str]):
        self._server, self.pid, self.stdin, self.stdout, self.args = server, pid, stdin, stdout, argv
        try:
            self._pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            self._pidfd = -1  # ended already; the server's notice brings its code

    @property
    def returncode(self) -> int | None:
        return self._server.returncode(self.pid, self._pidfd)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        code = self._server.wait(self.pid, self._pidfd, timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return code

    def send_signal(self, sig: int) -> None:
        if self.returncode is None and self._pidfd >= 0:
            try:
                signal.pidfd_send_signal(self._pidfd, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __del__(self) -> None:
        if getattr(self, "_pidfd", -1) >= 0:
            os.close(self._pidfd)
            self._pidfd = -1


class ForkServer:
    """The launcher's handle on one server process: ``spawn`` forks a node from it; a reader thread records
    the children's pids and exit codes. ``close()`` (or this process's exit) ends the server, never its
    children (they stop when their stdin closes, as plain node processes do)."""

    def __init__(self, env: dict[str, str], prefix: tuple[str, ...] = (), preload: tuple[str, ...] = PRELOAD,
                 start_timeout_s: float = 120.0):
        """``prefix``: the command the server runs under (``ip netns exec HOST``: its children live there too)."""
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.proc = subprocess.Popen([*prefix, sys.executable, "-m", "kvmesh.cluster.node_forkserver", "--fd",
                                      str(theirs.fileno()), "--preload", ",".join(preload)],
                                     pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, env=env)
        theirs.close()
        self._sock = mine
        self._cond = threading.Condition()
        self._seq = 0
        self._pids: dict[int, int | str] = {}  # request seq -> pid, or why the fork failed
        self._codes: dict[int, int] = {}  # pid -> exit code
        self._alive = True
        mine.settimeout(start_timeout_s)
        try:
            ready = mine.recv(_MAX_MESSAGE)
        except OSError as e:
            self.close()
            raise ForkServerError(f"the node fork server did not start: {e}") from None
        if not ready:
            raise ForkServerError(f"the node fork server exited during start-up (exit {self.proc.wait()})")
        mine.settimeout(None)
        threading.Thread(target=self._read, name="fork-server-reader", daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                message = self._sock.recv(_MAX_MESSAGE)
            except OSError:
                message = b""
            with self._cond:
                if not message:
                    self._alive = False
                    self._cond.notify_all()
                    return
                record = json.loads(message)
                if "seq" in record:
                    self._pids[record["seq"]] = record.get("pid", record.get("error", "no pid"))
                    self._codes.pop(record.get("pid"), None)  # a reused pid: its earlier owner's code came first
                else:
                    self._codes[record["pid"]] = record["returncode"]
                self._cond.notify_all()

    @property
    def alive(self) -> bool:
        return self._alive and self.proc.poll() is None

    def spawn(self, module: str, argv: list[str], env: dict[str, str], pass_fds: tuple[int, ...] = (),
              name: str = "", stderr: int | None = None, timeout_s: float = 60.0) -> ForkedProcess:
        """Fork ``python -m <module> <argv>`` with ``env`` and the descriptors ``pass_fds`` (on the same numbers);
        its stdin and stdout are pipes to this process (text, line-buffered stdin), as ``Popen(stdin=PIPE,
        stdout=PIPE)``; its stderr the server's (this process's when started), or the descriptor ``stderr``."""
        stdin_r, stdin_w = os.pipe()
        stdout_r, stdout_w = os.pipe()
        try:
            with self._cond:
                self._seq += 1
                seq = self._seq
                request = {"seq": seq, "module": module, "argv": argv, "env": env, "pass_fds": list(pass_fds),
                           "name": name, "stderr": stderr is not None}
                fds = [stdin_r, stdout_w, *([stderr] if stderr is not None else []), *pass_fds]
                try:
                    socket.send_fds(self._sock, [json.dumps(request).encode()], fds)
                except OSError as e:
                    raise ForkServerError(f"the node fork server is gone: {e}") from None
                deadline = time.monotonic() + timeout_s
                while seq not in self._pids:
                    if not self._alive or not self._cond.wait(timeout=max(0.0, deadline - time.monotonic())):
                        raise ForkServerError("the node fork server did not fork the node")
                pid = self._pids.pop(seq)
                if isinstance(pid, str):
                    raise ForkServerError(f"the node fork server could not fork: {pid}")
        except BaseException:
            os.close(stdin_w)
            os.close(stdout_r)
            raise
        finally:
            os.close(stdin_r)
            os.close(stdout_w)
        return ForkedProcess(self, pid, open(stdin_w, "w", buffering=1), open(stdout_r), [module, *argv])

    def returncode(self, pid: int, pidfd: int) -> int | None:
        with self._cond:
            if pid in self._codes:
                return self._codes[pid]
            if not self._alive and _ended(pidfd):
                return -signal.SIGKILL  # the server died before it could say; the child is gone all the same
            return None

    def wait(self, pid: int, pidfd: int, timeout: float | None) -> int | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while (code := self.returncode(pid, pidfd)) is None:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return None
                self._cond.wait(timeout=0.5 if remaining is None else min(0.5, remaining))
            return code

    def close(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the reader's recv (a close alone would not) and ends the server
        except OSError:
            pass
        self._sock.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _ended(pidfd: int) -> bool:
    import select

    return pidfd < 0 or bool(select.select([pidfd], [], [], 0)[0])


_servers: dict[tuple, ForkServer] = {}
_servers_lock = threading.Lock()


def fork_server(env: dict[str, str], ignore: tuple[str, ...] = (), prefix: tuple[str, ...] = ()) -> ForkServer:
    """The running server for this environment and ``prefix`` (``ignore``: variables every child gets its own
    value of, such as the cluster token), started on first use. Variables libraries read once at import
    (thread pools, caches) differ between environments, so each environment has a server of its own."""
    key = (sys.executable, tuple(prefix), tuple(sorted((k, v) for k, v in env.items() if k not in ignore)))
    with _servers_lock:
        server = _servers.get(key)
        if server is None or not server.alive:
            server = _servers[key] = ForkServer({k: v for k, v in env.items() if k not in ignore}, tuple(prefix))
        return server


def start_module(module: str, argv: list[str], env: dict[str, str], secret_env: tuple[str, ...] = (),
                 pass_fds: tuple[int, ...] = (), stderr: int | None = None, prefix: tuple[str, ...] = (),
                 name: str = "", fork: bool = True) -> subprocess.Popen | ForkedProcess:
    """``python -m module argv`` with text pipes on stdin and stdout: forked from this environment's server
    (``fork``), else (or when no server can start) a fresh process, as ``Popen``. ``secret_env``: variables
    kept out of the server's key and environment (each child gets its own)."""
    if fork:
        devnull = os.open(os.devnull, os.O_WRONLY) if stderr == subprocess.DEVNULL else None
        try:
            return fork_server(env, secret_env, prefix).spawn(module, argv, env, pass_fds, name,
                                                              stderr if devnull is None else devnull)
        except ForkServerError as e:
            logger.warning("%s; starting %s as a fresh process", e, module)
        finally:
            if devnull is not None:
                os.close(devnull)
    return subprocess.Popen([*prefix, sys.executable, "-m", module, *argv], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=stderr, text=True, env=env, pass_fds=pass_fds)


if __name__ == "__main__":
    sys.exit(main())
