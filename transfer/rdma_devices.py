"""Which RDMA devices this machine has (physical HCAs or SoftRoCE ``rxe``), and the protocol to use."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import NamedTuple

log = logging.getLogger("kvmesh.transfer")
SYSFS_INFINIBAND = Path("/sys/class/infiniband")


class TransportChoice(NamedTuple):
    protocol: str  # what will really be used: "rdma" or "tcp"
    requested: str
    devices: list[str]
    reason: str


def rdma_devices(sysfs: Path = SYSFS_INFINIBAND) -> list[str]:
    """Names of RDMA devices the kernel exposes (``mlx5_0``, ``rxe0``, ...)."""
    try:
        return sorted(p.name for p in sysfs.iterdir())
    except OSError:
        return []


def choose_transport(requested: str = "auto", sysfs: Path = SYSFS_INFINIBAND) -> TransportChoice:
    """Resolve "auto" / "rdma" / "tcp" to what will actually run, saying why.

    Mooncake asked for rdma without a device silently uses TCP; here that case is
    resolved to "tcp" up front and the reason is logged and reported.
    """
    if requested not in ("auto", "rdma", "tcp"):
        raise ValueError(f"transport {requested!r}: expected auto, rdma or tcp")
    devices = rdma_devices(sysfs)
    if requested == "tcp":
        return TransportChoice("tcp", requested, devices, "tcp requested")
    if devices:
        return TransportChoice("rdma", requested, devices, f"RDMA devices found: {', '.join(devices)}")
    reason = "no RDMA device found (no /sys/class/infiniband entries; see deploy/softroce.sh): using tcp"
    if requested == "rdma":
        log.warning("rdma requested but %s", reason)
    else:
        log.info(reason)
    return TransportChoice("tcp", requested, devices, reason)
