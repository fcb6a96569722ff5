"""``kvmesh bench late-writes``: pushes given up on a slow link between hosts never reach a later answer.

Simulated hosts (``cluster/hosts.py``): etcd on host 1, the writer on host 2, the requesting
decode node on host 3 with a small KV pool and its link capped with tbf. Per backend and path:

    holder   decode-0 (host 2) computes a long prefix X; decode-1 (host 3) is asked for X + s,
             pulls X from decode-0 and gives up after ``--timeout`` (the link is too slow)
    prefill  decode-0 (host 3) asks prefill-0 (host 2) to compute X + s and push it, and gives up

Mooncake's own bound on a batch is shortened (MC_TRANSFER_TIMEOUT=5), so the writer's part
ends while bytes are still on their way: exactly the case where a writer's "I stopped" is
no proof (docs/design.md §6). Between given-up pushes the requester keeps serving requests that
cache a new prefix Y (shorter than the ``--kv-placement threshold:N``, so computed there) and reuse
it, reusing the blocks of the pool while the late bytes drain into its host; it goes on
until the writer has nothing pending. Every answer is compared with the single-node engine
on the same weights. JSON: ``{"runs": [{"backend", "path", "requests", "differ", "failed",
"given_up", ...}]}``.
"""
from __future__ import annotations

import itertools
import os
import random
import time
from dataclasses import dataclass

from tqdm import tqdm

from kvmesh.bench.report import machine, print_table, write_json
from kvmesh.cluster.hosts import Hosts, HostsError, can_create
from kvmesh.cluster.local_launcher import LocalCluster
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.transfer.engine import mooncake_available

PATHS = ("holder", "prefill")
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
# How long the requester may be silent before the client pings it and gives up: its capped link is full of the
# pushes this benchmark lets drain, so a ping waits behind them (seconds at 0.5 Mbit/s, longer on a busy CPU).
LIVENESS_S = 60.0


@dataclass(frozen=True)
class LateWritesConfig:
    model: str = "smollm2-135m"
    prefix_tokens: int = 2000  # X: what the writer pushes (and the requester gives up on)
    local_tokens: int = 1200  # Y: what the requester computes itself and reuses
    link_mbit: float = 20.0
    timeout_s: float = 5.0  # the requester's holder and prefill timeouts
    num_requests: int = 40  # at least this many answers per run
    far_every: int = 3  # one given-up push every this many rounds (a round: a new prefix Y, then Y reused)
    num_kv_blocks: int = 140  # the requester's pool
    quiet_rounds: int = 4  # local rounds once the writer has nothing pending


def _prompt(rng: random.Random, lo: int, hi: int, n: int) -> list[int]:
    return [rng.randrange(lo, hi) for _ in range(n)]


def run_one(hosts: Hosts, backend: str, path: str, cfg: LateWritesConfig, bar: tqdm | None = None) -> dict:
    """One backend and path on ``hosts`` (3 or more): returns the run's counts (``differ`` and ``failed`` must be 0)."""
    rng = random.Random(f"{backend}-{path}")
    lo, hi = (0, 256) if cfg.model.startswith("tiny") else (1000, 40000)
    writer, requester_id = ("decode-0", "decode-1") if path == "holder" else ("prefill-0", "decode-0")
    limit = (cfg.prefix_tokens + cfg.local_tokens) // 2  # the requester computes Y itself, never X
    args = ["--transfer-backend", backend, "--holder-timeout", str(cfg.timeout_s), "--prefill-timeout",
            str(cfg.timeout_s), "--kv-placement", f"threshold:{limit}"]
    num_far = -(-cfg.num_requests // (2 * cfg.far_every + 1))  # the given-up pushes (the rest: local requests)
    blocks_per_x = (cfg.prefix_tokens - 1) // 16
    cluster = LocalCluster(int(path == "prefill"), 1 + int(path == "holder"), model=cfg.model, node_args=args,
                           hosts=hosts, placement={"etcd": 1, writer: 2, requester_id: 3},
                           cluster=f"late-{backend}-{path}", start_timeout_s=300,
                           per_node_args={requester_id: ["--num-kv-blocks", str(cfg.num_kv_blocks)],
                                          writer: ["--num-kv-blocks", str(max(1024, 2 * num_far * blocks_per_x))]})
    sent: list[list[int]] = []
    outs = []
    given_up = 0
    far: list[dict] = []  # where the given-up requests' tokens came from
    with cluster:
        requester, source = cluster.client(requester_id), cluster.client(writer)
        far_prompts = [_prompt(rng, lo, hi, cfg.prefix_tokens) for _ in range(num_far)]
        if path == "holder":  # decode-0 holds every X, and the requester's index mirror knows it, before the cap
            for x in far_prompts:
                assert not source.generate(x, GREEDY, timeout_s=600, liveness_s=LIVENESS_S).error
            revision = _published_revision(cluster, num_far * blocks_per_x)
            _wait_until(lambda: requester.stats()["index_revision"] >= revision, "the requester's index mirror")
        hosts.set_rate(3, cfg.link_mbit)
        try:
            quiet = 0
            for round_no in itertools.count():
                if len(outs) >= cfg.num_requests and quiet >= cfg.quiet_rounds:
                    break
                if round_no % cfg.far_every == 0 and far_prompts:
                    sent.append(far_prompts.pop(0) + _prompt(rng, lo, hi, 16))
                    out = requester.generate(sent[-1], GREEDY, timeout_s=600, liveness_s=LIVENESS_S)
                    moved = sum(getattr(out.stats, k) for k in ("tokens_reused_remote", "tokens_from_prefill_node",
                                                              "tokens_reused_prefill_node"))
                    given_up += moved < cfg.prefix_tokens // 2
                    far.append({k: getattr(out.stats, k) for k in ("tokens_reused_remote", "tokens_from_prefill_node",
                                                                 "tokens_computed", "kv_wait_ms")})
                    outs.append(out)
                y = _prompt(rng, lo, hi, cfg.local_tokens)
                for p in (y, y[: cfg.local_tokens - 8] + _prompt(rng, lo, hi, 24)):
                    sent.append(p)
                    outs.append(requester.generate(p, GREEDY, timeout_s=600, liveness_s=LIVENESS_S))
                if bar is not None:
                    bar.update(len(outs) - bar.n)
                if len(outs) >= cfg.num_requests:
                    quiet = quiet + 1 if source.stats()["num_pending_pushes"] == 0 else 0
        finally:
            hosts.set_rate(3, None)
        stats = _settle(requester)
        source.stats(check=True)
        # The KV-level oracle: whatever the requester still caches of every prompt, read through its block
        # table once every late push has drained (a late write into a cached block changes no answer until
        # a later request reuses the block).
        probes = [(p, requester.stats(kv_probe=p)["kv_probe"]) for p in sent]
    want, kv_checked, kv_mismatched = _reference(cfg.model, sent, probes)
    differ = [i for i, (o, w) in enumerate(zip(outs, want)) if not o.error and o.token_ids != w]
    failed = [i for i, o in enumerate(outs) if o.error]
    return {"backend": backend, "path": path, "requests": len(outs), "differ": len(differ), "failed": len(failed),
            "kv_checked": kv_checked, "kv_mismatched": len(kv_mismatched), "kv_mismatched_at": kv_mismatched[:10],
            "given_up": given_up, "far": far, "differ_at": differ[:20], "errors": sorted({o.error[:100] for o in outs if o.error}),
            "num_checksum_failures": stats["num_checksum_failures"], "num_fallbacks": stats.get("num_fallbacks", 0),
            "landing": stats.get("landing", {}), "num_quarantined_total": stats["num_quarantined_total"],
            "tokens_reused_local": sum(o.stats.tokens_reused_local for o in outs if not o.error)}


def _published_revision(cluster: LocalCluster, num_blocks: int, timeout_s: float = 60.0) -> int:
    """Once decode-0 (the holder) has ``num_blocks`` entries in the index: etcd's revision then."""
    from kvmesh.metadata.block_index import read_holdings
    from kvmesh.metadata.keys import KeyLayout
    from kvmesh.metadata.sealed_store import open_store

    store = open_store(cluster.etcd_endpoint, cluster.token)
    try:
        deadline = time.monotonic() + timeout_s
        while True:  # publication is asynchronous: read again
            table, revision = read_holdings(store, KeyLayout(cluster.cluster))
            if "decode-0" in table.nodes and len(table.nodes["decode-0"].blocks) >= num_blocks:
                return revision
            if time.monotonic() > deadline:
                raise TimeoutError("the holder's blocks did not reach the index")
            time.sleep(0.05)
    finally:
        store.close()


def _wait_until(predicate, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():  # publication is asynchronous: the condition is read again
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _settle(client, timeout_s: float = 120.0) -> dict:
    """The requester's stats once nothing of it is fenced or in use any more (integrity checked)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = client.stats(check=True)
        if (stats["num_quarantined_blocks"] == 0 and stats.get("num_fenced_landing_slots", 0) == 0
                and stats["num_used_blocks"] == 0) or time.monotonic() > deadline:
            return stats
        time.sleep(0.2)


def _reference(model: str, prompts: list[list[int]], probes: list[tuple[list[int], dict]]
               ) -> tuple[list[list[int]], int, list[tuple[int, list[int]]]]:
    """The single-node engine's greedy outputs, and its KV compared with the requester's (``compare_with_engine``)."""
    from kvmesh import LLM
    from kvmesh.engine.kv_probe import compare_with_engine

    llm = LLM(model, num_kv_blocks=max(1024, 2 * max(len(p) for p in prompts) // 16), progress=False)
    outputs = [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    return (outputs, *compare_with_engine(llm, probes))


def run(json_path: str | None, cfg: LateWritesConfig, backends: list[str] | None = None,
        paths: list[str] | None = None) -> dict:
    ok, why = can_create()
    if not ok:
        raise HostsError(f"bench late-writes: {why}")
    backends = backends or (["mooncake", "zmq"] if mooncake_available() else ["zmq"])
    os.environ["MC_TRANSFER_TIMEOUT"] = "5"  # the nodes' Mooncake ends a batch before the link drains it
    out = {"machine": machine(), "config": cfg.__dict__, "runs": []}
    pid = os.getpid()
    with tqdm(desc="late-writes requests", leave=False) as bar, \
            Hosts(3, prefix=f"kl{pid % 100000}", subnet=f"10.83.{pid % 250}") as hosts:
        for backend in backends:
            for path in paths or PATHS:
                bar.reset()
                out["runs"].append(run_one(hosts, backend, path, cfg, bar))
    cols = ["requests", "given_up", "differ", "failed", "kv_checked", "kv_mismatched", "num_checksum_failures"]
    print_table(f"late writes: {cfg.model}, {cfg.prefix_tokens}-token pushes over {cfg.link_mbit} Mbit/s, "
                f"given up after {cfg.timeout_s} s (differ, failed and kv_mismatched must be 0)",
                ["backend", "path", *cols], [[r["backend"], r["path"], *(r[c] for c in cols)] for r in out["runs"]])
    write_json(json_path, out)
    return out


def add_arguments(p) -> None:
    d = LateWritesConfig()
    p.add_argument("--json", default=None)
    p.add_argument("--model", default=d.model)
    p.add_argument("--prefix-tokens", type=int, default=d.prefix_tokens)
    p.add_argument("--local-tokens", type=int, default=d.local_tokens)
    p.add_argument("--link-mbit", type=float, default=d.link_mbit, help="the requester's link (tbf, both ways)")
    p.add_argument("--timeout", type=float, default=d.timeout_s, help="the requester gives up on a push after this")
    p.add_argument("--requests", type=int, default=d.num_requests, help="at least this many answers per run")
    p.add_argument("--num-kv-blocks", type=int, default=d.num_kv_blocks, help="the requester's KV pool")
    p.add_argument("--backend", action="append", choices=["mooncake", "zmq"], help="default: both (when available)")
    p.add_argument("--path", action="append", choices=list(PATHS), help="default: both")


def main(args) -> int:
    cfg = LateWritesConfig(args.model, args.prefix_tokens, args.local_tokens, args.link_mbit, args.timeout,
                           args.requests, num_kv_blocks=args.num_kv_blocks)
    out = run(args.json, cfg, args.backend, args.path)
    return 1 if any(r["differ"] or r["failed"] or r["kv_mismatched"] for r in out["runs"]) else 0
