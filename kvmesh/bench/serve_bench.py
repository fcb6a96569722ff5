"""``kvmesh bench serve``: OpenAI endpoints under one streaming client, side by side.

Drives ``/v1/completions`` (token-id prompts, greedy, ``ignore_eos``, streamed) of each target
with the same shared-prefix workload at a fixed concurrency, targets taking turns per round (the order
reversed every other round), and reports TTFT, ITL and TPOT percentiles and throughput per target, with each
target's ratio to the first. By default (``--alive one``) each target this starts is started for its turn and
stopped after it, so that no target idles beside another's turn and no start order favours one; ``--alive all``
starts every target first. Targets:

- ``kvmesh``: ``kvmesh serve`` started here (``--serve-args`` added to its command line; ``kvmesh ARGS``:
  with ARGS added too, so that two configurations meet in one run);
- ``llama.cpp``: llama.cpp's ``llama-server`` started here (``--llama-server``, ``--gguf``,
  ``--slots``; ``llama.cpp ARGS``: with ARGS added, ``-t 2`` say), the peer on the same weights;
- ``NAME=URL``: an endpoint already running (its base URL, ending in ``/v1``).

Every process this starts is stopped when it ends, however it ends.
"""
from __future__ import annotations

import bisect
import http.client
import json
import os
import random
import shlex
import signal
import subprocess
import sys
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from collections import defaultdict
from contextlib import ExitStack, contextmanager
from typing import NamedTuple

from kvmesh.bench import workloads as wl
from kvmesh.bench import memory_warmup
from kvmesh.bench.report import percentile


class Stream(NamedTuple):
    ttft_s: float
    e2e_s: float
    itl_s: list[float]  # between successive chunks that carried tokens
    num_tokens: int
    sent_at: float = 0.0  # when the request was sent (the client's perf_counter)
    arrivals: tuple[float, ...] = ()  # when each token's chunk came (same clock)


class Target(NamedTuple):
    name: str
    base_url: str  # http://host:port/v1
    pid: int | None = None  # the server's process, when this benchmark started it


def _post_stream(base_url: str, body: dict, timeout_s: float) -> Stream:
    """One streamed completion; raises RuntimeError on an HTTP error or an error event."""
    url = urllib.parse.urlsplit(base_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=timeout_s)
    start = time.perf_counter()
    try:
        conn.request("POST", url.path.rstrip("/") + "/completions", json.dumps(body),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"{base_url}: HTTP {resp.status}: {resp.read(500)!r}")
        arrivals, usage = [], None  # when chunks that may carry tokens came
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                raise RuntimeError(f"{base_url}: {event['error']}")
            usage = event.get("usage") or usage
            if any(c.get("text") or c.get("finish_reason") is None for c in event.get("choices") or ()):
                arrivals.append(time.perf_counter())
        end = time.perf_counter()
        num_tokens = (usage or {}).get("completion_tokens") or len(arrivals)
        # A closing chunk may flush text held back (incomplete UTF-8) without a token of its own: chunks beyond
        # the token count are such flushes.
        arrivals = arrivals[:num_tokens]
        itl = [b - a for a, b in zip(arrivals, arrivals[1:])]
        return Stream(arrivals[0] - start if arrivals else 0.0, end - start, itl, num_tokens, start, tuple(arrivals))
    finally:
        conn.close()


def drive(target: Target, model: str, requests: list[wl.BenchRequest], concurrency: int,
          timeout_s: float = 600.0) -> tuple[list[Stream], float, float]:
    """Send every request, ``concurrency`` at a time; returns the streams, the wall seconds and the CPU seconds
    this client spent (it shares the machine with what it measures)."""
    def one(req: wl.BenchRequest) -> Stream:
        return _post_stream(target.base_url, {"model": model, "prompt": req.prompt_ids, "max_tokens": req.max_tokens,
                                              "temperature": 0.0, "stream": True, "ignore_eos": True,
                                              "stream_options": {"include_usage": True}}, timeout_s)

    start, cpu = time.perf_counter(), time.process_time()
    with ThreadPoolExecutor(concurrency) as pool:
        streams = list(pool.map(one, requests))
    return streams, time.perf_counter() - start, time.process_time() - cpu


def summarize(streams: list[Stream], seconds: float, client_cpu_s: float = 0.0) -> dict:
    ttft = [s.ttft_s * 1e3 for s in streams]
    itl = [x * 1e3 for s in streams for x in s.itl_s]
    tpot = [(s.e2e_s - s.ttft_s) / (s.num_tokens - 1) * 1e3 for s in streams if s.num_tokens > 1]
    out = {"requests": len(streams), "seconds": seconds, "client_cpu_share": client_cpu_s / seconds if seconds else 0.0,
           "output_tok_s": sum(s.num_tokens for s in streams) / seconds if seconds else 0.0}
    for name, values in (("ttft", ttft), ("itl", itl), ("tpot", tpot)):
        for q in (50, 90, 99):
            out[f"{name}_p{q}_ms"] = percentile(values, q / 100)
    out["itl_max_ms"] = max(itl, default=0.0)  # the longest stall any stream saw
    out.update(gaps_beside_prompts(streams))
    return out


def gaps_beside_prompts(streams: list[Stream]) -> dict:
    """Inter-token gaps split by whether another request's prompt was pending during them (sent, its first
    token not yet back): what a server's ITL tail is made of, read from the client side alone (any server).
    A gap beside a prompt is one where that server may have computed the prompt between two of this stream's
    tokens; a decode-only gap is one where no request was waiting for its first token."""
    pending = sorted((s.sent_at, s.arrivals[0]) for s in streams if s.arrivals)
    starts = [sent_at for sent_at, _ in pending]
    beside, alone = [], []
    for s in streams:
        for a, b in zip(s.arrivals, s.arrivals[1:]):
            # a prompt sent before the gap ended whose first token came after it began (never the stream's own:
            # its first token came before any of its gaps)
            hit = any(first > a for _, first in pending[:bisect.bisect_left(starts, b)])
            (beside if hit else alone).append((b - a) * 1e3)
    total = len(beside) + len(alone)
    return {"itl_beside_prompt_share": len(beside) / total if total else 0.0,
            "itl_beside_prompt_p99_ms": percentile(beside, 0.99), "itl_decode_only_p99_ms": percentile(alone, 0.99)}


def _wait_http(base_url: str, path: str, timeout_s: float, proc: subprocess.Popen) -> None:
    """Until GET ``path`` answers 200 (the server loaded its model), or the process died."""
    url = urllib.parse.urlsplit(base_url)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited ({proc.returncode}) before it was ready")
        conn = http.client.HTTPConnection(url.hostname, url.port, timeout=5)
        try:
            conn.request("GET", path)
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        finally:
            conn.close()
        time.sleep(0.2)  # the condition is polled: a model load takes what it takes
    raise TimeoutError(f"{base_url}{path} not ready within {timeout_s:.0f} s")


def node_decode_steps(base_url: str) -> dict[str, dict[str, dict[str, float]]]:
    """A kvmesh server's decode-only steps per node by the compute threads they ran on (its ``/metrics``):
    node -> threads -> {"steps": N, "mean_ms": M}."""
    url = urllib.parse.urlsplit(base_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    found: dict[tuple[str, str], dict[str, float]] = {}
    for line in text.splitlines():
        for name, key in (("kvmesh_node_decode_steps{", "steps"), ("kvmesh_node_decode_step_seconds{", "seconds")):
            if line.startswith(name):
                labels, value = line[len(name):].rsplit("} ", 1)
                parts = {k: v.strip('"') for k, v in (item.split("=", 1) for item in labels.split(","))}
                found.setdefault((parts["node"], parts["threads"]), {})[key] = float(value)
    out: dict[str, dict[str, dict[str, float]]] = {}
    for (node, threads), v in sorted(found.items()):
        steps = int(v.get("steps", 0))
        out.setdefault(node, {})[threads] = {"steps": steps,
                                             "mean_ms": v.get("seconds", 0.0) / steps * 1e3 if steps else 0.0}
    return out


@contextmanager
def _process(cmd: list[str], **kwargs):
    """A child in its own process group, stopped when the block ends: SIGTERM to it (it stops its own children in
    order), then SIGKILL to the whole group if it has not ended within a minute. If this process dies first (even
    by SIGKILL), the kernel sends the child SIGTERM."""
    from kvmesh.lifecycle import die_with_parent

    proc = subprocess.Popen(cmd, start_new_session=True, preexec_fn=die_with_parent(), **kwargs)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever of the group is left
        except ProcessLookupError:
            pass
        proc.wait()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def kvmesh_serve(name: str, model: str, extra_args: list[str], timeout_s: float):
    cmd = [sys.executable, "-m", "kvmesh.cli", "serve", "--model", model, "--grpc-port", "0", "--http-port", "0",
           *extra_args]
    with _process(cmd, stdout=subprocess.PIPE, text=True) as proc:
        line = proc.stdout.readline()  # the ready line, once the nodes registered and the front ends listen
        if not line:
            raise RuntimeError(f"kvmesh serve exited ({proc.wait()}) before it was ready")
        base_url = json.loads(line)["http"]
        _wait_http(base_url, "/ready", timeout_s, proc)
        yield Target(name, base_url, proc.pid)


@contextmanager
def llama_server(name: str, binary: str, gguf: str, slots: int, ctx_per_slot: int, extra_args: list[str],
                 timeout_s: float):
    port = _free_port()
    cmd = [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-np", str(slots),
           "-c", str(slots * ctx_per_slot), "--no-webui", *extra_args]
    with _process(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) as proc:
        base_url = f"http://127.0.0.1:{port}/v1"
        _wait_http(base_url, "/health", timeout_s, proc)
        yield Target(name, base_url, proc.pid)


def workload(args, vocab: int) -> list[wl.BenchRequest]:
    """Shared-prefix prompts of ordinary token ids (the lowest and highest ids, special tokens among them, left out)."""
    margin = min(256, vocab // 8)
    requests = wl.shared_prefix(args.groups, args.per_group, args.system_len, args.question_len, args.output_len,
                                vocab - 2 * margin, args.seed)
    for req in requests:
        req.prompt_ids = [t + margin for t in req.prompt_ids]
    random.Random(args.seed).shuffle(requests)
    return requests


def run(args) -> dict:
    from kvmesh.bench.report import machine, print_table, write_json
    from kvmesh.lifecycle import stop_on_sigterm

    stop_on_sigterm()  # SIGTERM unwinds like Ctrl-C: every server this run started is stopped
    from kvmesh.model.card import load_tokenizer

    vocab = load_tokenizer(args.model).config.vocab_size
    # Each round its own prompts (a repeated prompt would be a full cache hit); the warm-up's are never used again.
    rounds = [workload(_with(args, seed=args.seed + 1 + r), vocab) for r in range(args.rounds)]
    warmup = workload(_with(args, seed=args.seed, groups=1, per_group=args.concurrency), vocab)
    names = [t.strip() for t in args.targets.split(",") if t.strip()]
    if not names:
        raise SystemExit("kvmesh bench serve: --targets names none")
    res: dict = {"machine": machine(), "model": args.model, "concurrency": args.concurrency,
                 "workload": {"groups": args.groups, "per_group": args.per_group, "system_len": args.system_len,
                              "question_len": args.question_len, "output_len": args.output_len},
                 "rounds": args.rounds, "targets": {}}
    ctx_per_slot = args.system_len + args.question_len + args.output_len + 64
    memory_warmup.warm_up(args.touch_memory_gib, res)  # every target starts on memory touched before
    clock = time.monotonic()
    # by target name, in the order of --targets (every first turn, and every start with --alive all, follows it)
    streams: dict[str, list[Stream]] = defaultdict(list)
    seconds: dict[str, float] = defaultdict(float)
    client_cpu: dict[str, float] = defaultdict(float)
    res["alive"], res["turns"] = args.alive, []
    server_pids: list[int] = []  # of every server this run started
    with ExitStack() as whole_run:
        started: dict[str, Target] = {}
        if args.alive == "all":  # every target started first and alive throughout
            for name in names:
                started[name] = _open_target(whole_run, name, args, ctx_per_slot, res)
            server_pids += [t.pid for t in started.values() if t.pid is not None]
            for name in names:
                drive(started[name], args.model, warmup, args.concurrency)  # first-request costs, the warm-up prefix
        for r, requests in enumerate(rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                turn = {"round": r + 1, "start_s": time.monotonic() - clock}
                with ExitStack() as this_turn:
                    target = started.get(name)
                    if target is None:  # started for this turn only, stopped when it ends
                        target = _open_target(this_turn, name, args, ctx_per_slot, res)
                        drive(target, args.model, warmup, args.concurrency)
                    turn["target"] = target.name
                    if target.pid is not None:
                        server_pids.append(target.pid)
                    turn["servers_alive_beside"] = sum(_alive(pid) for pid in set(server_pids) - {target.pid})
                    print(f"round {r + 1}/{args.rounds}: {target.name} ...", file=sys.stderr)
                    got, secs, cpu = drive(target, args.model, requests, args.concurrency)
                    streams[target.name] += got
                    seconds[target.name] += secs
                    client_cpu[target.name] += cpu
                    if args.alive != "all" and name.split()[0] == "kvmesh":
                        _add_decode_steps(res["targets"][target.name], node_decode_steps(target.base_url))
                turn["end_s"] = time.monotonic() - clock  # after the target stopped, when it was this turn's
                res["turns"].append(turn)
        for name, target in started.items():
            if name.split()[0] == "kvmesh":  # what its decode-only steps ran on (kvmesh/node/decode_threads.py)
                _add_decode_steps(res["targets"][target.name], node_decode_steps(target.base_url))
    for name, got in streams.items():
        res["targets"][name].update(summarize(got, seconds[name], client_cpu[name]))
    first = next(iter(streams))
    rows = []
    for name in streams:
        t, base = res["targets"][name], res["targets"][first]
        ratios = {f"{k}_vs_{first}": t[k] / base[k] if base[k] else 0.0
                  for k in ("ttft_p50_ms", "itl_p50_ms", "tpot_p50_ms", "output_tok_s")}
        t.update(ratios)
        rows.append([name, f"{t['ttft_p50_ms']:.0f}", f"{t['ttft_p99_ms']:.0f}", f"{t['itl_p50_ms']:.1f}",
                     f"{t['itl_p99_ms']:.1f}", f"{t['itl_max_ms']:.0f}", f"{t['tpot_p50_ms']:.1f}",
                     f"{t['output_tok_s']:.0f}", f"{t['itl_beside_prompt_share']:.2f}",
                     f"{t['itl_beside_prompt_p99_ms']:.1f}", f"{t['itl_decode_only_p99_ms']:.1f}",
                     f"{ratios[f'ttft_p50_ms_vs_{first}']:.2f}x", f"{ratios[f'itl_p50_ms_vs_{first}']:.2f}x",
                     f"{t['client_cpu_share']:.2f}"])
    print_table(f"{args.model}, concurrency {args.concurrency}, {len(rounds[0])} requests x {args.rounds} rounds "
                f"({args.groups} prefixes of {args.system_len} tokens)",
                ["target", "TTFT p50 ms", "p99", "ITL p50 ms", "p99", "max", "TPOT p50 ms", "out tok/s",
                 "gaps beside a prompt", "their ITL p99", "decode-only ITL p99",
                 f"TTFT vs {first}", f"ITL vs {first}", "client CPU (cores)"], rows)
    write_json(args.json, res)
    return res


def _open_target(stack: ExitStack, name: str, args, ctx_per_slot: int, res: dict) -> Target:
    """Target ``name`` of ``--targets`` ready to drive, started (when this benchmark starts it) inside ``stack``,
    which stops it; its command or URL recorded in ``res``."""
    print(f"starting {name} ...", file=sys.stderr)
    if name.split()[0] == "kvmesh":
        extra = shlex.split(args.serve_args) + shlex.split(name)[1:]
        res["targets"].setdefault(name, {})["command"] = shlex.join(["kvmesh", "serve", "--model", args.model, *extra])
        return stack.enter_context(kvmesh_serve(name, args.model, extra, args.start_timeout))
    if name.split()[0] == "llama.cpp":
        if not args.llama_server or not args.gguf:
            raise SystemExit("kvmesh bench serve: the llama.cpp target needs --llama-server and --gguf")
        extra = shlex.split(name)[1:]
        res["targets"].setdefault(name, {}).update(gguf=os.path.basename(args.gguf), slots=args.slots,
                                                   arguments=shlex.join(extra))
        return stack.enter_context(llama_server(name, args.llama_server, args.gguf, args.slots, ctx_per_slot, extra,
                                                args.start_timeout))
    if "=" in name:
        label, url = name.split("=", 1)
        res["targets"].setdefault(label, {})["url"] = url
        return Target(label, url)
    raise SystemExit(f"kvmesh bench serve: unknown target {name!r} (kvmesh, llama.cpp or NAME=URL)")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _add_decode_steps(record: dict, steps: dict[str, dict[str, dict[str, float]]]) -> None:
    """Adds one server life's decode steps (``node_decode_steps``) into a target's ``decode_steps_by_threads``."""
    into = record.setdefault("decode_steps_by_threads", {})
    for node, by_threads in steps.items():
        for threads, v in by_threads.items():
            have = into.setdefault(node, {}).setdefault(threads, {"steps": 0, "mean_ms": 0.0})
            total = have["steps"] + v["steps"]
            if total:
                have["mean_ms"] = (have["mean_ms"] * have["steps"] + v["mean_ms"] * v["steps"]) / total
            have["steps"] = total


def _with(args, **changes):
    return type(args)(**{**vars(args), **changes})


def add_arguments(p) -> None:
    p.add_argument("--json", default=None)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--targets", default="kvmesh",
                   help="comma-separated: kvmesh (kvmesh serve started here; 'kvmesh ARGS' with ARGS added), "
                        "llama.cpp (llama-server started here; 'llama.cpp ARGS' with ARGS added), NAME=URL (a running endpoint's base URL); ratios are "
                        "to the first")
    p.add_argument("--serve-args", default="", help="added to the kvmesh serve command line")
    p.add_argument("--llama-server", default=None, help="path of llama.cpp's llama-server binary")
    p.add_argument("--gguf", default=None, help="the GGUF file llama-server loads (the same weights as --model)")
    p.add_argument("--slots", type=int, default=4, help="llama-server's parallel slots (-np)")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--groups", type=int, default=4, help="distinct shared prefixes")
    p.add_argument("--per-group", type=int, default=8, help="prompts per prefix")
    p.add_argument("--system-len", type=int, default=512, help="tokens of each shared prefix")
    p.add_argument("--question-len", type=int, default=32, help="tokens after it, different per prompt")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2, help="every target runs the workload this many times, in turns")
    p.add_argument("--alive", choices=("one", "all"), default="one",
                   help="one: each target started for its turn and stopped after it, so none idles beside another's "
                        "turn and no start order favours one; all: every target started first and alive throughout "
                        "(faster)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds a target may take to start")
    memory_warmup.add_argument(p, "any target starts")
