"""``kvmesh bench model --tp N``: the same model at tensor-parallel size 1 and N, same run, same weights.

Prefill: one fresh prompt of ``prefill_len`` tokens to its first token. Decode: a batch of ``context``-token
prompts, greedy; decode tokens per second as ``kvmesh bench model`` counts them (the time of N tokens minus
the time of one, so the prompt cancels out). Rounds alternate between the two sizes and report medians.
``collective_share``: the part of a TP-N decode run rank 0 spent in collectives (all-reduces and the logits'
gather, issuing and waiting), what splitting costs on this machine. Both sizes must produce the same greedy
streams (reported, and the run fails when they differ). On the CPU both sizes use every core: size 1 one
process of all of them, size N each rank 1/N of them.
"""
from __future__ import annotations

import os
import statistics
import time

import torch

from kvmesh.bench.report import machine, print_table, write_json


def run(model: str, tp: int, json_path: str | None, *, batch: int = 8, context: int = 32, decode_tokens: int = 32,
        prefill_len: int = 512, repeat: int = 3, dtype: str = "auto", device: str = "cpu",
        load_format: str = "auto") -> dict:
    from kvmesh import LLM, SamplingParams

    kw = dict(dtype=dtype, device=device, num_kv_blocks=batch * (context + decode_tokens + 16) // 16 + 64,
              max_num_seqs=max(batch, 16), max_num_batched_tokens=max(2048, prefill_len), progress=False,
              load_format=load_format)
    _say(f"{model}: loading at tensor-parallel size 1 and {tp}")
    sizes = {1: LLM(model, **kw), tp: LLM(model, tensor_parallel_size=tp, **kw)}
    try:
        vocab = sizes[1].loaded.config.vocab_size
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, vocab, (context,), generator=gen).tolist() for _ in range(batch)]
        greedy = SamplingParams(max_tokens=decode_tokens, temperature=0.0, ignore_eos=True)
        one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        threads = {1: os.cpu_count() or 1, tp: max(1, (os.cpu_count() or 1) // tp)}  # every size on every core
        streams = {n: [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
                   for n, llm in sizes.items()}  # also the warm-up
        if streams[1] != streams[tp]:
            raise AssertionError(f"tensor-parallel size {tp} generated other tokens than size 1")
        times: dict[int, dict[str, list[float]]] = {n: {"prefill": [], "decode": [], "share": []} for n in sizes}
        for r in range(repeat):
            fresh = [[(t + 7 * (r + 1)) % vocab for t in p] for p in prompts]  # no prefix-cache hits
            long_prompt = torch.randint(0, vocab, (prefill_len,), generator=gen).tolist()
            for n, llm in sizes.items():
                _say(f"round {r + 1}/{repeat}: size {n}")
                torch.set_num_threads(threads[n])  # rank 0 shares this process with the size-1 engine
                times[n]["prefill"].append(_timed(lambda: llm.generate([long_prompt], one, use_tqdm=False)))
                group = llm.ranks.group if llm.ranks is not None else None
                before = group.collective_s if group is not None else 0.0
                whole = _timed(lambda: llm.generate(fresh, greedy, use_tqdm=False))
                share = (group.collective_s - before) / whole if group is not None else 0.0
                first = _timed(lambda: llm.generate([[(t + 1) % vocab for t in p] for p in fresh], one,
                                                    use_tqdm=False))
                times[n]["decode"].append(batch * (decode_tokens - 1) / max(whole - first, 1e-9))
                times[n]["share"].append(share)
        rows = {n: {"tensor_parallel_size": n, "threads_per_rank": threads[n],
                    "prefill_s": statistics.median(t["prefill"]),
                    "decode_tok_s": statistics.median(t["decode"]), "collective_share": statistics.median(t["share"])}
                for n, t in times.items()}
        res = {"machine": machine(), "model": model, "dtype": str(sizes[1].loaded.dtype).removeprefix("torch."),
               "device": device, "cpu_count": os.cpu_count(),
               "batch": batch, "context": context, "decode_tokens": decode_tokens, "prefill_tokens": prefill_len,
               "same_streams": True, "rows": list(rows.values()),
               "decode_ratio": rows[tp]["decode_tok_s"] / rows[1]["decode_tok_s"],
               "prefill_ratio": rows[1]["prefill_s"] / rows[tp]["prefill_s"]}
    finally:
        sizes[tp].close()
        torch.set_num_threads(os.cpu_count() or 1)
    write_json(json_path, res)
    print_table(f"{model} at tensor-parallel size 1 and {tp} ({res['dtype']}, {device}, {os.cpu_count()} CPUs)",
                ["size", "threads per rank", f"prefill {prefill_len} tokens", f"decode batch {batch}", "in collectives"],
                [[r["tensor_parallel_size"], r["threads_per_rank"], f"{r['prefill_s'] * 1e3:.0f} ms", f"{r['decode_tok_s']:.0f} tok/s",
                  f"{r['collective_share']:.0%}"] for r in res["rows"]])
    print(f"size {tp} / size 1: decode {res['decode_ratio']:.2f}x, prefill {res['prefill_ratio']:.2f}x (same greedy "
          f"streams)")
    return res


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _say(what: str) -> None:
    print(f"[bench model --tp {time.strftime('%H:%M:%S')}] {what}", flush=True)
