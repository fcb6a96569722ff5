#!/usr/bin/env bash
# Set up a SoftRoCE (rxe) RDMA device on a network interface, so Mooncake can use
# its rdma transport on machines without an RDMA NIC.
#   usage: sudo deploy/softroce.sh <interface> [rxe-name]     e.g. deploy/softroce.sh eth0 rxe0
# Needs: the rdma_rxe kernel module and the `rdma` tool (iproute2). Containers and
# VMs often lack the module or NETLINK_RDMA; this script says so instead of failing
# obscurely. kvmesh logs the RDMA devices it finds at start-up (/sys/class/infiniband).
set -euo pipefail
iface=${1:?usage: softroce.sh <interface> [rxe-name]}
name=${2:-rxe0}

die() { echo "softroce: $*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "run as root (loading modules and adding links needs it)"
ip link show "$iface" >/dev/null 2>&1 || die "no network interface '$iface' (see: ip -br link)"
command -v rdma >/dev/null || { apt-get install -y -q iproute2 rdma-core >/dev/null 2>&1 || true; }
command -v rdma >/dev/null || die "the 'rdma' tool is missing (install iproute2)"
if ! modprobe rdma_rxe 2>/dev/null; then
  [ -d /sys/module/rdma_rxe ] || die "this kernel has no rdma_rxe module ($(uname -r)); SoftRoCE cannot run here. \
kvmesh will use Mooncake's tcp transport."
fi
if [ -e "/sys/class/infiniband/$name" ]; then
  echo "softroce: $name already exists"
else
  rdma link add "$name" type rxe netdev "$iface" 2>/tmp/softroce.err || \
    die "rdma link add failed: $(cat /tmp/softroce.err) (no NETLINK_RDMA in this kernel or container?)"
fi
rdma link show "$name/1" || true
ls /sys/class/infiniband
echo "softroce: $name on $iface is ready; start kvmesh with transport=auto or rdma"
