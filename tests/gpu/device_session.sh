#!/usr/bin/env bash
# One lent device call in stages under one deadline (a session's device minutes are few and a fresh machine
# costs minutes to start): each stage "SECONDS NAME COMMAND..." of the file named first (one per line; # comments) runs with
# the lesser of its own seconds and what is left of $KVMESH_GPU_DEADLINE_S (default 560), its output in
# $OUT/NAME.log; a stage whose NAME starts with "if-failed:" runs only when the stage before it failed. Set-up
# as tests/gpu/device_run.sh's: pyproject's package mapping linked into kvmesh/, wheels from .whl/ installed.
set -uo pipefail
cd "$(dirname "$0")/../.."
start=$(date +%s)
deadline=${KVMESH_GPU_DEADLINE_S:-560}
out=${OUT:-/tmp/kvmesh-gpu-out}
mkdir -p "$out"
pkgs="kernels transfer metadata prefill_node decode_node cluster"
cleanup() { for pkg in $pkgs; do [ -L "kvmesh/$pkg" ] && rm "kvmesh/$pkg"; done; }
trap cleanup EXIT
for pkg in $pkgs; do [ -e "kvmesh/$pkg" ] || ln -s "../$pkg" "kvmesh/$pkg"; done
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 KVMESH_TRACEBACK=1
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/kvmesh-site .whl/*.whl || exit 2
  export PYTHONPATH="$PYTHONPATH:/tmp/kvmesh-site"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
last=0
while read -r seconds name cmd; do
  [[ -z "${seconds:-}" || $seconds == \#* ]] && continue
  if [[ $name == if-failed:* ]]; then
    [ "$last" -eq 0 ] && { echo "== $name skipped (the stage before passed)"; continue; }
    name=${name#if-failed:}
  fi
  left=$((deadline - ($(date +%s) - start) - 5))
  limit=$(( seconds < left ? seconds : left ))
  if [ "$limit" -lt 20 ]; then echo "== $name skipped: ${left}s left"; continue; fi
  echo "== $name (limit ${limit}s, $(( $(date +%s) - start ))s in)"
  t0=$(date +%s)
  timeout "$limit" bash -c "$cmd" > "$out/$name.log" 2>&1
  last=$?
  echo "== $name rc=$last in $(( $(date +%s) - t0 ))s"
  tail -n 25 "$out/$name.log"
done < "${1:?usage: device_session.sh STAGES_FILE}"
