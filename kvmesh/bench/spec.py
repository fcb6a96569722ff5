"""``kvmesh bench spec``: decode tokens/s with and without speculative decoding, two workloads.

- copy: the prompt holds a document and asks for it again (an edit, a quote, a summary that
  reuses its sentences): prompt lookup finds long runs of the output in the prompt;
- chat: open questions whose answers repeat little of the prompt.

Each request runs alone (speculation pays off at small batch sizes, where decode is bound by
reading the weights), greedy, the same prompts with and without speculation on two engines
over the same weights. The run reports whether the tokens were identical: in float32 (the
default here) they are; in bfloat16 the verification forward (k+1 query rows) rounds
differently from a one-row decode, so a near-tie between two tokens can break the other way.
"""
from __future__ import annotations

import time

from kvmesh.bench.report import machine, print_table, write_json

DOCUMENT = (
    "kvmesh is a prefill/decode disaggregated serving cluster. Prefill nodes compute the KV cache of a "
    "prompt and push its blocks to decode nodes, which stream tokens back to the router. A global pool, "
    "keyed by chained block hashes, lets any node reuse a prefix that another node holds. Requests are "
    "routed to the node that holds the longest prefix of their prompt, so most of them start at once."
)
COPY_PROMPTS = [
    f"Document:\n{DOCUMENT}\n\nRepeat the document above word for word.\nDocument:\n",
    f"Text:\n{DOCUMENT}\n\nFix any typos in the text above and write it out again in full.\nText:\n",
    f"Here is a paragraph:\n{DOCUMENT}\n\nQuote the paragraph exactly:\n\"",
]
CHAT_PROMPTS = [
    "Question: What are three good habits for staying healthy?\nAnswer:",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.\n",
    "Question: Why is the sky blue? Explain it to a ten-year-old.\nAnswer:",
]


def _decode_rate(llm, prompts: list[str], max_tokens: int) -> tuple[float, list[list[int]]]:
    from kvmesh import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    tokens, seconds, outputs = 0, 0.0, []
    for prompt in prompts:
        llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)  # prompt cached
        start = time.perf_counter()
        out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        seconds += time.perf_counter() - start
        tokens += len(out.token_ids)
        outputs.append(out.token_ids)
    return tokens / seconds, outputs


def run(json_path: str | None, model: str = "smollm2-135m", method: str = "ngram", max_tokens: int = 96,
        num_speculative_tokens: int = 4, dtype: str = "float32") -> dict:
    from kvmesh import LLM
    from kvmesh.engine.spec_decode.speculator import SpeculativeConfig

    plain = LLM(model, dtype=dtype, num_kv_blocks=512, progress=False)
    spec = LLM(model, dtype=dtype, num_kv_blocks=512, progress=False,
               speculative=SpeculativeConfig(method=method, num_speculative_tokens=num_speculative_tokens))
    res: dict = {"machine": machine(), "model": model, "dtype": str(plain.loaded.dtype).removeprefix("torch."),
                 "method": method, "num_speculative_tokens": num_speculative_tokens, "max_tokens": max_tokens,
                 "workloads": {}}
    rows = []
    for name, prompts in (("copy", COPY_PROMPTS), ("chat", CHAT_PROMPTS)):
        _decode_rate(plain, prompts[:1], 4), _decode_rate(spec, prompts[:1], 4)  # warm-up
        before = spec.engine.speculator.stats()
        base_rate, base_out = _decode_rate(plain, prompts, max_tokens)
        spec_rate, spec_out = _decode_rate(spec, prompts, max_tokens)
        after = spec.engine.speculator.stats()
        drafted = after["spec_draft_tokens"] - before["spec_draft_tokens"]
        accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
        w = res["workloads"][name] = {"tokens_per_s": base_rate, "spec_tokens_per_s": spec_rate,
                                      "speedup": spec_rate / base_rate,
                                      "acceptance": accepted / drafted if drafted else 0.0,
                                      "drafted": drafted, "accepted": accepted,
                                      "identical_output": spec_out == base_out}
        rows.append([name, f"{base_rate:.1f}", f"{spec_rate:.1f}", f"{w['speedup']:.2f}x",
                     f"{w['acceptance']:.2f}", f"{drafted}", "yes" if w["identical_output"] else "NO"])
    print_table(f"speculative decoding ({method}, k={num_speculative_tokens}), {model} {res['dtype']}, one request "
                "at a time, greedy", ["workload", "tok/s plain", "tok/s speculative", "speedup", "acceptance",
                                      "guesses verified", "same tokens"], rows)
    write_json(json_path, res)
    return res
