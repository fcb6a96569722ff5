"""``kvmesh bench traces``: what request tracing costs a serving cluster, tracing off against tracing on at
each sample ratio, in one run.

The quick shared-prefix workload of ``kvmesh bench cluster`` (5 groups of 6 requests, a 768-token shared
system prompt, 8 new tokens each) through the ``kvmesh`` mode (1 prefill + 1 decode node, the router's
cache-aware routing), on a fresh cluster per run; the router and every node export to an OTLP/HTTP sink of
this process (``kvmesh/bench/otlp_sink.py``). The settings are interleaved within each repeat (off, then
each ratio) so that the machine's drift falls on all of them alike. Reported per setting: TTFT p50/p90,
TPOT p50, requests per second, spans received; and each against off. JSON: ``{"settings": {name: {...}}}``.
"""
from __future__ import annotations

import statistics
import time

from tqdm import tqdm

from kvmesh.bench import workloads as wl
from kvmesh.bench.cluster_bench import modes, run_mode
from kvmesh.bench.otlp_sink import OTLPSink
from kvmesh.bench.report import machine, percentile, print_table, write_json

EXPORT_SETTLE_S = 3.0  # the nodes' exporters post every second: what a run's spans need to arrive


def run(json_path: str | None, model: str = "tiny-llama", ratios: tuple[float, ...] = (0.01, 1.0), repeat: int = 3,
        dtype: str = "float32", groups: int = 5, per_group: int = 6) -> dict:
    requests = wl.shared_prefix(groups, per_group, 768, 32, 8, 256 if model.startswith("tiny") else 32000, seed=0)
    mode = modes(1)["kvmesh"]
    settings = [("off", None)] + [(f"ratio {r:g}", r) for r in ratios]
    runs: dict[str, list] = {name: [] for name, _ in settings}
    spans: dict[str, int] = dict.fromkeys(runs, 0)
    sink = OTLPSink()
    try:
        with tqdm(total=len(requests) * len(settings) * repeat, desc="bench traces") as bar:
            for _ in range(repeat):
                for name, ratio in settings:
                    before = len(sink.spans)
                    tracing = (sink.endpoint, ratio) if ratio is not None else None
                    runs[name].append(run_mode(mode, model, 1, "shared-prefix", requests, 4, None, bar,
                                               dtype=dtype, tracing=tracing))
                    if tracing is not None:
                        time.sleep(EXPORT_SETTLE_S)  # the nodes exported at their close; the sink takes its time
                    spans[name] += len(sink.spans) - before
    finally:
        sink.close()
    out = {"machine": machine(), "model": model, "dtype": dtype, "repeat": repeat, "workload": "shared-prefix quick",
           "num_requests": len(requests), "settings": {}}
    for name, mode_runs in runs.items():
        records = [r for run in mode_runs for r in run.records]
        ttft = [r.ttft_s * 1e3 for r in records]
        tpot = [(r.e2e_s - r.ttft_s) / (r.num_tokens - 1) * 1e3 for r in records if r.num_tokens > 1]
        out["settings"][name] = {
            "ttft_p50_ms": percentile(ttft, 0.5), "ttft_p90_ms": percentile(ttft, 0.9),
            "tpot_p50_ms": percentile(tpot, 0.5),
            "requests_per_s": len(records) / sum(run.seconds for run in mode_runs),
            "ttft_p50_ms_per_run": [percentile([r.ttft_s * 1e3 for r in run.records], 0.5) for run in mode_runs],
            "spans_received": spans[name]}
    off = out["settings"]["off"]
    rows = []
    for name, r in out["settings"].items():
        r["ttft_p50_vs_off"] = r["ttft_p50_ms"] / off["ttft_p50_ms"]
        r["requests_per_s_vs_off"] = r["requests_per_s"] / off["requests_per_s"]
        rows.append([name, f"{r['ttft_p50_ms']:.1f} ms", f"{r['ttft_p90_ms']:.1f} ms", f"{r['tpot_p50_ms']:.1f} ms",
                     f"{r['requests_per_s']:.1f}", str(r["spans_received"]), f"{r['ttft_p50_vs_off']:.3f}x",
                     f"{r['requests_per_s_vs_off']:.3f}x",
                     ", ".join(f"{x:.0f}" for x in r["ttft_p50_ms_per_run"])])
    print_table(f"{model}: request tracing off and on ({len(requests)} requests x {repeat} runs per setting, "
                f"1 prefill + 1 decode node)",
                ["tracing", "TTFT p50", "TTFT p90", "TPOT p50", "requests/s", "spans", "TTFT p50 vs off",
                 "requests/s vs off", "TTFT p50 per run (ms)"], rows)
    out["spread_off_ttft_p50_ms"] = statistics.pstdev(off["ttft_p50_ms_per_run"]) if repeat > 1 else 0.0
    write_json(json_path, out)
    return out
