"""Which decode configuration crashes on a device: one config per process (an illegal access ends the context).
Usage: python3 tests/gpu/crash_probe.py MODEL BATCH CONTEXT EAGER(0|1) [DEVICE] [hit]
``hit``: a 4,096-token prompt is computed first and the batch's first prompt is its first CONTEXT tokens (a whole
prompt found in the prefix cache, beside fresh ones: what ``bench model``'s decode rows met after its prefill rows)."""
import sys
import traceback

from kvmesh import LLM, SamplingParams
from kvmesh.bench.model import kv_blocks_for

model, batch, context, eager = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
device = sys.argv[5] if len(sys.argv) > 5 else "cuda"
hit = len(sys.argv) > 6 and sys.argv[6] == "hit"
llm = LLM(model, device=device, dtype="bfloat16" if device == "cuda" else "float32",
          num_kv_blocks=kv_blocks_for(max(16384, batch * (context + 64 + 16))), max_num_seqs=max(batch, 16),
          max_num_batched_tokens=16384, enforce_eager=eager, progress=False)
vocab = min(1000, llm.loaded.config.vocab_size - 10)
prompts = [[(i * 31 + j) % vocab + 5 for j in range(context)] for i in range(batch)]
phases = [("prefill+1", 1), ("decode 4", 4)]
if hit:
    long_prompt = [(j * 7) % vocab + 3 for j in range(min(4096, llm.engine.max_model_len - 8))]
    prompts[0] = long_prompt[:context]
    phases.insert(0, ("long prompt", 1))
for phase, n in phases:
    try:
        batch_prompts = [long_prompt] if phase == "long prompt" else prompts
        llm.generate(batch_prompts, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), use_tqdm=False)
        print(f"OK {model} batch={batch} ctx={context} eager={eager} hit={hit} {phase}", flush=True)
    except Exception:
        print(f"FAIL {model} batch={batch} ctx={context} eager={eager} hit={hit} {phase}", flush=True)
        traceback.print_exc()
        sys.exit(1)
    if phase != "long prompt":
        prompts = [[(t + 1) % vocab + 5 for t in p] for p in prompts]
