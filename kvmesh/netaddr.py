"""Bind and advertised addresses (docs/design.md §8).

Every listener binds one address (``--host``; ``0.0.0.0`` for all interfaces)
and publishes another that peers on other hosts can route to
(``--advertise-host``). The default advertised address is the bind address when
that is a concrete one, else the local address of the interface that routes
towards etcd (what other hosts see us as).
"""
from __future__ import annotations

import socket

WILDCARDS = frozenset({"", "0.0.0.0", "*", "::"})


def is_wildcard(host: str) -> bool:
    return host in WILDCARDS


def zmq_bind_host(host: str) -> str:
    """ZMQ spells "all interfaces" as ``*``."""
    return "*" if is_wildcard(host) else host


def route_source(target: str) -> str:
    """The local address the kernel would use to reach ``target`` ("host" or "host:port"); no packet is sent."""
    host = target.rsplit(":", 1)[0] if target.count(":") == 1 else target
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def advertise_address(bind_host: str, advertise_host: str | None, toward: str) -> str:
    """What to publish: ``advertise_host`` if given; the bind address if concrete; else the route to ``toward``."""
    if advertise_host:
        return advertise_host
    if not is_wildcard(bind_host):
        return bind_host
    return route_source(toward)


def port_taken(host: str, port: int) -> str | None:
    """None when a listener can bind ``host:port`` alone (port 0: any free port); else a one-line reason.

    Binds without ``SO_REUSEPORT``, so a port another server listens on counts as taken even where that
    server allowed sharing it (gRPC's default); sockets of closed connections (TIME_WAIT) do not count."""
    if port == 0:
        return None
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("" if is_wildcard(host) else host, port))
        except OSError as e:
            return f"{host}:{port} is taken ({e.strerror or e})"
    return None
