"""Typed errors raised to users of kvmesh.

Every error a caller can act on has its own class, so the CLI, the router and
tests can tell "your input is wrong" from "the system is broken".
"""
from __future__ import annotations


class KvmeshError(Exception):
    """Base class of every error kvmesh raises on purpose."""


class InvalidRequestError(KvmeshError, ValueError):
    """The caller's input is wrong (bad sampling parameters, prompt too long, ...)."""


class UnknownModelError(KvmeshError, ValueError):
    """A model name that is neither a preset nor a readable local path."""


class UnsupportedModelError(KvmeshError, ValueError):
    """A model file or config whose architecture kvmesh does not implement."""


class OutOfBlocksError(KvmeshError, RuntimeError):
    """The KV block pool cannot hold what was asked of it."""
