"""The router's limits and endings against one running cluster: stop strings across tokens, silent nodes,
admission at the router's limit, taken ports, cut-off answers, documented fields and caps."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import threading
import time
import urllib.error
import urllib.request

import grpc
import pytest

from kvmesh import SamplingParams
from kvmesh.cluster.router import Router, RouterConfig

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
from tests.router_support import _post


def _sse_text(url: str, body: dict) -> tuple[str, list]:
    """A streamed completion's text and its finish reasons (raw SSE, every event read)."""
    req = urllib.request.Request(url + "/v1/completions", json.dumps({**body, "stream": True}).encode(),
                                 {"Content-Type": "application/json"})
    events = []
    with urllib.request.urlopen(req, timeout=60) as r:
        for line in r:
            line = line.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    choices = [e["choices"][0] for e in events if e.get("choices")]
    return "".join(c["text"] for c in choices), [c["finish_reason"] for c in choices if c["finish_reason"]]


def test_a_stop_string_spanning_tokens_sends_no_part_of_itself(served, reference):
    """The tiny model's tokens are bytes: a three-character stop string spans three tokens. Text that could
    begin it is held back, so the answer ends exactly where the stop string starts, streamed or not, and
    the largest seed is accepted."""
    from kvmesh.cluster.router import first_stop, stop_prefix_len

    assert stop_prefix_len("a, 6,", (", 6,7",)) == 4 and stop_prefix_len("a, 6", (" 7", ", 6,")) == 3
    assert stop_prefix_len("abc", ("xyz",)) == 0 and first_stop("a 7 b 7", (" b", " 7"), 2) == 3
    ids = list(range(40, 100))
    full = reference(ids, SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)).text
    start = next(i for i in range(3, len(full) - 3) if all(c.isascii() and c.isprintable() for c in full[i:i + 3])
                 and full.find(full[i:i + 3]) == i)
    needle = full[start:start + 3]
    want = full[:start]
    router = served["router"]
    chunks = list(router.generate(ids, SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True,
                                                      stop=(needle, "never " + needle))))
    assert "".join(c.text for c in chunks) == want and chunks[-1].finish_reason == "stop"
    body = {"prompt": ids, "max_tokens": 60, "temperature": 0, "ignore_eos": True, "stop": [needle],
            "seed": 2**63 - 1}
    assert _sse_text(served["http"], body) == (want, ["stop"])
    status, payload = _post(served["http"] + "/v1/completions", json.dumps(body).encode())
    assert status == 200 and payload["choices"][0]["text"] == want


def test_a_silent_node_ends_the_stream_with_a_timeout_and_its_request_is_aborted(served):
    """Both decode nodes stopped (SIGSTOP) for longer than the router's request timeout: the stream ends with
    RequestTimeout, a KvmeshError (a 503 / an SSE error event / UNAVAILABLE at the front ends), never a hang;
    once the nodes run again, the request is gone from them."""
    import signal

    from kvmesh.cluster.router import RequestTimeout
    from kvmesh.errors import KvmeshError

    cluster = served["cluster"]
    router = Router(RouterConfig(etcd=cluster.etcd_endpoint, cluster_token=cluster.token, cluster="router",
                                 request_timeout_s=1.0, liveness_s=120.0))
    decode = [node for node in cluster.nodes.values() if node.role == "decode"]
    try:
        for node in decode:
            os.kill(node.proc.pid, signal.SIGSTOP)
        started = time.monotonic()
        try:
            with pytest.raises(RequestTimeout, match="sent nothing for 1 s") as err:
                list(router.generate(list(range(10, 50)), SamplingParams(max_tokens=200, ignore_eos=True)))
            assert isinstance(err.value, KvmeshError) and time.monotonic() - started < 30
        finally:
            for node in decode:
                os.kill(node.proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + 30
        while any(cluster.client(n.node_id).stats()["num_running"] for n in decode):
            assert time.monotonic() < deadline, "the timed-out request kept running on its node"
            time.sleep(0.05)
    finally:
        router.close()


def test_grpc_admits_the_routers_limit_refuses_past_it_and_answers_health_meanwhile(served):
    """With the decode nodes stopped, 70 streams (more than a fixed pool of 64 threads) are all admitted and
    held; the 71st is RESOURCE_EXHAUSTED at once, and health checks are answered while the router is full."""
    import signal

    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from kvmesh.cluster.grpc_server import pb, pb_grpc, start_grpc_server

    cluster = served["cluster"]
    limit = 70
    router = Router(RouterConfig(etcd=cluster.etcd_endpoint, cluster_token=cluster.token, cluster="router",
                                 max_in_flight=limit, max_in_flight_per_client=limit, liveness_s=120.0))
    server, port = start_grpc_server(router, "127.0.0.1:0")
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = pb_grpc.RouterStub(channel)
    decode = [node for node in cluster.nodes.values() if node.role == "decode"]
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=list(range(10, 30))),
                                 sampling=pb.SamplingParams(max_tokens=4, ignore_eos=True))
    calls = []
    try:
        for node in decode:
            os.kill(node.proc.pid, signal.SIGSTOP)
        try:
            calls = [stub.Generate(request, timeout=60) for _ in range(limit)]
            deadline = time.monotonic() + 30
            while router._in_flight < limit:
                assert time.monotonic() < deadline, f"only {router._in_flight} of {limit} streams were admitted"
                time.sleep(0.05)
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Generate(request, timeout=10))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
        finally:
            for node in decode:
                os.kill(node.proc.pid, signal.SIGCONT)
        for call in calls:
            assert sum(len(r.token_ids) for r in call) == 4
    finally:
        for call in calls:
            call.cancel()
        channel.close()
        server.stop(grace=1)
        router.close()


def test_a_taken_port_is_refused_before_anything_starts(served):
    """gRPC never shares a port (no SO_REUSEPORT): a second server on the first's port fails with one line,
    and ``kvmesh serve`` on a taken port exits with that line before it starts etcd or a node."""
    import subprocess
    import sys

    from kvmesh.cluster.grpc_server import start_grpc_server
    from kvmesh.errors import KvmeshError

    port = int(served["grpc"].rsplit(":", 1)[1])
    with pytest.raises(KvmeshError, match="gRPC cannot listen on 127.0.0.1:%d" % port):
        start_grpc_server(served["router"], f"127.0.0.1:{port}")
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "kvmesh.cli", "serve", "--model", "tiny-llama", "--grpc-port",
                          str(port), "--http-port", "0"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and f"--grpc-port: 127.0.0.1:{port} is taken" in out.stderr, out.stderr
    assert "starting etcd" not in out.stderr and "Traceback" not in out.stderr
    http_port = int(served["http"].rsplit(":", 1)[1])
    out = subprocess.run([sys.executable, "-m", "kvmesh.cli", "serve", "--model", "tiny-llama", "--grpc-port", "0",
                          "--http-port", str(http_port)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and f"--http-port: 127.0.0.1:{http_port} is taken" in out.stderr, out.stderr
    assert time.monotonic() - started < 60


@contextlib.contextmanager
def http_front_end(router):
    """The OpenAI HTTP front end of ``router`` on a free port, on a loop thread of its own; yields its URL."""
    from kvmesh.cluster.http_server import start_http_server

    loop = asyncio.new_event_loop()
    runner, port = loop.run_until_complete(start_http_server(router, "127.0.0.1", 0))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def _num_first_tokens(router) -> float:
    return next(s.value for m in router.metrics.ttft.collect() for s in m.samples if s.name.endswith("_count"))


def test_a_non_streamed_answer_cut_off_midway_is_a_503_never_a_partial_200(served):
    """A non-streamed completion whose decode nodes fall silent after its first token (SIGSTOP, past the
    router's request timeout): the client gets a 503 saying the answer was cut off, not the text so far."""
    import signal

    cluster = served["cluster"]
    router = Router(RouterConfig(etcd=cluster.etcd_endpoint, cluster_token=cluster.token, cluster="router",
                                 request_timeout_s=1.0, liveness_s=120.0))
    decode = [node for node in cluster.nodes.values() if node.role == "decode"]
    answer: dict = {}
    try:
        with http_front_end(router) as url:
            body = json.dumps({"prompt": list(range(20, 60)), "max_tokens": 900, "temperature": 0,
                               "ignore_eos": True}).encode()
            asking = threading.Thread(target=lambda: answer.update(zip(("status", "body"), _post(
                url + "/v1/completions", body))))
            asking.start()
            deadline = time.monotonic() + 60
            while _num_first_tokens(router) < 1:  # the answer has begun
                assert time.monotonic() < deadline, "no first token"
                time.sleep(0.01)
            for node in decode:
                os.kill(node.proc.pid, signal.SIGSTOP)
            try:
                asking.join(30)
            finally:
                for node in decode:
                    os.kill(node.proc.pid, signal.SIGCONT)
        assert answer["status"] == 503 and "cut off" in answer["body"]["error"]["message"], answer
    finally:
        router.close()


def test_documented_request_fields_and_limits(served, monkeypatch):
    """``max_completion_tokens``, ``continuous_usage_stats``, the context boundary (prompt + max_tokens equal to
    the context is served, one more is a 400) and the pin cap (a quarter of the smallest decode node's blocks)."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=served["http"] + "/v1", api_key="unused")
    router = served["router"]
    out = client.completions.create(model="tiny-llama", prompt="abc", temperature=0.0,
                                    extra_body={"max_completion_tokens": 3, "ignore_eos": True})
    assert out.usage.completion_tokens == 3 and out.choices[0].finish_reason == "length"
    stream = client.completions.create(model="tiny-llama", prompt="abc", max_tokens=4, temperature=0.0, stream=True,
                                       stream_options={"include_usage": True, "continuous_usage_stats": True},
                                       extra_body={"ignore_eos": True})
    chunks = list(stream)
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].usage.completion_tokens == 4  # usage on the choice's last chunk too
    assert chunks[-1].usage.completion_tokens == 4 and chunks[-1].choices == []
    prompt = list(range(10, 20))
    fits = router.max_model_len - len(prompt)
    router.validate(prompt, SamplingParams(max_tokens=fits))
    status, payload = _post(served["http"] + "/v1/completions",
                            json.dumps({"prompt": prompt, "max_tokens": fits + 1}).encode())
    assert status == 400 and "exceeds the context" in payload["error"]["message"]
    decode_blocks = [r.kv_layout.num_blocks for r in router.directory.nodes.values() if r.role == "decode"]
    assert router.max_pinned_blocks() == min(decode_blocks) // 4
    monkeypatch.setattr(router, "max_pinned_blocks", lambda: 3)  # the cap's arithmetic at a small size
    pinned = router.pin(list(range(1, 33)), "two blocks")
    try:
        assert pinned["num_blocks"] == 2
        from kvmesh.errors import InvalidRequestError

        with pytest.raises(InvalidRequestError, match="would pin 4 blocks: at most 3"):
            router.pin(list(range(100, 132)), "two more")
        # Listing and unpinning ask the store: a pin this mirror has not seen yet is listed and unpinned.
        monkeypatch.setattr(router.pin_registry, "snapshot", lambda: {})
        assert pinned["id"] in [p["id"] for p in router.pins()]
    finally:
        assert router.unpin(pinned["id"])
    deadline = time.monotonic() + 30
    while any(served["cluster"].client(n).stats()["num_pinned"] for n in served["cluster"].nodes):
        assert time.monotonic() < deadline, "the pin outlived its unpinning"
        time.sleep(0.05)



def test_kvmesh_status_shows_the_cluster_and_the_last_minutes_sources(served, capsys):
    """``kvmesh status --once --json`` and its table against the running cluster: every node with its role and
    KV, the router's load, and requests finished in the last minute by prompt-token source."""
    from kvmesh.cli import main

    body = json.dumps({"model": "tiny-llama", "prompt": list(range(40, 90)), "max_tokens": 4,
                       "temperature": 0}).encode()
    assert _post(served["http"] + "/v1/completions", body)[0] == 200
    assert main(["status", "--url", served["http"], "--once", "--json"]) == 0
    view = json.loads(capsys.readouterr().out)
    assert sorted((n["node_id"], n["role"]) for n in view["nodes"]) == [
        ("decode-0", "decode"), ("decode-1", "decode"), ("prefill-0", "prefill")]
    assert all(n["answering"] and n["kv_blocks"] > 0 for n in view["nodes"])
    recent = view["recent"]
    assert recent["num_requests"] >= 1 and sum(recent["prompt_tokens"].values()) >= 50
    assert view["max_in_flight"] == served["router"].cfg.max_in_flight
    assert main(["status", "--url", served["http"], "--once"]) == 0
    table = capsys.readouterr().out
    assert "decode-1" in table and "prompt tokens by source" in table
    assert any(f"{source} {count} (" in table for source, count in recent["prompt_tokens"].items() if count)
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens there now
    assert main(["status", "--url", f"http://127.0.0.1:{port}", "--once"]) == 1
    assert "cannot reach the router" in capsys.readouterr().err
