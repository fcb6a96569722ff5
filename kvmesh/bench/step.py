"""``kvmesh bench step``: the host's cost of one decode step, split by phase, without a GPU.

On a GPU the forward of a small model takes less device time than the host spends around it
(docs/gpu.md: replays of a whole step's forward leave the device idle while Python schedules, fills
inputs and samples). That host part is measurable on any machine: the tiny preset's forward is a few
microseconds of arithmetic, so what a step costs here is almost all host work. For each batch, a
steady state of that many running decodes; per step (median over ``--steps``):

    schedule   Scheduler.schedule (admission, block allocation for the new tokens)
    prepare    the runner's model inputs (token ids, positions, block tables, metadata)
    forward    the model's forward (on the CPU: its dispatch plus the tiny arithmetic)
    sample     logits -> tokens and logprobs (with the LM head, which the runner applies to the rows that
               sample: ``lm_head``, timed inside it, is apart so that ``host`` leaves it out)
    outputs    emitting tokens, advancing and finishing sequences, caching full blocks

``host`` is what the host spends on a step besides the model's arithmetic: schedule + prepare + sample
- lm_head + outputs (on a GPU, the forward and the head are a graph's replay).

and, apart from those (the CPU path does not do it), ``graph_inputs``: staging the step's inputs for a
CUDA-graph replay (``DecodeInputs.fill`` into host buffers like a GPU node's), which a GPU step adds to
its host time; and the number of torch ops one forward dispatches (and per layer). JSON + table.
"""
from __future__ import annotations

import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvmesh.bench.report import machine, print_table, write_json
from kvmesh.gc_pauses import freeze_start_up

PHASES = ("schedule", "prepare", "forward", "sample", "outputs")


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.num_ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.num_ops += 1
        return func(*args, **(kwargs or {}))


def _one_batch(model: str, batch: int, steps: int) -> dict:
    from kvmesh import LLM, SamplingParams

    from kvmesh.engine.cuda_graphs import DecodeInputs, bucket_for, buckets_for

    llm = LLM(model, num_kv_blocks=max(1024, batch * 16), max_num_seqs=batch, progress=False)
    engine, runner = llm.engine, llm.engine.runner
    buckets = buckets_for(batch)
    staging = DecodeInputs(buckets[-1], engine.max_model_len, runner.block_size, torch.device("cpu"))
    params = SamplingParams(max_tokens=steps + 16, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request([(7 * i + j) % 250 for j in range(32)], params)
    while any(seq.is_prefilling for seq in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()  # every prompt computed: from here on, decode-only steps
    freeze_start_up()  # as a node does before it serves: the model's objects out of every collection's walk
    times = {phase: [] for phase in (*PHASES, "graph_inputs", "lm_head", "host")}
    model, head_s = runner.model, []
    compute_logits = model.compute_logits

    def timed_head(hidden):
        started = time.perf_counter()
        logits = compute_logits(hidden)
        head_s.append(time.perf_counter() - started)
        return logits

    model.compute_logits = timed_head  # this instance only: the runner calls it inside ``sample``
    num_ops = 0
    with torch.inference_mode():  # entered once, as ``ModelRunner.execute`` does for a step
        for step in range(steps):
            t0 = time.perf_counter()
            out = engine.scheduler.schedule()
            t1 = time.perf_counter()
            prepared = runner.prepare(out.batch, {})
            t2 = time.perf_counter()
            staging.fill(prepared.input_ids, prepared.positions, prepared.tables, prepared.seq_lens,
                         num_rows=bucket_for(buckets, len(prepared.input_ids)))
            t_staged = time.perf_counter()
            times["graph_inputs"].append((t_staged - t2) * 1e6)
            if step == 0:
                with _CountOps() as counter:
                    forward = runner.forward(prepared)
                num_ops = counter.num_ops
            else:
                forward = runner.forward(prepared)
            t3 = time.perf_counter()
            results = runner.sample(out.batch, {}, prepared, forward)
            t4 = time.perf_counter()
            engine.finish_step(out.batch, {}, results)
            t5 = time.perf_counter()
            for phase, (a, b) in zip(PHASES, ((t0, t1), (t1, t2), (t_staged, t3), (t3, t4), (t4, t5))):
                times[phase].append((b - a) * 1e6)
            head_us = sum(head_s) * 1e6
            head_s.clear()
            times["lm_head"].append(head_us)
            times["host"].append((t2 - t0 + t5 - t3) * 1e6 - head_us)  # the step's own median, not a sum of medians
    del model.compute_logits
    row = {"batch": batch, **{f"{p}_us": statistics.median(times[p]) for p in PHASES}}
    row["total_us"] = sum(row[f"{p}_us"] for p in PHASES)
    row["lm_head_us"] = statistics.median(times["lm_head"])
    row["host_us"] = statistics.median(times["host"])
    row["graph_inputs_us"] = statistics.median(times["graph_inputs"])
    row["torch_ops_per_step"] = num_ops
    row["torch_ops_per_layer"] = num_ops / llm.loaded.config.num_layers
    return row


def run(json_path: str | None, model: str = "tiny-llama", batches: tuple[int, ...] = (32, 128),
        steps: int = 50) -> dict:
    torch.manual_seed(0)
    res = {"machine": machine(), "model": model, "threads": torch.get_num_threads(), "steps": steps,
           "batches": [_one_batch(model, b, steps) for b in batches]}
    cols = [f"{p}_us" for p in PHASES] + ["total_us", "lm_head_us", "host_us", "graph_inputs_us", "torch_ops_per_step",
                                          "torch_ops_per_layer"]
    print_table(f"host time per decode step ({model}, CPU, median of {steps} steps, microseconds)",
                ["batch", *cols], [[r["batch"], *(f"{r[c]:.0f}" if isinstance(r[c], float) else r[c] for c in cols)]
                                   for r in res["batches"]])
    write_json(json_path, res)
    return res
