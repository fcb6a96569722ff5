"""``kvmesh bench cluster`` end to end (quick, tiny preset): modes, JSON shape, counters, plots.

Latency ratios are reported by the benchmark, not asserted here (these machines are noisy);
what is asserted is what the counters must show whatever the timing.
"""
from __future__ import annotations

import pytest

import json

from kvmesh.cli import main

KEYS = {"ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "throughput_tok_s", "hit_rate_local", "hit_rate_global",
        "tokens_computed", "tokens_reused", "bytes_transferred"}


def test_shared_prefix_quick_compares_all_modes(tmp_path, caplog):
    """One run per mode (runs pooled: ``test_runs_of_a_mode_are_pooled``); the clusters' clean stops log no
    warning (no "watch broke" from a mirror its own close cancelled)."""
    import logging

    caplog.set_level(logging.WARNING)
    path = tmp_path / "bench.json"
    assert main(["bench", "cluster", "--workload", "shared-prefix", "--quick", "--repeat", "1", "--json", str(path),
                 "--plots", str(tmp_path / "plots")]) == 0
    res = json.loads(path.read_text())
    modes = res["modes"]
    assert set(modes) == {"kvmesh", "local-rr", "no-cache", "colocated"} and res["repeat"] == 1
    for m in modes.values():
        assert KEYS <= set(m) and m["requests"] == 30 and len(m["ttft_ms_all"]) == 30
        assert m["runs"] == 1 and len(m["ttft_p50_ms_per_run"]) == 1 and min(m["ttft_p50_ms_per_run"]) > 0
    assert modes["no-cache"]["tokens_reused"] == 0 and modes["no-cache"]["hit_rate_global"] == 0
    assert modes["kvmesh"]["tokens_computed"] < 0.5 * modes["no-cache"]["tokens_computed"]
    assert modes["kvmesh"]["hit_rate_global"] >= modes["local-rr"]["hit_rate_global"]
    assert modes["colocated"]["bytes_transferred"] == 0
    # the same machines in every mode: colocated serves on the prefill nodes' machines too
    assert modes["colocated"]["nodes"] == {"prefill": 0, "decode": 3}
    assert modes["kvmesh"]["nodes"] == {"prefill": 1, "decode": 2}
    for m in modes.values():  # every prompt token counted once, by source
        assert sum(m["prompt_tokens"].values()) == m["prompt_tokens_total"] > 0, m["prompt_tokens"]
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == ["hit_rate.png", "throughput.png",
                                                                      "ttft_cdf.png"]
    assert not [r.getMessage() for r in caplog.records if "watch broke" in r.getMessage()]


def test_runs_of_a_mode_are_pooled():
    """``--repeat N``: a mode's metrics over every run's requests, its node counters summed, each run's TTFT p50."""
    from kvmesh.bench.cluster_bench import ModeRun, Record, summarize_runs

    def run(ttfts_ms: list[float], computed: int) -> ModeRun:
        records = [Record(t / 1e3, t / 1e3 + 0.05, [0.01] * 3, 4, 32, {"tokens_computed": 32}, [1, 2, 3, 4])
                   for t in ttfts_ms]
        delta = {"num_local": len(records), "num_remote": 0, "prefill_tokens_computed": computed,
                 "bytes_received": 0, "tier_bytes_demoted": 0, "tier_bytes_promoted": 0, "decode_step_s": 0.5,
                 "decode_steps": 10}
        return ModeRun(records, 1.0, delta, {})

    pooled = summarize_runs([run([10, 20, 30], 100), run([100, 200, 300], 50)], 1000.0, 100.0)
    assert pooled["runs"] == 2 and pooled["requests"] == 6 and pooled["ttft_p50_ms_per_run"] == [20, 200]
    assert pooled["decisions"] == {"computed_locally": 6, "fetched": 0}
    assert pooled["tokens_computed"] == 6 * 32 + 150 and len(pooled["ttft_ms_all"]) == 6
    assert pooled["fetched_requests"]["decode_step_mean_ms"] == 50.0  # the runs' decode steps: 1 s over 20


def test_multi_turn_reuses_earlier_turns_across_nodes(tmp_path):
    path = tmp_path / "mt.json"
    # Round-robin spreads a conversation's turns over the decode nodes: later turns find the
    # earlier turns' blocks on another node through the global pool.
    # --kv-placement threshold:0: fetch whatever a peer holds (the cost model would compute the tiny preset here);
    # no prefill node, so each fetch is from peers alone (what the router learns a fetch's cost from).
    assert main(["bench", "cluster", "--workload", "multi-turn", "--quick", "--modes", "kvmesh", "--prefill", "0",
                 "--routing", "round-robin", "--concurrency", "1", "--decode", "2", "--kv-placement", "threshold:0",
                 "--json", str(path)]) == 0
    kvmesh = json.loads(path.read_text())["modes"]["kvmesh"]
    assert kvmesh["tokens_reused_remote"] > 0 and kvmesh["hit_rate_global"] > 0
    # the router saw those fetches end and learned what fetching into the nodes costs (each run's router learns
    # from its own run: the first run's turns can outrun their blocks' publication on a loaded machine and fetch
    # nothing; later runs find the earlier turns published)
    learned = [costs for costs in kvmesh["router_fetch_costs"] if costs]
    assert learned and all(c["num_samples"] > 0 and c["rtt_ms"] >= 0 for costs in learned for c in costs.values())


def test_mooncake_trace_workload(tmp_path):
    trace = tmp_path / "trace.jsonl"
    rows = [{"timestamp": i * 50, "input_length": 700, "output_length": 4, "hash_ids": [1, 2] if i % 2 else [1, 3]}
            for i in range(6)]
    trace.write_text("\n".join(json.dumps(r) for r in rows))
    path = tmp_path / "mc.json"
    assert main(["bench", "cluster", "--workload", "mooncake", "--trace", str(trace), "--modes", "kvmesh",
                 "--json", str(path)]) == 0
    kvmesh = json.loads(path.read_text())["modes"]["kvmesh"]
    assert kvmesh["requests"] == 6 and kvmesh["tokens_reused"] > 0  # hash id 1 is a shared 512-token prefix


@pytest.mark.parametrize("span_ms", [(30.0, 90.0), (12.0, 4000.0), (0.5, 60000.0)])
def test_the_ttft_axis_labels_never_overlap(span_ms):
    """Within a decade and over several: the log axis's visible labels never overlap and there are some."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kvmesh.bench.plots import log_axis

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([span_ms[0], span_ms[1]], [0, 1])
    log_axis(ax.xaxis, *span_ms)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    boxes = [t.get_window_extent(renderer) for t in ax.get_xticklabels(minor=False) + ax.get_xticklabels(minor=True)
             if t.get_visible() and t.get_text() and ax.get_xlim()[0] <= t.get_position()[0] <= ax.get_xlim()[1]]
    plt.close(fig)
    assert len(boxes) >= 2
    boxes.sort(key=lambda b: b.x0)
    assert all(a.x1 <= b.x0 for a, b in zip(boxes, boxes[1:])), [(b.x0, b.x1) for b in boxes]


def test_the_shifting_workload_reports_every_mode_and_phase(tmp_path):
    """``--workload shifting`` on the tiny preset (the auto mode; fixed modes run the same code without the
    balancer): the JSON shape scripts read (goodput, lost, failed, role changes, phases by name), every request
    answered, the roles over time sampled and plotted."""
    path = tmp_path / "shift.json"
    assert main(["bench", "cluster", "--workload", "shifting", "--modes", "auto", "--phases", "2",
                 "--per-phase", "6", "--long-prompt-len", "96", "--long-output-len", "16", "--concurrency", "3",
                 "--role-interval-s", "0.2", "--touch-memory-gib", "0.1", "--max-num-seqs", "5", "--json", str(path),
                 "--plots", str(tmp_path / "plots")]) == 0
    res = json.loads(path.read_text())
    assert set(res["modes"]) == {"auto"} and res["memory_touched_gib"] == 0.1 and res["max_num_seqs_per_node"] == 5
    m = res["modes"]["auto"]
    assert m["lost"] == 0 and m["failed"] == 0 and m["goodput_rps"] >= 0 and m["role_changes"] >= 0
    assert [p["name"] for p in m["phases"]] == ["prefill-heavy", "decode-heavy"]
    assert all(p["requests"] == 6 == len(p["requests_ms"]) and p["goodput_rps"] >= 0 for p in m["phases"])
    assert m["roles_over_time"] and m["nodes"] == {"prefill": 1, "decode": 2}
    from kvmesh.bench.shifting import NODE_WORK_KEYS  # each node's account, read from its stats at the end

    assert set(m["node_work"]) == {"prefill-0", "decode-0", "decode-1"}
    assert all(set(work) == set(NODE_WORK_KEYS) and work["num_prefills"] >= 0 and work["prefill_tokens_per_s"] > 0
               and work["max_num_seqs"] == 5 for work in m["node_work"].values())  # --max-num-seqs reached every node
    assert (tmp_path / "plots" / "roles_over_time.png").stat().st_size > 0


def test_the_moved_shifting_mode_moves_one_node_before_the_first_request_and_holds(tmp_path):
    """``--modes 2p1d-moved``: started as 1p2d, decode-1 moved to prefill before any request (the first roles
    sampled already show it), the balancer held by its floors from then on: no further change."""
    path = tmp_path / "shift.json"
    assert main(["bench", "cluster", "--workload", "shifting", "--modes", "2p1d-moved", "--phases", "2",
                 "--per-phase", "4", "--long-prompt-len", "96", "--long-output-len", "12", "--concurrency", "2",
                 "--role-interval-s", "0.2", "--touch-memory-gib", "0", "--json", str(path)]) == 0
    m = json.loads(path.read_text())["modes"]["2p1d-moved"]
    assert m["lost"] == 0 and m["failed"] == 0 and m["role_changes"] == 0
    assert m["nodes"] == {"prefill": 1, "decode": 2}  # the shape it started with
    roles = [sample["roles"] for sample in m["roles_over_time"]]
    assert roles and all(r == {"prefill-0": "prefill", "decode-0": "decode", "decode-1": "prefill"} for r in roles)
