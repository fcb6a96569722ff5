"""``kvmesh bench model``: kvmesh's prefill and batched decode against transformers, same weights, same run.

transformers gets kvmesh's own weights (built from the same config), so the two differ only
in the implementation. Prefill: one prompt of N tokens, time to first-token logits. Decode:
a batch of prompts, greedy, tokens generated per second (transformers ``generate`` with its
KV cache; kvmesh's engine with the paged buffer), median of alternated runs on fresh prompts.
"""
from __future__ import annotations

import statistics
import time

import torch

from kvmesh.bench.report import machine, print_table, time_call, write_json


def _hf_twin(loaded):
    from transformers import AutoConfig, AutoModelForCausalLM

    from kvmesh.model.config import to_hf_dict

    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(**to_hf_dict(loaded.config)), dtype=loaded.dtype)
    hf.load_state_dict(loaded.model.hf_state_dict(), strict=True)
    return hf.eval()


def run(model: str, json_path: str | None, prefill_lens: tuple[int, ...] = (512, 2048), batch: int = 16,
        decode_tokens: int = 64, repeat: int = 3, dtype: str = "auto", device: str = "cpu") -> dict:
    from kvmesh import LLM, SamplingParams
    from kvmesh.device import device_name, synchronize
    from kvmesh.device import cpu_features

    torch.manual_seed(0)
    llm = LLM(model, dtype=dtype, device=device, num_kv_blocks=None, kv_cache_memory_gib=1.0,
              max_num_seqs=max(batch, 16), progress=False)
    dev = llm.loaded.device
    hf = _hf_twin(llm.loaded).to(dev)  # in the same dtype, on the same device
    vocab = llm.loaded.config.vocab_size
    res: dict = {"machine": machine(), "model": model, "dtype": str(llm.loaded.dtype).removeprefix("torch."),
                 "device": device_name(dev), "cpu_features": cpu_features(), "threads": torch.get_num_threads(),
                 "prefill": [], "decode": {}}
    one = SamplingParams(max_tokens=1, temperature=0.0)
    for n in prefill_lens:
        if n >= llm.engine.max_model_len:
            continue
        ids = torch.randint(0, vocab, (n,)).tolist()
        # Fresh prompts each round, so kvmesh's prefix cache cannot help.
        prompts = iter([[(t + r) % vocab for t in ids] for r in range(repeat + 2)])
        t_ours = time_call(lambda: llm.generate(next(prompts), one, use_tqdm=False), repeat)
        with torch.inference_mode():
            t_hf = time_call(lambda: (hf(torch.tensor([ids], device=dev)), synchronize(dev)), repeat)
        res["prefill"].append({"tokens": n, "kvmesh_s": t_ours, "transformers_s": t_hf, "speedup": t_hf / t_ours})
    prompt_ids = [torch.randint(0, vocab, (32,)).tolist() for _ in range(batch)]

    def ours(n: int, shift: int = 0) -> None:  # a new shift per call: fresh prompts, no prefix-cache hits
        llm.generate([[(t + n + shift) % vocab for t in p] for p in prompt_ids],
                     SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), use_tqdm=False)

    def theirs(n: int) -> None:
        with torch.inference_mode():
            hf.generate(torch.tensor(prompt_ids, device=dev),
                        attention_mask=torch.ones(batch, 32, dtype=torch.long, device=dev),
                        max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        synchronize(dev)

    ours(4), theirs(4)  # warm-up: allocator, oneDNN primitives for these shapes
    ours_s, theirs_s = [], []
    for r in range(repeat):  # alternated, median of each: a noisy neighbour hits both sides alike
        start = time.perf_counter()
        ours(decode_tokens, shift=1000 * (r + 1))
        ours_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        theirs(decode_tokens)
        theirs_s.append(time.perf_counter() - start)
    t_ours, t_hf = statistics.median(ours_s), statistics.median(theirs_s)
    total = batch * decode_tokens
    res["decode"] = {"batch": batch, "new_tokens": decode_tokens, "kvmesh_tok_s": total / t_ours,
                     "transformers_tok_s": total / t_hf, "speedup": t_hf / t_ours}
    rows = [[f"prefill {p['tokens']} tokens", f"{p['kvmesh_s'] * 1e3:.0f} ms", f"{p['transformers_s'] * 1e3:.0f} ms",
             f"{p['speedup']:.2f}x"] for p in res["prefill"]]
    d = res["decode"]
    rows.append([f"decode batch {batch} x {decode_tokens}", f"{d['kvmesh_tok_s']:.0f} tok/s",
                 f"{d['transformers_tok_s']:.0f} tok/s", f"{d['speedup']:.2f}x"])
    title = (f"{model} ({res['dtype']}, {res['device']}, {res['threads']} threads, "
             f"CPU: {' '.join(res['cpu_features']) or '?'})")
    print_table(title, ["work", "kvmesh", "transformers", "speedup"], rows)
    write_json(json_path, res)
    return res
