#!/usr/bin/env bash
# The GPU suite on a CUDA machine that has torch, Triton and pytest but no network (nothing is installed):
# links pyproject.toml's package-dir mapping into kvmesh/ for the run (removed on exit), then runs pytest on
# tests/gpu and tests/test_kernels.py (whose DEVICE is cuda there). Extra arguments go to pytest.
set -uo pipefail
cd "$(dirname "$0")/../.."
pkgs="kernels transfer metadata prefill_node decode_node cluster"
cleanup() { for pkg in $pkgs; do [ -L "kvmesh/$pkg" ] && rm "kvmesh/$pkg"; done; }
trap cleanup EXIT
for pkg in $pkgs; do [ -e "kvmesh/$pkg" ] || ln -s "../$pkg" "kvmesh/$pkg"; done
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/gpu tests/test_kernels.py "$@"
