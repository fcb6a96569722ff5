"""``kvmesh bench router-stream``: the router's CPU per streamed token against the output's length.

A router turns each node event into a client chunk: it detokenizes the new tokens, looks for stop
strings and holds back text that could begin one. Work that grows with what was already sent makes a
long answer's tokens costlier than a short one's (quadratic in the output). Here the router's own stream
assembly (``Router._stream``, no sockets) consumes one event per token of outputs of several lengths,
with a real tokenizer and stop strings that never match (the worst case: every token checked); the CPU
time per token should not grow with the length. JSON + table.
"""
from __future__ import annotations

import queue
import time

from kvmesh.bench.report import machine, print_table, write_json

TEXT = ("The cluster keeps every block it computes where any node can find it, and a request that arrives "
        "with a prefix held elsewhere fetches it instead of computing it again. Ünïcödé, 日本語, 🚀 too.\n")
STOPS = ("</answer>", "\n\nUser:")


def _stream_cpu_s(router, tokens: list[int], stop: tuple[str, ...]) -> tuple[float, str]:
    from kvmesh.detokenizer import IncrementalDetokenizer
    from kvmesh.cluster.router import _StreamState
    from kvmesh.node import messages as nm

    events: queue.Queue = queue.Queue()
    for token in tokens:
        events.put(nm.TokenEvent("r", [token]))
    events.put(nm.TokenEvent("r", [], finished=True, finish_reason="length"))
    state = _StreamState(1, IncrementalDetokenizer(router.tokenizer))
    start = time.thread_time()
    text = "".join(chunk.text for chunk in router._stream(events, "node", state, stop))
    return time.thread_time() - start, text


def run(model: str, lengths: list[int], repeat: int, json_path: str | None) -> dict:
    from kvmesh.cluster.router import Router, RouterConfig
    from kvmesh.model.card import load_tokenizer

    router = Router.__new__(Router)  # only what ``_stream`` reads: its config and tokenizer
    router.cfg = RouterConfig(etcd="", cluster_token="bench", request_timeout_s=60.0)
    router.tokenizer = load_tokenizer(model).tokenizer
    words = router.tokenizer.encode(TEXT * (1 + max(lengths) // 20))
    if len(words) < max(lengths):
        raise SystemExit(f"the text gives {len(words)} tokens, fewer than {max(lengths)}")
    _stream_cpu_s(router, words[:256], STOPS)  # warm-up
    rows = []
    for length in lengths:
        tokens = words[:length]
        best = float("inf")
        for _ in range(repeat):
            seconds, text = _stream_cpu_s(router, tokens, STOPS)
            best = min(best, seconds)
        assert text == router.tokenizer.decode(tokens), "the streamed text differs from a whole decode"
        rows.append({"output_tokens": length, "cpu_us_per_token": best / length * 1e6})
    base = rows[0]["cpu_us_per_token"]
    for row in rows:
        row["vs_shortest"] = row["cpu_us_per_token"] / base
    print_table("router stream assembly: CPU per streamed token",
                ["output tokens", "router CPU us/token", "vs shortest"],
                [[r["output_tokens"], f"{r['cpu_us_per_token']:.1f}", f"{r['vs_shortest']:.2f}x"] for r in rows])
    result = {"machine": machine(), "model": model, "stop_strings": list(STOPS), "repeat": repeat, "rows": rows}
    write_json(json_path, result)
    return result
