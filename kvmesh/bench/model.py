"""``kvmesh bench model``: kvmesh's prefill and batched decode against transformers, same weights, same run.

transformers gets kvmesh's own weights (built from the same config), so the two differ only in the
implementation. Prefill: one prompt of N tokens, time to first-token logits (transformers: one
forward, its SDPA attention). Decode, per batch size: a batch of ``context``-token prompts, greedy;
decode tokens per second are ``batch * (N - 1)`` over the time of generating N tokens minus the time
of generating one (the prefill cancels out, so long contexts measure decoding only). Baselines:
transformers ``generate`` with its default cache and, on request (default on CUDA), with a static
cache (a ``StaticCache``, which ``generate`` runs through a compiled forward). On CUDA each row also reports
``gpu_busy`` (device time of a decode step's graph replay over the step's wall time) and the
kernels one decode step launches per layer (profiler, eager step). Each decode row also states the bytes a step
must read (weights, the batch's keys and values) and the fraction of a device copy's measured rate its step time
reaches (``roofline_fraction``). Runs alternate between the
implementations and report medians: a noisy neighbour hits both alike.
"""
from __future__ import annotations

import statistics
import time

import torch

from kvmesh.bench.report import machine, print_table, time_call, write_json


def _hf_twin(loaded):
    """transformers' model of the same config holding kvmesh's own weight tensors (views, no copy), built on
    kvmesh's device: at 8B a second copy built on the host and moved over would take minutes and 16 GB more."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from kvmesh.model.config import to_hf_dict

    with torch.device(loaded.device):
        hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(**to_hf_dict(loaded.config)), dtype=loaded.dtype)
    hf.load_state_dict(loaded.model.hf_state_dict(), strict=True, assign=True)
    if loaded.config.tie_word_embeddings:
        hf.lm_head.weight = hf.model.embed_tokens.weight
    return hf.eval()


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Bytes per second a device-to-itself copy moves (read plus written): the memory roofline a decode step is
    held against, measured rather than taken from a data sheet."""
    from kvmesh.device import synchronize

    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = time_call(lambda: (dst.copy_(src), synchronize(device)), repeat=5)
    return 2 * nbytes / seconds


def step_bytes(llm, batch: int, mean_context: float) -> int | None:
    """Bytes a decode step must read at least: every weight once (the output head in full, the embedding table
    only where it is the head too: a step looks up one row per sequence), and each sequence's keys and values.
    None for a mixture of experts, whose step reads the experts its tokens were routed to (no fixed bound)."""
    if llm.loaded.config.num_experts:
        return None
    state = llm.loaded.model.hf_state_dict()
    if "lm_head.weight" in state:
        state = {name: t for name, t in state.items() if name != "model.embed_tokens.weight"}
    weights = sum(t.numel() * t.element_size() for t in state.values())
    return int(weights + batch * mean_context * llm.engine.layout.bytes_per_token)


def kv_blocks_for(num_tokens: int, block_size: int = 16) -> int:
    """KV blocks that hold ``num_tokens`` tokens of sequences, with room for one partial block each."""
    return -(-num_tokens // block_size) + 64


def gpu_busy(llm, prompts: list[list[int]], steps: int = 20) -> tuple[float, float]:
    """Graph replay GPU time over engine step wall time at one batch: (busy fraction, step ms), decode steps only
    (timed once every prompt is computed). CUDA graphs only. Each replay's events are read after the loop (reading
    them per step would wait for a step launched ahead)."""
    from kvmesh.engine.sampling_params import SamplingParams

    engine, graphs = llm.engine, llm.engine.runner.graphs
    for p in prompts:
        engine.add_request(p, SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True))
    sched = engine.scheduler
    engine.step()
    while sched.waiting or any(seq.is_prefilling for seq in sched.running):
        engine.step()  # long prompts take several steps: only decode steps are timed
    engine.step()
    walls, events = [], []
    replay = graphs.run

    def timed_run(*args, **kw):
        start_ev, end_ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start_ev.record()
        out = replay(*args, **kw)
        end_ev.record()
        events.append((start_ev, end_ev))
        return out

    graphs.run = timed_run
    try:
        for _ in range(steps):
            t = time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - t)
    finally:
        graphs.run = replay
    torch.cuda.synchronize()
    gpus = [start.elapsed_time(end) / 1e3 for start, end in events]
    while engine.has_unfinished():
        engine.step()
    return statistics.median(gpus) / statistics.median(walls), statistics.median(walls) * 1e3


def kernels_per_layer(llm, prompts: list[list[int]], steps: int = 4) -> float:
    """CUDA kernels one eager decode step launches, per layer (torch profiler)."""
    from torch.profiler import ProfilerActivity, profile

    from kvmesh.engine.sampling_params import SamplingParams

    engine = llm.engine
    for p in prompts:
        engine.add_request(p, SamplingParams(max_tokens=steps + 4, temperature=0.0, ignore_eos=True))
    graphs, engine.runner.graphs = engine.runner.graphs, None  # eager: the profiler sees every launch
    try:
        engine.step()
        engine.step()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                engine.step()
            torch.cuda.synchronize()
    finally:
        engine.runner.graphs = graphs
    while engine.has_unfinished():
        engine.step()
    num_kernels = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    return num_kernels / steps / llm.loaded.config.num_layers


class _DecodeRow:
    """One batch size: kvmesh and the baselines, each timed as t(N tokens) - t(1 token), alternated."""

    def __init__(self, llm, hf, batch: int, context: int, new_tokens: int, static: bool, seed: int):
        from kvmesh.device import synchronize

        self.llm, self.hf, self.batch, self.new_tokens, self.static = llm, hf, batch, new_tokens, static
        self.vocab, self.dev, self.sync = llm.loaded.config.vocab_size, llm.loaded.device, synchronize
        gen = torch.Generator().manual_seed(seed)
        self.prompts = torch.randint(0, self.vocab, (batch, context), generator=gen).tolist()
        self.shift = 0
        self._static_cache = None

    def ours(self, n: int) -> float:
        from kvmesh.engine.sampling_params import SamplingParams

        self.shift += 1  # fresh prompts every call: no prefix-cache hits
        prompts = [[(t + self.shift) % self.vocab for t in p] for p in self.prompts]
        start = time.perf_counter()
        self.llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), use_tqdm=False)
        self.sync(self.dev)
        return time.perf_counter() - start

    def theirs(self, n: int, **kw) -> float:
        ids = torch.tensor(self.prompts, device=self.dev)
        start = time.perf_counter()
        with torch.inference_mode():
            self.hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=0, **kw)
        self.sync(self.dev)
        return time.perf_counter() - start

    def theirs_static(self, n: int) -> float:
        """transformers with a static cache (its compiled decode): one cache of the row's longest length for
        every call, reset in between, so the forward compiles for one shape instead of one per length."""
        from transformers import StaticCache

        if self._static_cache is None:
            self._static_cache = StaticCache(config=self.hf.config, max_cache_len=len(self.prompts[0]) + self.new_tokens)
        else:
            with torch.inference_mode():  # its tensors were made there
                self._static_cache.reset()
        return self.theirs(n, past_key_values=self._static_cache)

    def measure(self, repeat: int) -> dict:
        sides = {"kvmesh": self.ours, "transformers": self.theirs}
        if self.static:
            sides["transformers_static"] = self.theirs_static
        for fn in sides.values():  # warm-up: allocator, graphs, compilation for these shapes
            fn(4)
            fn(1)
        full: dict[str, list[float]] = {name: [] for name in sides}
        first: dict[str, list[float]] = {name: [] for name in sides}
        for _ in range(repeat):
            for name, fn in sides.items():
                full[name].append(fn(self.new_tokens))
                first[name].append(fn(1))
        decoded = self.batch * (self.new_tokens - 1)
        row = {"batch": self.batch, "context": len(self.prompts[0]), "new_tokens": self.new_tokens}
        for name in sides:
            decode_s = statistics.median(full[name]) - statistics.median(first[name])
            if decode_s <= 0.05 * statistics.median(full[name]):
                raise RuntimeError(f"{name}: decoding {self.new_tokens} tokens took no measurable time beyond the "
                                   "prefill; raise --decode-tokens")
            row[f"{name}_tok_s"] = decoded / decode_s
        row["speedup"] = row["kvmesh_tok_s"] / row["transformers_tok_s"]
        if self.static:
            row["speedup_vs_static"] = row["kvmesh_tok_s"] / row["transformers_static_tok_s"]
        return row


def run(model: str, json_path: str | None, prefill_lens: tuple[int, ...] = (512, 2048),
        batches: tuple[int, ...] = (16,), context: int = 32, decode_tokens: int = 64, repeat: int = 3,
        dtype: str = "auto", device: str = "cpu", load_format: str = "auto", static: bool | None = None) -> dict:
    """``static``: the static-cache baseline too (default: on CUDA only, where transformers compiles it)."""
    from kvmesh import LLM, SamplingParams
    from kvmesh.device import cpu_features, device_name, synchronize

    torch.manual_seed(0)
    num_tokens = max(max(prefill_lens, default=0), max(batches) * (context + decode_tokens + 16))
    llm = LLM(model, dtype=dtype, device=device, num_kv_blocks=kv_blocks_for(num_tokens),
              max_num_seqs=max(*batches, 16), max_num_batched_tokens=max(2048, max(prefill_lens, default=0)),
              progress=False, load_format=load_format)
    dev = llm.loaded.device
    static = dev.type == "cuda" if static is None else static
    _say(f"{model} loaded on {device_name(dev)}; building transformers' twin on the same weights")
    hf = _hf_twin(llm.loaded).to(dev)  # in the same dtype, on the same device
    vocab = llm.loaded.config.vocab_size
    res: dict = {"machine": machine(), "model": model, "load_format": load_format,
                 "dtype": str(llm.loaded.dtype).removeprefix("torch."), "device": device_name(dev),
                 "cpu_features": cpu_features(), "threads": torch.get_num_threads(),
                 "shape": {k: getattr(llm.loaded.config, k) for k in (
                     "num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
                     "vocab_size")},
                 "copy_bytes_per_s": copy_bandwidth(dev), "prefill": [], "decode_batches": []}
    one = SamplingParams(max_tokens=1, temperature=0.0)
    for n in prefill_lens:
        if n >= llm.engine.max_model_len:
            continue
        _say(f"prefill of {n} tokens")
        ids = torch.randint(0, vocab, (n,)).tolist()
        # Fresh prompts each round, so kvmesh's prefix cache cannot help.
        prompts = iter([[(t + r) % vocab for t in ids] for r in range(repeat + 2)])
        replays_before = _prefill_replays(llm)
        t_ours = time_call(lambda: (llm.generate(next(prompts), one, use_tqdm=False), synchronize(dev)), repeat)
        with torch.inference_mode():
            t_hf = time_call(lambda: (hf(torch.tensor([ids], device=dev)), synchronize(dev)), repeat)
        res["prefill"].append({"tokens": n, "kvmesh_s": t_ours, "transformers_s": t_hf, "speedup": t_hf / t_ours,
                               "graph_replayed": _prefill_replays(llm) > replays_before})
        write_json(json_path, res)  # a run cut short still reports what it measured
    for i, batch in enumerate(batches):
        _say(f"decode at batch {batch} (warm-ups compile transformers' static cache first)" if static else
             f"decode at batch {batch}")
        # A seed of its own: the prefill rows' prompts come from torch's default generator seeded 0, and a
        # generator seeded 0 here would repeat their first tokens (a prefix-cache hit in kvmesh's row).
        row_run = _DecodeRow(llm, hf, batch, context, decode_tokens, static, seed=1_000 + i)
        row = row_run.measure(repeat)
        if dev.type == "cuda":
            fresh = [[(t + 7919) % vocab for t in p] for p in row_run.prompts]
            if llm.engine.runner.graphs is not None:
                row["gpu_busy"], row["step_ms"] = gpu_busy(llm, fresh)
            row["kernels_per_layer"] = kernels_per_layer(llm, [[(t + 1) % vocab for t in p] for p in fresh])
        row["step_bytes"] = step_bytes(llm, batch, context + decode_tokens / 2)
        row["roofline_fraction"] = (None if row["step_bytes"] is None else
                                    row["step_bytes"] * row["kvmesh_tok_s"] / batch / res["copy_bytes_per_s"])
        res["decode_batches"].append(row)
        write_json(json_path, res)
    runner = llm.engine.runner
    res["graphs"] = {kind: None if graphs is None else graphs.describe()  # captured buckets, time, memory
                     for kind, graphs in (("decode", runner.graphs), ("prefill", runner.prefill_graphs))}
    write_json(json_path, res)
    _print(res, static)
    return res


def _prefill_replays(llm) -> int:
    graphs = llm.engine.runner.prefill_graphs
    return 0 if graphs is None else graphs.num_replays


def _say(what: str) -> None:
    """One progress line (long runs on a device are read from their log)."""
    print(f"[bench model {time.strftime('%H:%M:%S')}] {what}", flush=True)


def _print(res: dict, static: bool) -> None:
    rows = [[f"prefill {p['tokens']} tokens" + (" (graph)" if p.get("graph_replayed") else ""), f"{p['kvmesh_s'] * 1e3:.0f} ms", f"{p['transformers_s'] * 1e3:.0f} ms",
             "", f"{p['speedup']:.2f}x", "", ""] for p in res["prefill"]]
    for d in res["decode_batches"]:
        rows.append([f"decode batch {d['batch']} x {d['new_tokens']} (context {d['context']})",
                     f"{d['kvmesh_tok_s']:.0f} tok/s", f"{d['transformers_tok_s']:.0f} tok/s",
                     f"{d['transformers_static_tok_s']:.0f} tok/s" if static else "-", f"{d['speedup']:.2f}x",
                     f"{d['speedup_vs_static']:.2f}x" if static else "-", f"{d['roofline_fraction']:.2f}" if d["roofline_fraction"] is not None else "-"])
    s = res["shape"]
    title = (f"{res['model']} ({s['num_layers']} layers x {s['hidden_size']}, {res['dtype']}, {res['device']}, "
             f"{res['threads']} threads, CPU: {' '.join(res['cpu_features']) or '?'})")
    print_table(title, ["work", "kvmesh", "transformers", "transformers static", "speedup", "vs static",
                        "of copy rate"], rows)
