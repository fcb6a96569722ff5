"""Processes we start die with us: PR_SET_PDEATHSIG for children, SIGTERM as a clean stop.

``die_with_parent(sig)`` is a ``preexec_fn``: the child gets ``sig`` when the process
that started it dies, even by SIGKILL (Linux; elsewhere a no-op, and children fall
back on noticing their closed stdin). ``stop_on_sigterm()`` turns SIGTERM (systemd,
Kubernetes, container runtimes) into KeyboardInterrupt, so every command's Ctrl-C
cleanup runs for it too.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import signal
import sys
import threading

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGTERM):
    """A ``preexec_fn`` that asks the kernel to send ``sig`` to the child when its parent dies."""

    def arm() -> None:
        if sys.platform.startswith("linux"):
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)

    return arm


# Set by the first SIGTERM or SIGINT: this process is stopping (supervisors restart nothing from then on).
stopping = threading.Event()


def _interrupt(signum, frame) -> None:
    if stopping.is_set():
        return  # a second signal must not interrupt the cleanup the first one started
    stopping.set()
    raise KeyboardInterrupt


def sigterm_handler():
    """The handler ``stop_on_sigterm`` installs (a process can tell whether SIGTERM stops it cleanly)."""
    return _interrupt


def stop_on_sigterm() -> None:
    """SIGTERM stops the calling process like Ctrl-C (its cleanup runs, once: later signals are ignored);
    both set ``stopping``."""
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
