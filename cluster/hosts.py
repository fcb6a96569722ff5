"""Simulated hosts on one machine: network namespaces joined by veth pairs on a Linux bridge.

    this machine (root namespace) ── bridge <prefix>br, <subnet>.1 ──┬── veth <prefix>v1 ── ns <prefix>-h1: eth0 <subnet>.11
                                                                      ├── veth <prefix>v2 ── ns <prefix>-h2: eth0 <subnet>.12
                                                                      └── ...

Each namespace has its own network stack and address, so processes in different
"hosts" only reach each other through those addresses, as on separate machines.
``link_mbit`` caps each host's link both ways with ``tc tbf`` (this kernel has no
netem: no added delay). ``link_down`` / ``link_up`` cut and restore one host.
Namespaces share the PID space and the filesystem. Needs root and ``ip``; ``can_create``
says why not otherwise. ``kvmesh hosts up|down|exec|status`` drives it by hand.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

STATE_DIR = Path(os.environ.get("KVMESH_HOSTS_DIR", "/run/kvmesh-hosts"))


class HostsError(RuntimeError):
    pass


@dataclass(frozen=True)
class Host:
    index: int
    namespace: str
    address: str
    veth: str  # the host-side end, on the bridge

    @property
    def exec_prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.namespace]


def can_create() -> tuple[bool, str]:
    """Whether namespaces can be made here, and if not, why (one clear line)."""
    if os.geteuid() != 0:
        return False, "simulated hosts need root (ip netns, veth, bridge)"
    if shutil.which("ip") is None:
        return False, "simulated hosts need iproute2's `ip` (apt-get install iproute2)"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if probe.returncode != 0:
        return False, f"`ip netns` does not work here: {probe.stderr.strip()}"
    return True, ""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    res = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and res.returncode != 0:
        raise HostsError(f"ip {' '.join(args)}: {res.stderr.strip()}")
    return res


class Hosts:
    def __init__(self, num_hosts: int, prefix: str = "kvm", subnet: str = "10.77.0", link_mbit: float | None = None):
        if not 1 <= num_hosts <= 200:
            raise HostsError("1..200 hosts")
        if len(prefix) > 8 or not prefix.isalnum():
            raise HostsError("prefix: up to 8 letters or digits (interface names are short)")
        self.prefix, self.subnet, self.link_mbit = prefix, subnet, link_mbit
        self.bridge = f"{prefix}br"
        self.gateway = f"{subnet}.1"  # this machine, on the bridge
        self.hosts = [Host(i, f"{prefix}-h{i}", f"{subnet}.{10 + i}", f"{prefix}v{i}") for i in range(1, num_hosts + 1)]

    def __getitem__(self, index: int) -> Host:
        return self.hosts[index - 1]

    def up(self) -> Hosts:
        """Create the bridge and every host (removing leftovers of the same prefix first)."""
        ok, why = can_create()
        if not ok:
            raise HostsError(why)
        self.down()
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for h in self.hosts:
                _ip("netns", "add", h.namespace)
                _ip("link", "add", h.veth, "type", "veth", "peer", "name", "eth0", "netns", h.namespace)
                _ip("link", "set", h.veth, "master", self.bridge)
                _ip("link", "set", h.veth, "up")
                _ip("-n", h.namespace, "addr", "add", f"{h.address}/24", "dev", "eth0")
                _ip("-n", h.namespace, "link", "set", "eth0", "up")
                _ip("-n", h.namespace, "link", "set", "lo", "up")
                _ip("-n", h.namespace, "route", "add", "default", "via", self.gateway)
                if self.link_mbit:
                    self.set_rate(h.index, self.link_mbit)
        except BaseException:
            self.down()
            raise
        self._save()
        return self

    def set_rate(self, index: int, mbit: float | None) -> None:
        """Cap host ``index``'s link at ``mbit`` both ways (None: uncapped)."""
        h = self[index]
        for ns_args, dev in (((), h.veth), (("-n", h.namespace), "eth0")):
            subprocess.run(["tc", *ns_args, "qdisc", "del", "dev", dev, "root"], capture_output=True)
            if mbit:
                burst = max(32_000, int(mbit * 1e6 / 8 / 250))  # at least 4 ms of traffic per bucket
                res = subprocess.run(["tc", *ns_args, "qdisc", "add", "dev", dev, "root", "tbf", "rate",
                                      f"{mbit}mbit", "burst", str(burst), "latency", "100ms"],
                                     capture_output=True, text=True)
                if res.returncode != 0:
                    raise HostsError(f"tc tbf on {dev}: {res.stderr.strip()}")

    def link_down(self, index: int) -> None:
        _ip("link", "set", self[index].veth, "down")

    def link_up(self, index: int) -> None:
        _ip("link", "set", self[index].veth, "up")

    def down(self) -> None:
        """Remove every namespace and the bridge of this prefix (processes inside are not killed)."""
        listed = _ip("netns", "list", check=False).stdout.split()
        for name in listed:
            if name.startswith(f"{self.prefix}-h"):
                _ip("netns", "delete", name, check=False)
        _ip("link", "delete", self.bridge, check=False)
        (STATE_DIR / f"{self.prefix}.json").unlink(missing_ok=True)

    def _save(self) -> None:
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        (STATE_DIR / f"{self.prefix}.json").write_text(json.dumps(
            {"num_hosts": len(self.hosts), "subnet": self.subnet, "link_mbit": self.link_mbit}))

    @classmethod
    def load(cls, prefix: str = "kvm") -> Hosts:
        path = STATE_DIR / f"{prefix}.json"
        if not path.exists():
            raise HostsError(f"no hosts with prefix {prefix!r} are up (kvmesh hosts up N)")
        state = json.loads(path.read_text())
        return cls(state["num_hosts"], prefix, state["subnet"], state["link_mbit"])

    def __enter__(self) -> Hosts:
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()


# ---- kvmesh hosts ------------------------------------------------------------------------------------------
def add_hosts_arguments(p: argparse.ArgumentParser) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--prefix", default="kvm", help="names of the namespaces and interfaces (sets coexist)")
    which = p.add_subparsers(dest="hosts_command", required=True)
    up = which.add_parser("up", help="create N hosts on a bridge", parents=[common])
    up.add_argument("num_hosts", type=int)
    up.add_argument("--link-gbit", type=float, default=None, help="cap every host's link (tc tbf)")
    up.add_argument("--subnet", default="10.77.0", help="the hosts get <subnet>.11, .12, ...; this machine .1")
    which.add_parser("down", help="remove them", parents=[common])
    which.add_parser("status", help="list them", parents=[common])
    ex = which.add_parser("exec", help="run a command inside host I: kvmesh hosts exec I -- CMD ...",
                          parents=[common])
    ex.add_argument("index", type=int)
    ex.add_argument("cmd", nargs=argparse.REMAINDER)
    p.set_defaults(func=run_hosts)


def run_hosts(args: argparse.Namespace) -> int:
    try:
        if args.hosts_command == "up":
            mbit = args.link_gbit * 1000 if args.link_gbit else None
            hosts = Hosts(args.num_hosts, args.prefix, args.subnet, mbit).up()
            for h in hosts.hosts:
                print(f"host {h.index}: namespace {h.namespace}, address {h.address}")
            print(f"this machine: {hosts.gateway} on {hosts.bridge}", file=sys.stderr)
        elif args.hosts_command == "down":
            Hosts(1, args.prefix).down()
        elif args.hosts_command == "status":
            for h in Hosts.load(args.prefix).hosts:
                print(f"host {h.index}: namespace {h.namespace}, address {h.address}")
        else:
            cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
            if not cmd:
                raise HostsError("kvmesh hosts exec I -- CMD ...")
            return subprocess.call([*Hosts.load(args.prefix)[args.index].exec_prefix, *cmd])
    except HostsError as e:
        print(f"kvmesh hosts: {e}", file=sys.stderr)
        return 2
    return 0
