"""Benchmarks run end to end from the command line and report every figure (no timing asserted)."""
from __future__ import annotations

import json

import pytest

from kvmesh.cli import main


def test_bench_prefix_cache_writes_json_and_table(tmp_path, capsys):
    path = tmp_path / "pc.json"
    assert main(["bench", "prefix-cache", "--json", str(path), "--repeat", "1"]) == 0
    res = json.loads(path.read_text())
    s = res["structures"]
    for key in ("match_us", "match_cold_us", "insert_us", "evict10_us"):
        assert s[key]["pool"] > 0
    assert s["hash"]["tokens_per_s"] > 0 and s["memory"]["pool_bytes_per_block"] > 0
    engine = res["engine_shared_prompt"]
    assert engine["tokens_computed_drop"] >= 0.3 and engine["cache_on"]["hit_rate"] >= 0.6
    assert "match 32K prompt" in capsys.readouterr().out


def test_bench_transfer_reports_ceilings_and_the_sweep(tmp_path):
    path = tmp_path / "tr.json"
    assert main(["bench", "transfer", "--json", str(path), "--backends", "zmq,shared-memory", "--repeat", "1"]) == 0
    res = json.loads(path.read_text())
    assert res["memcpy_gib_per_s"] > 0 and res["socket_gib_per_s"] > 0
    layouts = {(r["layout"], r["size_bytes"]) for r in res["results"]}
    assert len(layouts) == 10 and {r["layout"] for r in res["results"]} == {"contiguous", "scattered"}
    transports = {"zmq": "zmq-tcp", "shared-memory": "shared-memory"}
    assert len(res["results"]) == 20
    for r in res["results"]:
        assert r["transport"] == transports[r["backend"]] and r["gib_per_s"] > 0
        assert r["fence_s"] == 0 and r["wire_s"] is None  # neither lands in slots
    check = res["check_path"]
    assert check["crc32_gib_per_s"] > 0 and check["copy_and_crc32_gib_per_s"] > 0
    assert check["projection_fence_limit_gib_per_s"] == check["threads"] * check["copy_and_crc32_gib_per_s"]


def test_bench_reuse_measures_both_transfer_paths(tmp_path):
    """Tiny preset: the cost model may compute the prefix rather than fetch it; what is checked is the run."""
    path = tmp_path / "reuse.json"
    assert main(["bench", "reuse", "--model", "tiny-llama", "--prompt-tokens", "256", "--rounds", "1",
                 "--json", str(path)]) == 0
    res = json.loads(path.read_text())
    assert list(res["paths"]) == ["shared-memory", "engine"] and res["path"] == "shared-memory"
    for r in res["paths"].values():
        assert r["ttft_full_s"] > 0 and r["ttft_reuse_s"] > 0 and len(r["rounds"]) == 1
    assert res["paths"]["engine"]["bytes_sent_shared_memory"] == 0
    assert res["ratio"] == res["paths"]["shared-memory"]["ratio"]


def test_bench_metadata_against_a_private_etcd(tmp_path):
    path = tmp_path / "md.json"
    assert main(["bench", "metadata", "--json", str(path)]) == 0
    res = json.loads(path.read_text())
    assert res["publish_blocks_per_s"]["batched"] > 0 and res["publish_blocks_per_s"]["one_by_one"] > 0
    assert set(res["lookup_us"]) == {"128", "2048"}
    assert res["lookup_us"]["2048"]["mirror"] > 0 and res["lookup_us"]["2048"]["direct"] > 0
    assert res["publish_to_visible_ms"]["p50"] > 0


def test_bench_index_measures_both_designs_on_one_fleet(tmp_path):
    """A small fleet: every field the issue names, exact lookups, the dead publisher gone within its lease."""
    path = tmp_path / "index.json"
    assert main(["bench", "index", "--nodes", "8", "--blocks", "12000,24000", "--baseline-blocks", "12000",
                 "--mirrors", "1", "--lookups", "60", "--lease-ttl", "2", "--json", str(path)]) == 0
    res = json.loads(path.read_text())
    fields = ("nodes", "blocks", "etcd_rss_bytes_per_block", "etcd_db_bytes_per_block", "publish_blocks_per_s",
              "lookup_p50_us", "lookup_p99_us", "promised_not_held_blocks", "dead_publisher_cleared_s")
    for row in (res, res["baseline"]):
        assert all(f in row for f in fields) and row["nodes"] == 8
        assert row["promised_not_held_blocks"] == row["held_not_promised_blocks"] == 0  # settled: exact
        assert 0 < row["dead_publisher_cleared_s"] < 2 + 10  # its lease (2 s) plus etcd's expiry rounds
        assert row["publish_blocks_per_s"] > 0 and row["churn_changes_per_s"] > 0 and row["lookups"] == 60
    assert res["design"] == "holdings" and res["baseline"]["design"] == "baseline"
    assert res["mirror_table_bytes_per_block"] > 0 and res["baseline"]["mirror_table_bytes_per_block"] is None
    assert [r["blocks"] for r in res["sizes"]] == [res["sizes"][0]["blocks"], res["blocks"]]
    assert res["extrapolated"]["blocks"] == 100_000_000 and set(res["ratios"]) >= {"publish", "etcd_rss_per_block"}


def test_bench_model_tp_compares_two_sizes_of_one_model(tmp_path, capsys):
    path = tmp_path / "tp.json"
    assert main(["bench", "model", "--model", "tiny-llama", "--tp", "2", "--prefill-lens", "64", "--batches", "4",
                 "--context", "32", "--decode-tokens", "12", "--repeat", "2", "--json", str(path)]) == 0
    res = json.loads(path.read_text())
    assert res["same_streams"] and [r["tensor_parallel_size"] for r in res["rows"]] == [1, 2]
    one, two = res["rows"]
    assert one["collective_share"] == 0 and 0 < two["collective_share"] < 1
    assert all(r["decode_tok_s"] > 0 and r["prefill_s"] > 0 for r in res["rows"])
    assert res["decode_ratio"] == two["decode_tok_s"] / one["decode_tok_s"]
    assert "size 2 / size 1" in capsys.readouterr().out


def test_bench_model_rows_per_batch_with_the_static_baseline(tmp_path, capsys):
    """A dummy-weights shape (``--load-format dummy`` on a preset's config), two decode batches, static cache on."""
    path = tmp_path / "model.json"
    assert main(["bench", "model", "--model", "tiny-qwen3", "--load-format", "dummy", "--prefill-lens", "64",
                 "--batches", "1,4", "--context", "48", "--decode-tokens", "24", "--repeat", "3", "--static",
                 "--dtype", "float32", "--json", str(path)]) == 0
    res = json.loads(path.read_text())
    assert res["load_format"] == "dummy" and res["shape"]["num_layers"] == 3
    assert [r["tokens"] for r in res["prefill"]] == [64]
    assert [(r["batch"], r["context"]) for r in res["decode_batches"]] == [(1, 48), (4, 48)]
    for r in res["decode_batches"]:
        assert r["kvmesh_tok_s"] > 0 and r["transformers_tok_s"] > 0 and r["transformers_static_tok_s"] > 0
        assert r["speedup_vs_static"] == r["kvmesh_tok_s"] / r["transformers_static_tok_s"]
    # a step's bytes: the weights but the embedding table (the head in full; counted from the config, not the model)
    # and the batch's K/V at its mean context
    from kvmesh.model.dummy_weights import num_parameters
    from kvmesh.model.presets import PRESETS

    cfg = PRESETS["tiny-qwen3"].config
    kv_per_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4
    for r in res["decode_batches"]:
        weights = num_parameters(cfg) - (0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size)
        assert r["step_bytes"] == weights * 4 + r["batch"] * (48 + 24 / 2) * kv_per_token
        assert r["roofline_fraction"] == pytest.approx(
            r["step_bytes"] * r["kvmesh_tok_s"] / r["batch"] / res["copy_bytes_per_s"])
    assert res["copy_bytes_per_s"] > 1e8
    assert "decode batch 4 x 24 (context 48)" in capsys.readouterr().out


def test_a_mixture_of_experts_has_no_fixed_step_bytes():
    """A MoE step reads the experts its tokens were routed to: no fixed lower bound, so no roofline fraction."""
    from kvmesh import LLM
    from kvmesh.bench.model import step_bytes

    assert step_bytes(LLM("tiny-qwen3-moe", num_kv_blocks=16, progress=False), 4, 10.0) is None
    assert step_bytes(LLM("tiny-llama", num_kv_blocks=16, progress=False), 4, 10.0) > 0


def test_the_benchmarks_memory_warmup_touches_every_page_then_frees_it():
    import subprocess
    import sys

    from kvmesh.bench.memory_warmup import available_gib, resolve_gib

    code = ("from kvmesh.bench.memory_warmup import touch_and_free\n"
            "def mib(key): return [int(l.split()[1]) // 1024 for l in open('/proc/self/status') if l.startswith(key)][0]\n"
            "before = mib('VmRSS:')\n"
            "touch_and_free(0.25)\n"
            "print(before, mib('VmHWM:'), mib('VmRSS:'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    before, peak, after = map(int, out.stdout.split())
    assert peak - before >= 240  # MiB: every page of the 256 was written once (the process's own high-water mark)
    assert after - before < 32  # and given back
    assert resolve_gib(0) == 0 and resolve_gib(2.5) == 2.5
    assert 0 < resolve_gib(-1) <= available_gib()


def test_bench_serve_starts_each_target_for_its_turn_alone(tmp_path):
    """``--alive one`` (the default): every turn starts its target and stops it before the next turn starts, turns
    alternate their order by round, and each kvmesh life's decode steps are added up; every request streamed."""
    out = tmp_path / "serve.json"
    main(["bench", "serve", "--model", "tiny-llama", "--targets", "kvmesh,kvmesh --kv-placement threshold:0",
          "--rounds", "2", "--concurrency", "2", "--groups", "1", "--per-group", "2", "--system-len", "16",
          "--question-len", "8", "--output-len", "4", "--touch-memory-gib", "0", "--json", str(out)])
    res = json.loads(out.read_text())
    assert res["alive"] == "one"
    other = "kvmesh --kv-placement threshold:0"
    assert [(t["round"], t["target"]) for t in res["turns"]] == [(1, "kvmesh"), (1, other), (2, other), (2, "kvmesh")]
    for before, after in zip(res["turns"], res["turns"][1:]):
        assert before["end_s"] <= after["start_s"]
    assert [t["servers_alive_beside"] for t in res["turns"]] == [0] * 4  # no earlier server alive beside a turn
    for name, target in res["targets"].items():
        assert target["requests"] == 4 and target["command"].startswith("kvmesh serve --model tiny-llama")
        assert sum(v["steps"] for v in target["decode_steps_by_threads"]["decode-0"].values()) > 0


def test_bench_serve_adds_up_the_decode_steps_of_a_targets_lives():
    from kvmesh.bench.serve_bench import _add_decode_steps

    record: dict = {}
    _add_decode_steps(record, {"decode-0": {"2": {"steps": 10, "mean_ms": 50.0}}})
    _add_decode_steps(record, {"decode-0": {"2": {"steps": 30, "mean_ms": 70.0}, "1": {"steps": 0, "mean_ms": 0.0}}})
    assert record["decode_steps_by_threads"] == {"decode-0": {"2": {"steps": 40, "mean_ms": 65.0},
                                                              "1": {"steps": 0, "mean_ms": 0.0}}}
