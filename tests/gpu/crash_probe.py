"""Which decode configuration crashes on a device: one config per process (an illegal access ends the context).
Usage: python3 tests/gpu/crash_probe.py MODEL BATCH CONTEXT EAGER(0|1) [DEVICE]"""
import sys
import traceback

from kvmesh import LLM, SamplingParams
from kvmesh.bench.model import kv_blocks_for

model, batch, context, eager = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
device = sys.argv[5] if len(sys.argv) > 5 else "cuda"
llm = LLM(model, device=device, dtype="bfloat16" if device == "cuda" else "float32",
          num_kv_blocks=kv_blocks_for(max(16384, batch * (context + 64 + 16))), max_num_seqs=max(batch, 16),
          max_num_batched_tokens=16384, enforce_eager=eager, progress=False)
prompts = [[(i * 31 + j) % 1000 + 5 for j in range(context)] for i in range(batch)]
for phase, n in (("prefill+1", 1), ("decode 4", 4)):
    try:
        llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), use_tqdm=False)
        print(f"OK {model} batch={batch} ctx={context} eager={eager} {phase}", flush=True)
    except Exception:
        print(f"FAIL {model} batch={batch} ctx={context} eager={eager} {phase}", flush=True)
        traceback.print_exc()
        sys.exit(1)
    prompts = [[t + 1 for t in p] for p in prompts]
