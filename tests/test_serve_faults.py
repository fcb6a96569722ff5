"""`kvmesh serve` as a real process keeps serving through node and etcd deaths, and never reports a cut-off
answer as complete."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from kvmesh import LLM, SamplingParams

_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class Serve:
    """``kvmesh serve --model tiny-llama`` on free ports; ``process(name)`` reads /ready's supervisor view."""

    def __init__(self, *args: str, api_key: str = ""):
        self.proc = subprocess.Popen([sys.executable, "-m", "kvmesh.cli", "serve", "--model", "tiny-llama",
                                      "--dtype", "float32",
                                      "--grpc-port", "0", "--http-port", "0", "--routing", "round-robin", *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        endpoints = json.loads(self.proc.stdout.readline())
        self.url, self.grpc = endpoints["http"].removesuffix("/v1"), endpoints["grpc"]
        self.headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key
                                                               else {})}

    def ready(self) -> tuple[int, dict]:
        try:
            with _NO_PROXY.open(self.url + "/ready", timeout=10) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def process(self, name: str) -> dict:
        return self.ready()[1]["supervisor"]["nodes"][name]

    def stream(self, prompt: list[int], max_tokens: int, events: list[str] | None = None) -> list[str]:
        """The SSE events of a streaming completion (ignore_eos, greedy), in order; appended to ``events`` as
        they arrive when given, so another thread can wait for the stream to have started."""
        body = json.dumps({"model": "tiny-llama", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                           "ignore_eos": True, "stream": True}).encode()
        req = urllib.request.Request(self.url + "/v1/completions", body, self.headers)
        events = [] if events is None else events
        with _NO_PROXY.open(req, timeout=120) as r:
            for line in r:
                line = line.decode().strip()
                if line.startswith("data: "):
                    events.append(line[6:])
                    if line == "data: [DONE]":
                        break
        return events

    def complete(self, prompt: list[int], max_tokens: int = 8) -> dict:
        body = json.dumps({"model": "tiny-llama", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                           "ignore_eos": True}).encode()
        req = urllib.request.Request(self.url + "/v1/completions", body, self.headers)
        with _NO_PROXY.open(req, timeout=120) as r:
            return json.loads(r.read())

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        assert self.proc.wait(timeout=60) == 0


def wait_until(predicate, timeout_s: float = 90.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-llama", num_kv_blocks=1024, progress=False)


def reference_text(llm, prompt: list[int], max_tokens: int) -> str:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].text


def text_of(events: list[str]) -> tuple[str, list]:
    chunks = [json.loads(e) for e in events if e != "[DONE]"]
    return "".join(c["choices"][0]["text"] for c in chunks if c.get("choices")), \
        [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices") and c["choices"][0]["finish_reason"]]


def test_serve_survives_decode_prefill_and_etcd_deaths(llm):
    serve = Serve("--prefill", "1", "--decode", "2")
    try:
        assert serve.ready()[0] == 200
        # 1. SIGKILL a decode node while two streams run (one on each node, round-robin): both complete,
        #    identical to the single-node engine; the node comes back.
        prompts = [list(range(10 + i, 70 + i)) for i in range(2)]
        results: dict[int, list[str]] = {}
        threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, serve.stream(prompts[i], 900)))
                   for i in range(2)]
        for t in threads:
            t.start()
        victim = serve.process("decode-0")
        wait_until(lambda: float(_metrics_line(serve, "kvmesh_in_flight")) >= 2, 60, "both streams to start")
        os.kill(victim["pid"], signal.SIGKILL)
        for t in threads:
            t.join(timeout=180)
        assert len(results) == 2 and float(_metrics_line(serve, "kvmesh_migrations_total")) >= 1
        for i in range(2):
            text, reasons = text_of(results[i])
            assert reasons == ["length"] and text == reference_text(llm, prompts[i], 900)
        wait_until(lambda: serve.process("decode-0")["state"] == "up" and
                   serve.process("decode-0")["restarts"] == 1, 120, "decode-0 to be restarted")
        assert serve.process("decode-0")["pid"] != victim["pid"]
        # 2. SIGKILL the prefill node: requests complete (decode nodes compute), it comes back.
        prefill = serve.process("prefill-0")
        os.kill(prefill["pid"], signal.SIGKILL)
        long_prompt = list(range(1, 200))
        assert serve.complete(long_prompt)["choices"][0]["text"] == reference_text(llm, long_prompt, 8)
        wait_until(lambda: serve.process("prefill-0")["restarts"] == 1 and
                   serve.process("prefill-0")["state"] == "up", 120, "prefill-0 to be restarted")
        # 3. SIGKILL etcd: it is restarted on its ports and data; requests keep completing.
        etcd = serve.process("etcd")
        os.kill(etcd["pid"], signal.SIGKILL)
        wait_until(lambda: serve.process("etcd")["restarts"] == 1 and serve.process("etcd")["state"] == "up",
                   60, "etcd to be restarted")
        again = list(range(30, 120))
        assert serve.complete(again)["choices"][0]["text"] == reference_text(llm, again, 8)
        status, detail = serve.ready()
        assert status == 200 and not detail["degraded"]
        metrics = _metrics(serve)
        assert 'kvmesh_process_restarts{process="decode-0",role="decode"} 1.0' in metrics
        assert "kvmesh_ready 1.0" in metrics
        missing = dashboard_metrics() - exposed_metrics(metrics)
        assert not missing, f"deploy/grafana/kvmesh.json names metrics /metrics does not have: {sorted(missing)}"
    finally:
        serve.close()


_SUFFIXES = re.compile(r"_(bucket|count|sum|total|created)$")


def dashboard_metrics() -> set[str]:
    """Every metric the Grafana dashboard's queries name (histogram and counter suffixes taken off)."""
    dashboard = json.loads((Path(__file__).resolve().parent.parent / "deploy/grafana/kvmesh.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert len(exprs) >= 16
    return {_SUFFIXES.sub("", name) for e in exprs for name in re.findall(r"\bkvmesh_[a-z0-9_]+", e)}


def exposed_metrics(exposition: str) -> set[str]:
    """Every metric family /metrics declares (``# TYPE`` lines) or has a sample of."""
    names = {line.split("{")[0].split(" ")[0] for line in exposition.splitlines() if line.startswith("kvmesh_")}
    names |= {line.split()[2] for line in exposition.splitlines() if line.startswith("# TYPE kvmesh_")}
    return {_SUFFIXES.sub("", name) for name in names}


def test_a_stream_that_cannot_be_migrated_ends_with_an_error(tmp_path):
    """One decode node, no restarts: its death cuts the streams, which must end in an error, not "stop": over
    HTTP an error event, over gRPC UNAVAILABLE, then gRPC health NOT_SERVING. The front ends take the key of
    ``--api-key-file`` and refuse calls without it."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from kvmesh.cluster.grpc_server import pb, pb_grpc

    key_file = tmp_path / "keys"
    key_file.write_text("k3y-one\n")
    key_file.chmod(0o600)
    serve = Serve("--prefill", "0", "--decode", "1", "--max-restarts", "0", "--api-key-file", str(key_file),
                  api_key="k3y-one")
    try:
        with pytest.raises(urllib.error.HTTPError) as refused:
            _NO_PROXY.open(urllib.request.Request(serve.url + "/v1/models"), timeout=10)
        assert refused.value.code == 401
        channel = grpc.insecure_channel(serve.grpc)
        stub = pb_grpc.RouterStub(channel)
        auth = [("authorization", "Bearer k3y-one")]
        with pytest.raises(grpc.RpcError) as denied:
            stub.ListModels(pb.ListModelsRequest(), timeout=10)
        assert denied.value.code() == grpc.StatusCode.UNAUTHENTICATED
        grpc_stream = stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=list(range(70, 120))),
                                                       sampling=pb.SamplingParams(max_tokens=950, ignore_eos=True,
                                                                                  temperature=0.0)),
                                    metadata=auth, timeout=120)
        first_reply = next(grpc_stream)
        assert first_reply.token_ids
        events: list[str] = []
        thread = threading.Thread(target=serve.stream, args=(list(range(5, 60)), 950, events))
        thread.start()
        # Headers go out with the first token (an error before it is an HTTP status, not a stream): wait for it.
        wait_until(lambda: len(events) > 0, 60, "the stream's first token")
        os.kill(serve.process("decode-0")["pid"], signal.SIGKILL)
        thread.join(timeout=120)
        _, reasons = text_of(events)
        assert reasons == ["error"], reasons
        assert any("error" in json.loads(e) for e in events if e != "[DONE]")
        with pytest.raises(grpc.RpcError) as cut:
            for reply in grpc_stream:
                assert not reply.finished, "a cut-off gRPC stream ended as if it were complete"
        assert cut.value.code() == grpc.StatusCode.UNAVAILABLE, cut.value
        health = health_pb2_grpc.HealthStub(channel)
        wait_until(lambda: health.Check(health_pb2.HealthCheckRequest(), timeout=10).status ==
                   health_pb2.HealthCheckResponse.NOT_SERVING, 60, "gRPC health to say NOT_SERVING")
        channel.close()
        wait_until(lambda: serve.ready()[0] == 503, 60, "/ready to say no decode node is up")
        status, detail = serve.ready()
        assert detail["degraded"] and serve.process("decode-0")["state"] == "failed"
        with pytest.raises(urllib.error.HTTPError) as err:
            serve.complete([1, 2, 3])
        assert err.value.code == 503
    finally:
        serve.close()


def _metrics(serve: Serve) -> str:
    with _NO_PROXY.open(serve.url + "/metrics", timeout=10) as r:
        return r.read().decode()


def _metrics_line(serve: Serve, name: str) -> str:
    for line in _metrics(serve).splitlines():
        if line.startswith(name + " "):
            return line.split()[1]
    return "0"
