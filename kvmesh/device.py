"""Where a node computes: ``--device auto|cpu|cuda[:N]`` resolved once, with errors that say why.

``auto`` is the first visible CUDA device when torch sees one, else the CPU. Inside a Ray actor
that Ray gave GPUs, ``CUDA_VISIBLE_DEVICES`` holds exactly those, so ``auto`` (and ``cuda``) is
the GPU Ray assigned; an actor given none gets the CPU (``device_for_ray_actor``).
"""
from __future__ import annotations

import functools
import re

import torch

from kvmesh.cpu_info import cpu_features, cpu_flags  # noqa: F401 (their old home)

DEVICE_CHOICES = "auto, cpu, cuda or cuda:N"
_SPEC = re.compile(r"^(auto|cpu|cuda)(?::(\d+))?$")


class DeviceError(ValueError):
    """A --device that cannot be used on this machine (the message says why and what to pass)."""


def resolve_device(spec: str) -> torch.device:
    """``spec`` -> a usable torch device; raises DeviceError for a malformed or absent device."""
    match = _SPEC.match(spec.strip().lower())
    if match is None or (match.group(1) != "cuda" and match.group(2) is not None):
        raise DeviceError(f"--device {spec!r}: expected {DEVICE_CHOICES}")
    kind, index = match.group(1), match.group(2)
    if kind == "cpu":
        return torch.device("cpu")
    available = torch.cuda.is_available()
    if kind == "auto":
        return torch.device("cuda", 0) if available else torch.device("cpu")
    if not available:
        why = ("this torch build has no CUDA" if torch.version.cuda is None
               else "torch sees no CUDA device (driver, or CUDA_VISIBLE_DEVICES)")
        raise DeviceError(f"--device {spec}: {why}; use --device cpu or auto")
    number = int(index or 0)
    count = torch.cuda.device_count()
    if number >= count:
        raise DeviceError(f"--device {spec}: only {count} CUDA device(s) are visible (cuda:0..cuda:{count - 1})")
    return torch.device("cuda", number)


def device_for_ray_actor(spec: str, ray_gpu_ids: list) -> str:
    """The device spec a node actor uses: an explicit one as given; ``auto`` follows what Ray assigned.

    Ray sets ``CUDA_VISIBLE_DEVICES`` to an actor's GPUs, so its first is ``cuda:0`` in the actor;
    an actor Ray gave no GPU computes on the CPU even on a machine with GPUs (they belong to others).
    """
    if spec != "auto":
        return spec
    return "cuda:0" if ray_gpu_ids else "cpu"


def device_name(device: torch.device) -> str:
    """A human name for logs, node records and benchmark JSON ("cpu", "cuda:0 (NVIDIA H200)")."""
    if device.type == "cuda":
        return f"cuda:{device.index or 0} ({torch.cuda.get_device_name(device)})"
    return device.type


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (timing, handing memory to another engine); no-op on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
