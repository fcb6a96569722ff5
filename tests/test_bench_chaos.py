"""The chaos benchmark, short: faults during serving never lose, corrupt (tokens or KV), leak or let a forgery
through."""
from __future__ import annotations

from kvmesh.bench import chaos


def test_chaos_quick_zmq(tmp_path):
    out = chaos.run(str(tmp_path / "chaos.json"), ["zmq"], num_requests=48, abort_every=10)
    r = out["backends"]["zmq"]
    assert r["requests"] >= 48
    assert r["completed"] >= 0.95 * (r["requests"] - r["aborted"]), r  # faults may fail a request, rarely
    assert r["failed_with_error"] <= 0.05 * r["requests"], r
    assert (r["lost"], r["corrupted"], r["leaked_blocks"], r["forged_accepted"]) == (0, 0, 0, 0), r
    # The KV-level oracle read every completed prompt's KV that the decode nodes still cache back through their
    # block tables: much of their two pools of 512 blocks (older prompts were evicted by newer ones).
    assert r["kv_mismatched"] == 0 and r["kv_checked"] >= 256, r
    assert r["forged_sent"] >= 24 and r["aborted"] > 0
    decode_stats = [s for n, s in r["nodes"].items() if n.startswith("decode")]
    assert sum(s["num_unauthenticated"] for s in r["nodes"].values()) >= 8  # every forged frame was counted
    assert sum(s["num_remote"] for s in decode_stats) > 0  # KV really moved between processes
    assert r["flood"]["refused_busy_or_capped"] >= 8  # waits past the cap are refused
    assert (tmp_path / "chaos.json").exists()
