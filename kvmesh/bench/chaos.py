"""``kvmesh bench chaos``: a few hundred requests through 2 prefill + 2 decode nodes while things go wrong.

For each transfer backend, on the tiny preset, with every decode node forced onto
the remote path (so every request moves KV between processes), it runs waves of
shared-prefix requests and meanwhile:

    stall     SIGSTOP prefill-0 past the decode nodes' prefill timeout, then SIGCONT it
    kill      SIGKILL prefill-1 mid-prefill, then start a new prefill-1
    abort     abort some requests right after sending them (mid-transfer)
    forge     push requests and generate requests without the cluster token, with a wrong
              token, from an unknown requester, past the requester's buffer
    flood     authenticated push requests that ask a holder to wait as long as allowed for
              blocks that never come, and past the cap

With ``--hosts`` the nodes run on simulated hosts (network namespaces, ``cluster/hosts.py``):
etcd and prefill-1 on host 1, prefill-0 on host 2, decode-0 on host 3, decode-1 on host 4, so
that KV crosses veth links, and two more faults join the mix:

    slow      decode-0's link capped at SLOW_MBIT for SLOW_S: pushes into it outlive the decode
              nodes' timeouts and Mooncake's own bound on a batch (MC_TRANSFER_TIMEOUT=5)
    flap      host 2's link (prefill-0) down for FLAP_S, then up

and then checks what must never happen: a request without a final event (lost),
a greedy output that differs from the single-node engine (corrupted), KV cached for a
completed prompt that differs position by position from the single-node engine's, read
through the decode node's block table (kv_mismatched: blocks in the wrong slots leave
greedy tokens unchanged; ``kvmesh/engine/kv_probe.py``), blocks
still referenced once everything is over (leaked), a forged message that got
anything but a refusal (forged_accepted). JSON: ``{"backends": {name: {...}}}``.
"""
from __future__ import annotations

import os
import queue
import random
import signal
import threading
import time
import uuid

import zmq
from tqdm import tqdm

from kvmesh.auth import REFUSED, ClusterAuth
from kvmesh.bench.report import machine, print_table, write_json
from kvmesh.cluster.client import RequestFailed
from kvmesh.cluster.hosts import Hosts, HostsError, can_create
from kvmesh.cluster.local_launcher import LocalCluster
from kvmesh.cluster.node_connection import NodeConnection, NodeLost
from kvmesh.engine.sampling_params import SamplingParams, to_wire
from kvmesh.node import messages as nm
from kvmesh.transfer import messages as m
from kvmesh.transfer.engine import mooncake_available
from kvmesh.wire import decode, encode

PREFILL_TIMEOUT_S = 2.0
LEASE_TTL_S = 3
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
SLOW_MBIT, SLOW_S = 0.3, 6.0
FLAP_S = 1.5
HOST_PLACEMENT = {"etcd": 1, "prefill-1": 1, "prefill-0": 2, "decode-0": 3, "decode-1": 4}


def _prompt_group(rng: random.Random) -> list[list[int]]:
    """4 fresh prompts sharing a 64..160-token prefix, each with its own suffix (never seen before)."""
    prefix = [rng.randrange(256) for _ in range(rng.choice((64, 96, 128, 160)))]
    return [prefix + [rng.randrange(256) for _ in range(rng.randrange(5, 40))] for _ in range(4)]


def ask_once(endpoint: str, frame: bytes, channel: ClusterAuth, timeout_ms: int) -> bytes | None:
    """Send ``frame`` on a fresh connection secured with ``channel``'s keys and return the answer, or None
    within ``timeout_ms`` (with another token's keys the handshake fails and nothing is ever answered)."""
    sock = channel.curve_client(zmq.Context.instance().socket(zmq.DEALER))
    sock.linger = 0
    sock.connect(f"tcp://{endpoint}")
    try:
        sock.send(frame)
        return sock.recv() if sock.poll(timeout_ms) else None
    finally:
        sock.close()


class _Run:
    """One backend's run: the cluster, the traffic, the faults and what they did."""

    def __init__(self, backend: str, num_requests: int, abort_every: int, seed: int, hosts: Hosts | None = None):
        self.backend = backend
        self.hosts = hosts
        self.num_requests = num_requests
        self.rng = random.Random(seed)
        self.prompts: list[list[int]] = []  # every prompt sent, in order
        self.abort_every = abort_every
        self.events: list[str] = []
        self.forged = {"sent": 0, "accepted": 0}
        self.flood = {"sent": 0, "refused_busy_or_capped": 0}
        self.cluster = LocalCluster(2, 2, cluster=f"chaos-{backend}", node_args=[
            "--transfer-backend", backend, "--kv-placement", "threshold:0", "--prefill-timeout", str(PREFILL_TIMEOUT_S),
            "--holder-timeout", str(PREFILL_TIMEOUT_S), "--lease-ttl", str(LEASE_TTL_S), "--num-kv-blocks", "512"],
            hosts=hosts, placement=dict(HOST_PLACEMENT) if hosts is not None else None)

    def log(self, what: str) -> None:
        self.events.append(f"{time.monotonic() - self.t0:6.2f}s {what}")

    # ---- traffic --------------------------------------------------------------------------------
    def traffic(self, faults_done: threading.Event, bar: tqdm) -> list[dict]:
        """Waves of 24 concurrent requests until every prompt was sent and every fault has happened."""
        conns = {d: NodeConnection(d, self.cluster.nodes[d].info["requests"], 30.0, self.cluster.auth)
                 for d in ("decode-0", "decode-1")}
        results = []
        try:
            wave, start = 24, 0
            while start < self.num_requests or not faults_done.is_set():
                events: queue.Queue = queue.Queue()
                sent = {}
                for i in range(start, start + wave):
                    if i % 4 == 0:  # past num_requests (faults still under way) earlier prompts come again: the
                        # reference's work stays bounded however long the faults take on a loaded machine
                        self.prompts += _prompt_group(self.rng) if i < self.num_requests else \
                            [self.prompts[self.rng.randrange(self.num_requests)] for _ in range(4)]
                    rid = f"c{i}-{uuid.uuid4().hex[:6]}"
                    node = f"decode-{i % 2}"
                    conns[node].submit(nm.GenerateRequest(rid, self.prompts[i], to_wire(GREEDY)), events)
                    sent[rid] = {"index": i, "node": node, "tokens": [], "final": None, "aborted": False,
                                 "t": time.monotonic() - self.t0}
                    if self.abort_every and i % self.abort_every == self.abort_every - 1:
                        time.sleep(0.01)  # let it reach the transfer, then pull the plug
                        conns[node].abort(rid)
                        sent[rid]["aborted"] = True
                deadline = time.monotonic() + 120
                waiting = {r for r, s in sent.items() if not s["aborted"]}
                while waiting and time.monotonic() < deadline:
                    try:
                        event = events.get(timeout=max(0.0, deadline - time.monotonic()))
                    except queue.Empty:
                        break
                    if isinstance(event, NodeLost):
                        continue  # the requests stay without a final event: counted as lost
                    s = sent.get(event.request_id)
                    if s is None:
                        continue
                    s["tokens"] += event.token_ids
                    if event.finished:
                        s["final"] = event
                        waiting.discard(event.request_id)
                results += sent.values()
                bar.update(len(sent))
                start += wave
        finally:
            for conn in conns.values():
                conn.close()
        return results

    # ---- faults ---------------------------------------------------------------------------------------
    def faults(self, stop: threading.Event) -> None:
        stop.wait(1.0)
        if stop.is_set():
            return
        victim = self.cluster.nodes["prefill-0"]
        victim.proc.send_signal(signal.SIGSTOP)
        self.log("SIGSTOP prefill-0")
        stop.wait(PREFILL_TIMEOUT_S + 1.5)
        victim.proc.send_signal(signal.SIGCONT)
        self.log("SIGCONT prefill-0")
        self.forge()
        self.flood_holder()
        stop.wait(1.0)
        if stop.is_set():
            return
        self.cluster.nodes["prefill-1"].kill()
        self.log("SIGKILL prefill-1")
        stop.wait(1.0)
        self.cluster.start_node("prefill", "prefill-1")
        self.log("prefill-1 restarted and registered")
        if self.hosts is not None:
            self.link_faults(stop)

    def link_faults(self, stop: threading.Event) -> None:
        """Between hosts: a slow link into decode-0 (pushes outlive every timeout), then a flapping host 2."""
        host = self.cluster.placement["decode-0"]
        self.hosts.set_rate(host, SLOW_MBIT)
        self.log(f"decode-0's link capped at {SLOW_MBIT} Mbit/s")
        stop.wait(SLOW_S)
        self.hosts.set_rate(host, None)
        self.log("decode-0's link uncapped")
        if stop.is_set():
            return
        host = self.cluster.placement["prefill-0"]
        self.hosts.link_down(host)
        self.log("prefill-0's link down")
        stop.wait(FLAP_S)
        self.hosts.link_up(host)
        self.log("prefill-0's link up")

    def _ask(self, endpoint: str, payload: bytes, channel: ClusterAuth) -> bytes | None:
        return ask_once(endpoint, payload, channel, 5000 if channel is self.cluster.auth else 1000)

    def forge(self) -> None:
        """Messages a process without the token (or with the token but lies) might send."""
        auth, wrong = self.cluster.auth, ClusterAuth("not-the-cluster-token")
        hashes = [bytes(16)] * 4
        for name, node in self.cluster.nodes.items():
            side, requests = node.info["side_channel"], node.info["requests"]
            attempts = [
                (side, m.encode(m.PushRequest("forge-1", "decode-0", "g", [0, 1, 2, 3], hashes, 1000)), wrong),
                (side, wrong.seal(m.encode(m.PushRequest("forge-2", "decode-0", "g", [0, 1, 2, 3], hashes, 1000))),
                 auth),
                (side, auth.seal(m.encode(m.PushRequest("forge-3", "mallory", "g", [0, 1, 2, 3], hashes, 1000))),
                 auth),
                (side, auth.seal(m.encode(m.PushRequest("forge-4", "decode-0", "g", [10**6], hashes[:1], 1000))),
                 auth),
                (requests, encode(nm.GenerateRequest("forge-5", [1, 2, 3], {"max_tokens": 1})), wrong),
                (requests, wrong.seal(encode(nm.GenerateRequest("forge-6", [1, 2, 3], {"max_tokens": 1}))), auth),
            ]
            for endpoint, payload, channel in attempts:
                reply = self._ask(endpoint, payload, channel)
                self.forged["sent"] += 1
                if reply is None or reply == REFUSED:
                    continue
                msg = decode(auth.open(reply))
                if not isinstance(msg, m.Refused):
                    self.forged["accepted"] += 1
                    self.log(f"forged message to {name} was answered with {msg.TYPE}")
        self.log(f"sent {self.forged['sent']} forged messages")

    def flood_holder(self) -> None:
        """Pushes that wait as long as allowed for blocks nobody has, plus some past the cap."""
        auth = self.cluster.auth
        side = self.cluster.nodes["decode-1"].info["side_channel"]
        sock = auth.curve_client(zmq.Context.instance().socket(zmq.DEALER))
        sock.linger = 0
        sock.connect(f"tcp://{side}")
        ids = []
        for i in range(64):
            rid = f"flood-{i}"
            wait = m.MAX_WAIT_MS if i % 8 else m.MAX_WAIT_MS * 1000  # every 8th past the cap: refused
            payload = msgpack_push(rid, wait)
            sock.send(auth.seal(payload))
            ids.append(rid)
            self.flood["sent"] += 1
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and sock.poll(200):
            msg = m.decode(auth.open(sock.recv()))
            if isinstance(msg, m.Refused):
                self.flood["refused_busy_or_capped"] += 1
        for rid in ids:  # clean up: the holder answers each with a final result
            sock.send(auth.seal(m.encode(m.Abort(rid, "flood over"))))
        sock.close()
        self.log(f"flooded decode-1's holder with {self.flood['sent']} long-waiting pushes")

    # ---- the whole run --------------------------------------------------------------------------------
    def run(self, bar: tqdm) -> dict:
        with self.cluster:
            self.t0 = time.monotonic()
            stop, faults_done = threading.Event(), threading.Event()

            def inject() -> None:
                try:
                    self.faults(stop)
                finally:
                    faults_done.set()

            faults = threading.Thread(target=inject, daemon=True)
            faults.start()
            results = self.traffic(faults_done, bar)
            stop.set()
            faults.join()
            self.log("traffic done")
            stats, leaked = self.settle()
            probes = self.probe_kv(results)
        reference, kv_checked, kv_mismatched = _reference(self.prompts, probes)
        aborted = [r for r in results if r["aborted"]]
        finished = [r for r in results if not r["aborted"] and r["final"] is not None]
        completed = [r for r in finished if not r["final"].error]
        corrupted = [r for r in completed if r["tokens"] != reference[r["index"]]]
        return {"requests": len(results), "completed": len(completed),
                "failed_with_error": len(finished) - len(completed), "aborted": len(aborted),
                "lost": len(results) - len(aborted) - len(finished), "corrupted": len(corrupted),
                "kv_checked": kv_checked, "kv_mismatched": len(kv_mismatched),
                "leaked_blocks": leaked, "forged_sent": self.forged["sent"],
                "forged_accepted": self.forged["accepted"], "flood": self.flood,
                "errors": sorted({r["final"].error[:80] for r in finished if r["final"].error}),
                "nodes": stats, "events": self.events,
                "corrupted_detail": [(r["index"], r["node"], round(r["t"], 2), r["final"].stats.as_dict()) for r in corrupted],
                "kv_mismatched_detail": kv_mismatched}

    def probe_kv(self, results: list[dict]) -> dict[int, tuple[str, dict]]:
        """Prompt index -> (decode node, its KV fingerprint of the prompt) for every completed request."""
        probes, seen = {}, set()
        for r in results:
            prompt = self.prompts[r["index"]]
            if r["final"] is not None and not r["final"].error and not r["aborted"] \
                    and (r["node"], tuple(prompt)) not in seen:  # once per prompt and node
                seen.add((r["node"], tuple(prompt)))
                probes[r["index"]] = (r["node"], self.cluster.client(r["node"]).stats(kv_probe=prompt)["kv_probe"])
        return probes

    def settle(self, timeout_s: float = 30.0) -> tuple[dict, int]:
        """Wait until no node holds a referenced block (quarantines lifted); integrity checked on each."""
        deadline = time.monotonic() + timeout_s
        while True:
            # A node's integrity checks run on its engine thread between steps: on a loaded machine (the suite on
            # two processes, a CPU burn) an answer may take longer than a plain stats call's 10 s.
            stats = {n: self._checked_stats(n) for n in self.cluster.nodes}
            leaked = sum(s["num_used_blocks"] + s["num_pinned"] for s in stats.values())
            if leaked == 0 or time.monotonic() > deadline:
                keep = ("num_used_blocks", "num_pinned", "num_quarantined_total", "num_quarantined_blocks",
                        "num_unauthenticated", "num_transfers_refused", "num_refused_writes", "num_fallbacks",
                        "num_prefill_refusals", "num_tainted_swapped", "num_remote", "num_aborted",
                        "num_prefills", "num_pending_pushes", "num_failed_steps")
                return {n: {k: s[k] for k in keep if k in s} for n, s in stats.items()}, leaked
            time.sleep(0.2)


    def _checked_stats(self, node_id: str) -> dict:
        """A node's stats after its integrity checks; a node that does not answer dumps its threads' stacks (to
        its stderr: this run's log) before the error is raised."""
        try:
            return self.cluster.client(node_id).stats(check=True, timeout_s=60.0)
        except RequestFailed:
            proc = self.cluster.nodes[node_id].proc
            if proc.poll() is None:
                proc.send_signal(signal.SIGUSR1)
                time.sleep(1.0)  # the dump is written by the node's own signal handler
            raise


def _run_on_hosts(backend: str, num_requests: int, abort_every: int, seed: int, bar: tqdm) -> dict:
    ok, why = can_create()
    if not ok:
        raise HostsError(f"bench chaos --hosts: {why}")
    pid = os.getpid()
    saved = os.environ.get("MC_TRANSFER_TIMEOUT")
    os.environ["MC_TRANSFER_TIMEOUT"] = "5"  # the nodes' Mooncake ends a batch before the slow link drains it
    try:
        with Hosts(len(set(HOST_PLACEMENT.values())), prefix=f"kc{pid % 100000}", subnet=f"10.81.{pid % 250}") as h:
            return _Run(backend, num_requests, abort_every, seed, hosts=h).run(bar)
    finally:
        if saved is None:
            os.environ.pop("MC_TRANSFER_TIMEOUT", None)
        else:
            os.environ["MC_TRANSFER_TIMEOUT"] = saved


def _reference(prompts: list[list[int]], probes: dict[int, tuple[str, dict]]
               ) -> tuple[list[list[int]], int, list[tuple[int, str, list[int]]]]:
    """The single-node engine on the same weights (the independent reference): its greedy outputs, how many
    probed blocks it compared, and the (prompt, node, positions) whose KV on the node differs from its own."""
    from kvmesh import LLM
    from kvmesh.engine.kv_probe import compare_with_engine

    llm = LLM("tiny-llama", num_kv_blocks=4096, progress=False)
    unique = list(dict.fromkeys(map(tuple, prompts)))  # a prompt sent again is computed once
    by_prompt = dict(zip(unique, (o.token_ids for o in llm.generate([list(u) for u in unique], GREEDY,
                                                                      use_tqdm=False))))
    outputs = [by_prompt[tuple(p)] for p in prompts]
    order = sorted(probes)
    checked, bad = compare_with_engine(llm, [(prompts[i], probes[i][1]) for i in order])
    return outputs, checked, [(order[i], probes[order[i]][0], positions) for i, positions in bad]


def msgpack_push(request_id: str, wait_ms: int) -> bytes:
    """A push request for blocks nobody holds, from decode-0 (encoded by hand: past the cap it would not validate)."""
    import msgpack

    return msgpack.packb({"type": "push_request", "request_id": request_id, "requester_id": "decode-0",
                          "grant_id": "flood", "dst_block_ids": [0], "block_hashes": [uuid.uuid4().bytes],
                          "deadline_ms": wait_ms, "wait_ms": wait_ms}, use_bin_type=True)


def run(json_path: str | None, backends: list[str] | None = None, num_requests: int = 240,
        abort_every: int = 10, seed: int = 0, hosts: bool = False) -> dict:
    """``hosts``: the nodes on simulated hosts with link faults (needs root and ``ip netns``)."""
    backends = backends or (["mooncake", "zmq"] if mooncake_available() else ["zmq"])
    out = {"machine": machine(), "model": "tiny-llama", "prefill_timeout_s": PREFILL_TIMEOUT_S,
           "hosts": len(set(HOST_PLACEMENT.values())) if hosts else 0, "backends": {}}
    with tqdm(desc="chaos requests", leave=False) as bar:
        for backend in backends:
            if hosts:
                out["backends"][backend] = _run_on_hosts(backend, num_requests, abort_every, seed, bar)
            else:
                out["backends"][backend] = _Run(backend, num_requests, abort_every, seed).run(bar)
    cols = ["requests", "completed", "failed_with_error", "aborted", "lost", "corrupted", "kv_checked",
            "kv_mismatched", "leaked_blocks", "forged_accepted"]
    print_table("chaos: faults during serving (must be 0: lost, corrupted, kv_mismatched, leaked_blocks, "
                "forged_accepted)",
                ["backend", *cols], [[b, *(r[c] for c in cols)] for b, r in out["backends"].items()])
    for backend, r in out["backends"].items():
        print(f"{backend}: " + "; ".join(r["events"]))
    write_json(json_path, out)
    return out
