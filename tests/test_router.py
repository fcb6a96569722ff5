"""The router's front ends against a real local cluster: OpenAI HTTP (official client), gRPC, routing."""
from __future__ import annotations

import asyncio
import json
import os
import random
import threading
import time
import urllib.error
import urllib.request

import grpc
import pytest

from kvmesh import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
from tests.router_support import _post, aborted_counts


def test_openai_client_streams_a_chat_completion(served, reference):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=served["http"] + "/v1", api_key="unused")
    assert [m.id for m in client.models.list()] == ["tiny-llama"]
    messages = [{"role": "user", "content": "Say something about caches."}]
    stream = client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=12, temperature=0.0,
                                            stream=True, stream_options={"include_usage": True})
    pieces, usage = [], None
    for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
        if chunk.usage:
            usage = chunk.usage
    prompt = served["router"].tokenizer.apply_chat_template(messages)
    expected = reference(prompt, SamplingParams(max_tokens=12, temperature=0.0))
    assert "".join(pieces) == expected.text
    assert usage.completion_tokens == len(expected.token_ids) and usage.prompt_tokens == len(prompt.encode())


def test_chat_content_parts_are_joined_and_non_text_parts_refused(served, reference):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=served["http"] + "/v1", api_key="unused")
    parts = [{"type": "text", "text": "Say something "}, {"type": "text", "text": "about caches."}]
    out = client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": parts}],
                                         max_tokens=6, temperature=0.0)
    prompt = served["router"].tokenizer.apply_chat_template([{"role": "user",
                                                              "content": "Say something about caches."}])
    assert out.choices[0].message.content == reference(prompt, SamplingParams(max_tokens=6, temperature=0.0)).text
    image = [{"type": "image_url", "image_url": {"url": "data:,"}}]
    with pytest.raises(openai.BadRequestError, match="image_url"):
        client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": image}],
                                       max_tokens=4)


def test_logprobs_equal_the_engines_log_softmax(served):
    """Completions (logprobs=k) and chat (logprobs + top_logprobs), streamed and not, against the model itself,
    recomputed from scratch at every position."""
    openai = pytest.importorskip("openai")
    import torch

    from kvmesh.model.loader import load_model
    from tests.conftest import run_prefill

    client = openai.OpenAI(base_url=served["http"] + "/v1", api_key="unused")
    tokenizer = served["router"].tokenizer
    loaded = load_model("tiny-llama")

    def expected(prompt_ids: list[int], steps: int, k: int):
        tokens, out = list(prompt_ids), []
        for _ in range(steps):
            logits, _, _ = run_prefill(loaded, tokens)
            want = torch.log_softmax(logits[-1].double(), -1)
            best = want.topk(k)
            out.append((int(best.indices[0]), best.values[0].item(), best.values.tolist()))
            tokens.append(int(best.indices[0]))
        return out

    prompt = list(range(40, 90))
    out = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=5, temperature=0.0, logprobs=3)
    lp = out.choices[0].logprobs
    for i, (tok, logprob, _) in enumerate(expected(prompt, 5, 3)):
        assert lp.tokens[i] == tokenizer.decode([tok]) and abs(lp.token_logprobs[i] - logprob) < 1e-4
        assert 1 <= len(lp.top_logprobs[i]) <= 3  # keyed by text: tokens that decode alike share a key
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    stream = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=5, temperature=0.0,
                                       logprobs=3, stream=True)
    pieces = [c.choices[0].logprobs for c in stream if c.choices[0].logprobs]
    streamed = [v for p in pieces for v in p.token_logprobs]
    assert streamed == pytest.approx(lp.token_logprobs, abs=1e-4)  # cached prefix or not: summed in another order
    assert [o for p in pieces for o in p.text_offset] == lp.text_offset  # offsets run on across chunks
    messages = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=4, temperature=0.0,
                                          logprobs=True, top_logprobs=2)
    chat_prompt = tokenizer.encode(tokenizer.apply_chat_template(messages))
    content, want = chat.choices[0].logprobs.content, expected(chat_prompt, 4, 2)
    assert len(content) == len(want) == 4  # zip below checks nothing of a missing entry
    for entry, (tok, logprob, tops) in zip(content, want):
        assert entry.token == tokenizer.decode([tok]) and abs(entry.logprob - logprob) < 1e-4
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(tops, abs=1e-4)


def test_n_choices_and_prompt_lists(served, reference):
    """A list of prompts and n > 1: one choice each, ``index`` in order, streamed and not; greedy choices agree."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=served["http"] + "/v1", api_key="unused")
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    prompts = ["The cache ", "A pool of blocks "]
    out = client.completions.create(model="tiny-llama", prompt=prompts, max_tokens=6, temperature=0.0, n=2)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    want = [reference(p, greedy).text for p in prompts]
    assert [c.text for c in out.choices] == [want[0], want[0], want[1], want[1]]
    assert out.usage.completion_tokens == sum(len(reference(p, greedy).token_ids) for p in prompts) * 2
    sampled = client.completions.create(model="tiny-llama", prompt=[[5, 6, 7]], max_tokens=12, temperature=1.0,
                                        n=3, seed=7)
    assert len({c.text for c in sampled.choices}) > 1  # independent samples (seeds 7, 8, 9)
    for i, choice in enumerate(sampled.choices):  # choice i samples with seed + i
        alone = client.completions.create(model="tiny-llama", prompt=[[5, 6, 7]], max_tokens=12, temperature=1.0,
                                          seed=7 + i)
        assert alone.choices[0].text == choice.text, i
    stream = client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=5, temperature=0.0, n=2, stream=True)
    texts: dict[int, str] = {}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
    assert set(texts) == {0, 1} and texts[0] == texts[1]


def test_tokenize_detokenize_and_models(served):
    status, body = _post(served["http"] + "/tokenize", json.dumps({"prompt": "hello"}).encode())
    assert status == 200 and body["tokens"] == served["router"].tokenize("hello") and body["count"] == 5
    status, back = _post(served["http"] + "/detokenize", json.dumps({"tokens": body["tokens"]}).encode())
    assert status == 200 and back["prompt"] == "hello"
    status, bad = _post(served["http"] + "/detokenize", json.dumps({"tokens": [10**6]}).encode())
    assert status == 400 and "token ids" in bad["error"]["message"]
    with urllib.request.urlopen(served["http"] + "/v1/models", timeout=10) as r:
        assert json.loads(r.read())["data"][0]["max_model_len"] == served["router"].max_model_len


def test_completions_report_cached_tokens(served, reference):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=served["http"] + "/v1", api_key="unused")
    prompt = "The global KV pool keeps prefixes warm. " * 3
    first = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=8, temperature=0.0)
    second = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=8, temperature=0.0)
    assert first.choices[0].text == second.choices[0].text == reference(
        prompt, SamplingParams(max_tokens=8, temperature=0.0)).text
    assert second.usage.prompt_tokens_details.cached_tokens >= len(prompt.encode()) // 16 * 16 - 16


@pytest.mark.parametrize("body,fragment", [
    (b"{not json", "not valid JSON"),
    (json.dumps({"model": "gpt-9", "prompt": "x"}).encode(), "unknown model"),
    (json.dumps({"prompt": ""}).encode(), "empty"),
    (json.dumps({"prompt": [1, 2, 10**6]}).encode(), "vocabulary"),
    (json.dumps({"prompt": "x", "max_tokens": 0}).encode(), "max_tokens"),
    (json.dumps({"prompt": "x", "max_tokens": 5000}).encode(), "context"),
    (json.dumps({"prompt": {"a": 1}}).encode(), "prompt must be"),
    (json.dumps({"prompt": "x", "temperature": -1}).encode(), "temperature"),
    (json.dumps({"prompt": "x", "n": 0}).encode(), "n must be"),
    (json.dumps({"prompt": ["a", "b"], "n": 9}).encode(), "more than 16 choices"),
    (json.dumps({"prompt": "x", "best_of": 3}).encode(), "'best_of' is not supported"),
    (json.dumps({"prompt": "x", "logprobs": 50}).encode(), "logprobs must be"),
    (json.dumps({"prompt": "x", "echo": True}).encode(), "'echo' is not supported"),
    (json.dumps({"prompt": "x", "presence_penalty": 0.5}).encode(), "'presence_penalty' is not supported"),
    (json.dumps({"prompt": [["a"], 1]}).encode(), "prompt must be"),
    (json.dumps({"prompt": "x", "suffix": "y", "tool_choice": "auto"}).encode(), "'suffix', 'tool_choice'"),
    (json.dumps({"prompt": "x", "ignore_eos": "yes"}).encode(), "ignore_eos"),
    (json.dumps({"prompt": "x", "seed": 2**64}).encode(), "seed must be an integer in"),
    (json.dumps({"prompt": "x", "seed": -(2**63) - 1}).encode(), "seed must be an integer in"),
    (json.dumps({"prompt": "x", "seed": 2**63 - 1, "n": 2}).encode(), "seed + n - 1"),
    (json.dumps({"prompt": "x", "temperature": float("inf")}).encode(), "temperature must be a finite"),
])
def test_http_bad_input_is_a_400_with_a_message(served, body, fragment):
    status, payload = _post(served["http"] + "/v1/completions", body)
    assert status == 400 and fragment in payload["error"]["message"]


def test_chat_roles_are_checked(served):
    status, payload = _post(served["http"] + "/v1/chat/completions", json.dumps(
        {"messages": [{"role": "wizard", "content": "hi"}], "max_tokens": 2}).encode())
    assert status == 400 and "role must be one of" in payload["error"]["message"]


def test_http_oversize_body_is_refused(served):
    status, payload = _post(served["http"] + "/v1/completions",
                            json.dumps({"prompt": "x" * (2 << 20)}).encode())
    assert status == 413
    import socket

    host, port = served["http"].removeprefix("http://").split(":")
    started = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=10) as s:  # declares 10^12 bytes, sends 2
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000000000000\r\n\r\n{}")
        answer = s.recv(4096).decode(errors="replace")
    assert answer.startswith("HTTP/1.1 413") and time.monotonic() - started < 5, answer


def test_grpc_generate_health_and_reflection(served, reference):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    from kvmesh.cluster.grpc_server import pb, pb_grpc

    channel = grpc.insecure_channel(served["grpc"])
    stub = pb_grpc.RouterStub(channel)
    ids = list(range(40, 110))
    request = pb.GenerateRequest(model="tiny-llama", token_ids=pb.TokenIds(ids=ids),
                                 sampling=pb.SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0))
    replies = list(stub.Generate(request, timeout=60))
    tokens = [t for r in replies for t in r.token_ids]
    assert tokens == reference(ids).token_ids
    # n choices, logprobs and stop strings, as over HTTP; an unset temperature is OpenAI's 1.0.
    many = pb.GenerateRequest(model="tiny-llama", token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(
        max_tokens=8, ignore_eos=True, n=3, seed=1, logprobs=2))
    by_choice: dict[int, list] = {}
    for r in stub.Generate(many, timeout=60):
        by_choice.setdefault(r.index, []).append(r)
        assert len(r.logprobs) == len(r.token_ids) and all(len(t.logprobs) == 2 for t in r.top_logprobs)
    assert sorted(by_choice) == [0, 1, 2] and all(rs[-1].finished for rs in by_choice.values())
    assert len({tuple(t for r in rs for t in r.token_ids) for rs in by_choice.values()}) > 1  # sampled, seeds 1..3
    text = reference(ids).text
    needle = text[len(text) // 2]  # whatever character the greedy answer has halfway
    cut = list(stub.Generate(pb.GenerateRequest(model="tiny-llama", token_ids=pb.TokenIds(ids=ids),
                                                sampling=pb.SamplingParams(max_tokens=12, ignore_eos=True,
                                                                           temperature=0.0, stop=[needle])),
                             timeout=60))
    assert "".join(r.text for r in cut) == text[:text.find(needle)] and cut[-1].finish_reason == "stop"
    final = replies[-1]
    assert final.finished and final.usage.prompt_tokens == 70 and final.usage.completion_tokens == 12
    c = final.cache
    assert c.tokens_reused_local + c.tokens_reused_host + c.tokens_reused_disk + c.tokens_reused_remote + \
        c.tokens_reused_prefill_node + c.tokens_computed + c.tokens_from_prefill_node == 70
    assert list(stub.ListModels(pb.ListModelsRequest()).models) == ["tiny-llama"]
    assert list(stub.Tokenize(pb.TokenizeRequest(text="hi")).token_ids) == [104, 105]
    status = stub.ClusterStatus(pb.ClusterStatusRequest())
    assert sorted(n.node_id for n in status.nodes) == ["decode-0", "decode-1", "prefill-0"]
    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="kvmesh.v1.Router"))
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    refl = reflection_pb2_grpc.ServerReflectionStub(channel)
    answer = next(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    assert "kvmesh.v1.Router" in [s.name for s in answer.list_services_response.service]
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[])), timeout=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(pb.GenerateRequest(model="nope", text="x"), timeout=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_overload_is_429_and_resource_exhausted(served):
    router = served["router"]
    limit = router.cfg.max_in_flight
    object.__setattr__(router.cfg, "max_in_flight", 0)
    try:
        status, payload = _post(served["http"] + "/v1/completions", json.dumps({"prompt": "x"}).encode())
        assert status == 429 and "in flight" in payload["error"]["message"]
        from kvmesh.cluster.grpc_server import pb, pb_grpc

        stub = pb_grpc.RouterStub(grpc.insecure_channel(served["grpc"]))
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(pb.GenerateRequest(text="x"), timeout=10))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        object.__setattr__(router.cfg, "max_in_flight", limit)


def test_cache_aware_routing_reuses_more_than_round_robin(served):
    """Shared-prefix groups over two decode nodes: cache-aware sends a group where its prefix lives."""
    from kvmesh.cluster.routing import make_policy

    router = served["router"]
    rng = random.Random(9)
    reused = {}
    for name in ("round-robin", "cache-aware"):
        router.policy = make_policy(name)
        total = computed = 0
        for g in range(4):
            system = [rng.randrange(256) for _ in range(96)]
            for q in range(4):
                ids = system + [rng.randrange(256) for _ in range(10)]
                final = list(router.generate(ids, SamplingParams(max_tokens=2, temperature=0.0)))[-1]
                total += final.cache.tokens_reused_local
                computed += final.cache.tokens_computed
        reused[name] = total
    router.policy = make_policy("cache-aware")
    assert reused["cache-aware"] > reused["round-robin"]


def test_a_client_that_goes_away_aborts_its_request(served):
    """900 tokens (the context's worth): the request would run on for seconds; only an abort ends it early."""
    router = served["router"]
    before = aborted_counts(served["cluster"])
    stream = router.generate(list(range(30, 90)), SamplingParams(max_tokens=900, temperature=0.0, ignore_eos=True))
    first = next(stream)
    node = served["cluster"].client(first.node_id)
    stream.close()  # what the HTTP and gRPC front ends do when the client disconnects
    deadline = time.monotonic() + 10
    while True:
        stats = node.stats(check=True)
        if stats["num_aborted"] > before[first.node_id] and stats["num_used_blocks"] == 0:
            break
        assert time.monotonic() < deadline, stats
        time.sleep(0.05)


def test_metrics_endpoint(served):
    router = served["router"]
    list(router.generate(list(range(10, 60)), SamplingParams(max_tokens=4, temperature=0.0)))
    with urllib.request.urlopen(served["http"] + "/metrics", timeout=30) as r:
        text = r.read().decode()
    for name in ("kvmesh_ttft_seconds_bucket", "kvmesh_tpot_seconds_count", "kvmesh_e2e_seconds_sum",
                 "kvmesh_queue_seconds_count", 'kvmesh_requests_total{outcome="ok"}',
                 'kvmesh_prompt_tokens_total{source="computed"}', 'kvmesh_node_running{node="decode-0"}',
                 'kvmesh_node_bytes_received{node="decode-0"}', "kvmesh_in_flight",
                 'kvmesh_node_gc_max_pause_seconds{generation="2",node="decode-0"}',
                 'kvmesh_node_steps_bounded_for_landings{node="decode-0"}'):
        assert name in text, name
    shares: dict[str, list[float]] = {}  # of the nodes that stepped (the decode node that served, the probes)
    for line in text.splitlines():
        if line.startswith("kvmesh_node_engine_step_share{"):
            shares.setdefault(line.split('node="')[1].split('"')[0], []).append(float(line.split()[-1]))
    assert shares and all(len(s) == 3 and abs(sum(s) - 1.0) < 1e-6 for s in shares.values())  # split three ways
    ok = [line for line in text.splitlines() if line.startswith('kvmesh_requests_total{outcome="ok"}')]
    assert float(ok[0].split()[-1]) >= 1
    # The decode-only steps of the request (3 after its first token), by their compute threads, with their time:
    # what `kvmesh bench serve` records of each kvmesh target.
    from kvmesh.bench.serve_bench import node_decode_steps

    by_threads = node_decode_steps(served["http"])
    decode_ids = [node_id for node_id in by_threads if node_id.startswith("decode")]
    assert decode_ids and all(by_threads[n] for n in decode_ids), by_threads
    assert sum(v["steps"] for n in decode_ids for v in by_threads[n].values()) >= 3
    assert all(v["mean_ms"] > 0 for n in decode_ids for v in by_threads[n].values())


def test_bearer_token_and_tls_on_both_endpoints(served, tmp_path):
    """A second pair of front ends over the same router, with TLS and a token."""
    import ssl
    import subprocess

    from kvmesh.cluster.grpc_server import pb, pb_grpc, start_grpc_server
    from kvmesh.cluster.http_server import start_http_server

    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    router = served["router"]
    server, port = start_grpc_server(router, "127.0.0.1:0", token="s3cret", tls=(key.read_bytes(), cert.read_bytes()))
    creds = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
    stub = pb_grpc.RouterStub(grpc.secure_channel(f"localhost:{port}", creds))
    with pytest.raises(grpc.RpcError) as err:
        stub.ListModels(pb.ListModelsRequest(), timeout=10)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    reply = stub.ListModels(pb.ListModelsRequest(), metadata=[("authorization", "Bearer s3cret")], timeout=10)
    assert list(reply.models) == ["tiny-llama"]
    server.stop(grace=0)

    loop = asyncio.new_event_loop()
    runner, http_port = loop.run_until_complete(start_http_server(router, "127.0.0.1", 0, token="s3cret",
                                                                  tls=(str(cert), str(key))))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        ctx = ssl.create_default_context(cafile=str(cert))
        url = f"https://localhost:{http_port}/v1/models"
        with pytest.raises(urllib.error.HTTPError) as http_err:
            urllib.request.urlopen(url, context=ctx, timeout=10)
        assert http_err.value.code == 401
        base = f"https://localhost:{http_port}"
        for path, body in (("/metrics", None), ("/tokenize", b'{"prompt": "x"}'), ("/detokenize", b'{"tokens": [1]}'),
                           ("/admin/pins", None)):
            with pytest.raises(urllib.error.HTTPError) as http_err:
                urllib.request.urlopen(urllib.request.Request(base + path, data=body), context=ctx, timeout=10)
            assert http_err.value.code == 401, path
        with urllib.request.urlopen(base + "/health", context=ctx, timeout=10) as r:  # probes stay open
            assert r.status == 200
        for scheme in ("Bearer", "bearer", "BEARER"):  # auth schemes are case-insensitive
            req = urllib.request.Request(url, headers={"Authorization": f"{scheme} s3cret"})
            with urllib.request.urlopen(req, context=ctx, timeout=10) as r:
                assert json.loads(r.read())["data"][0]["id"] == "tiny-llama"
        with pytest.raises(urllib.error.HTTPError) as http_err:
            urllib.request.urlopen(urllib.request.Request(url, headers={"Authorization": "Basic s3cret"}),
                                   context=ctx, timeout=10)
        assert http_err.value.code == 401
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)


def test_fuzzed_requests_leave_everything_serving(served):
    """A few thousand random bodies (mostly invalid) over HTTP; then a normal request still works."""
    rng = random.Random(11)
    fields = ["prompt", "max_tokens", "temperature", "top_p", "top_k", "model", "stream", "seed", "messages", "stop"]
    values = [None, "", "x", 0, -1, 1, 2.5, 10**9, True, [], [1, 2], [10**7], {}, {"role": "user"}, "tiny-llama",
              [{"role": "user", "content": "hi"}], "\udcff".encode("utf-8", "surrogatepass").decode("latin-1")]
    statuses = set()
    for i in range(2000):
        path = "/v1/chat/completions" if i % 3 == 0 else "/v1/completions"
        if i % 10 == 0:
            body = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
        else:
            payload = {rng.choice(fields): rng.choice(values) for _ in range(rng.randrange(0, 5))}
            if "max_tokens" not in payload:
                payload["max_tokens"] = 1
            if isinstance(payload.get("max_tokens"), int) and payload["max_tokens"] > 4:
                payload["max_tokens"] = 4
            body = json.dumps(payload).encode()
        req = urllib.request.Request(served["http"] + path, data=body, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                r.read()
                statuses.add(r.status)
        except urllib.error.HTTPError as e:
            e.read()
            statuses.add(e.code)
    assert statuses <= {200, 400, 413, 429} and 400 in statuses
    final = list(served["router"].generate(list(range(5, 40)), SamplingParams(max_tokens=3, temperature=0.0)))
    assert final[-1].finished
    for node_id in served["cluster"].nodes:
        served["cluster"].client(node_id).stats(check=True)


def test_stop_strings_end_the_stream_and_the_node_request(served, reference):
    router = served["router"]
    ids = list(range(70, 130))
    full = reference(ids, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    # An ASCII stop string (the tiny model's bytes are not all valid UTF-8).
    needle = next(ch for ch in full.text[5:] if ch.isascii() and ch.isprintable())
    before = aborted_counts(served["cluster"])
    # 900 tokens may be asked (the context's worth): the node would run on for seconds; only the router's
    # abort ends its request at the stop string.
    chunks = list(router.generate(ids, SamplingParams(max_tokens=900, temperature=0.0, ignore_eos=True,
                                                      stop=(needle,))))
    assert "".join(c.text for c in chunks) == full.text[: full.text.find(needle)]
    assert chunks[-1].finish_reason == "stop"
    node = served["cluster"].client(chunks[-1].node_id)
    deadline = time.monotonic() + 10
    while node.stats()["num_running"] or node.stats()["num_used_blocks"]:
        assert time.monotonic() < deadline, "the node kept generating after the stop string"
        time.sleep(0.05)
    assert node.stats()["num_aborted"] > before[chunks[-1].node_id]  # stopped by the abort, not by finishing


def test_request_caps_and_cache_salt(served):
    """20,000 stop strings are a 400, not a slow stream; a cache_salt shares prefix hits only with its own salt."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=served["http"] + "/v1", api_key="unused")
    for extra in ({"stop": [f"s{i}" for i in range(20_000)]}, {"stop": ["x" * 5000]},
                  {"extra_body": {"stop_token_ids": list(range(5000))}}):
        with pytest.raises(openai.BadRequestError, match="stop"):
            client.completions.create(model="tiny-llama", prompt="hello", max_tokens=2, **extra)
    prompt = "tenant data " * 30

    def cached(salt):
        out = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=2, temperature=0.0,
                                        extra_body={"cache_salt": salt} if salt else {})
        return out.usage.prompt_tokens_details.cached_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-a") > 0, "the same salt must reuse its own prefix"
    assert cached("tenant-b") == 0 and cached(None) == 0, "another tenant saw tenant-a's cached prefix"
    with pytest.raises(openai.BadRequestError, match="cache_salt"):
        client.completions.create(model="tiny-llama", prompt="x", max_tokens=1, extra_body={"cache_salt": "s" * 300})


def test_kvmesh_router_runs_without_torch(served):
    """``kvmesh router`` reads the model card, tokenizes, hashes and routes without the model stack: no libtorch
    in its address space (it would be mapped the moment anything imported torch), and it serves; it hashes
    with the C chain (its extension is mapped), not hashlib; it froze its start-up objects (kvmesh/gc_pauses.py)."""
    import subprocess
    import sys

    from kvmesh.auth import TOKEN_ENV

    cluster = served["cluster"]
    proc = subprocess.Popen([sys.executable, "-m", "kvmesh.cli", "router", "--etcd", cluster.etcd_endpoint,
                             "--cluster", "router", "--http-port", "0", "--grpc-port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env={**os.environ, TOKEN_ENV: cluster.token})
    try:
        base = json.loads(proc.stdout.readline())["http"]
        body = json.dumps({"prompt": "no torch here, " * 5, "max_tokens": 4, "temperature": 0}).encode()
        request = urllib.request.Request(base + "/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as r:
            assert json.loads(r.read())["choices"][0]["text"]
        with urllib.request.urlopen(base.removesuffix("/v1") + "/metrics", timeout=60) as r:
            frozen = [line for line in r.read().decode().splitlines()
                      if line.startswith("kvmesh_router_gc_frozen_objects ")]
        assert frozen and float(frozen[0].split()[1]) > 50_000  # its start-up objects are out of full collections
        with open(f"/proc/{proc.pid}/maps") as f:
            maps = f.readlines()
        torch_maps = [line for line in maps if "libtorch" in line]
        assert torch_maps == [], torch_maps[:3]
        assert any("kvmesh_blake2b_chain" in line for line in maps)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_one_client_holds_at_most_its_share_of_the_router(served):
    """Half of max_in_flight per client (key, else address): the next stream of that client is refused, another
    client's is admitted."""
    from kvmesh.cluster.router import Overloaded

    router = served["router"]
    share = router.cfg.max_in_flight // 2
    params = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)
    streams = []
    try:
        for i in range(share):
            streams.append(router.generate([1 + i % 200, 2, 3], params, client="hog"))
            next(streams[-1])  # admitted: in flight until closed
        extra = router.generate([7, 8, 9], params, client="hog")
        with pytest.raises(Overloaded, match="per client"):
            next(extra)
        other = router.generate([7, 8, 9], params, client="someone-else")
        streams.append(other)
        assert next(other).token_ids
    finally:
        for stream in streams:
            stream.close()


def test_the_serve_benchmark_splits_gaps_by_whether_another_prompt_was_pending():
    """A gap counts as beside a prompt when another request was sent before it ended and got its first token
    after it began; a stream's own prompt never counts."""
    from kvmesh.bench.serve_bench import Stream, gaps_beside_prompts

    def stream(sent_at: float, *arrivals: float) -> Stream:
        return Stream(arrivals[0] - sent_at, arrivals[-1] - sent_at, [], len(arrivals), sent_at, arrivals)

    a = stream(0.0, 1.0, 2.0, 3.2, 4.0)  # gaps 1.0 and 1.2 s beside b's prompt (sent 1.5, first token 2.5)
    b = stream(1.5, 2.5, 3.0)  # its gap: a's prompt long done
    split = gaps_beside_prompts([a, b])
    assert split["itl_beside_prompt_share"] == pytest.approx(2 / 4)
    assert split["itl_beside_prompt_p99_ms"] == pytest.approx(1200.0)
    assert split["itl_decode_only_p99_ms"] == pytest.approx(800.0)  # a's last gap (0.8 s) and b's (0.5 s)
    alone = gaps_beside_prompts([stream(0.0, 1.0, 3.0)])
    assert alone["itl_beside_prompt_share"] == 0.0 and alone["itl_decode_only_p99_ms"] == pytest.approx(2000.0)
    late = gaps_beside_prompts([stream(0.0, 1.0, 2.0), stream(2.0, 2.5)])  # sent as the gap ended: not beside it
    assert late["itl_beside_prompt_share"] == 0.0


def test_the_serve_benchmark_client_times_every_streamed_token(served):
    """``kvmesh bench serve``'s client against the real endpoint: every request streams its max_tokens, one
    inter-token gap per token after the first, TTFT within the request's time; an error event is raised."""
    from kvmesh.bench import serve_bench
    from kvmesh.bench.workloads import BenchRequest

    target = serve_bench.Target("kvmesh", served["http"] + "/v1")
    requests = [BenchRequest([(5 * i + j) % 250 for j in range(20 + i)], 6 + i) for i in range(5)]
    streams, seconds, _ = serve_bench.drive(target, "tiny-llama", requests, concurrency=3)
    assert [s.num_tokens for s in streams] == [r.max_tokens for r in requests]
    assert [len(s.itl_s) for s in streams] == [r.max_tokens - 1 for r in requests]  # one token per chunk
    assert all(0 < s.ttft_s <= s.e2e_s <= seconds for s in streams)
    summary = serve_bench.summarize(streams, seconds)
    assert summary["requests"] == 5 and summary["output_tok_s"] == pytest.approx(sum(6 + i for i in range(5)) / seconds)
    assert all(len(s.arrivals) == s.num_tokens and s.arrivals[0] - s.sent_at == pytest.approx(s.ttft_s)
               for s in streams)
    assert 0.0 < summary["itl_beside_prompt_share"] < 1.0  # 5 requests, 3 at a time: the last two start mid-stream
    with pytest.raises(RuntimeError, match="HTTP 400"):
        serve_bench.drive(target, "tiny-llama", [BenchRequest([], 4)], concurrency=1)

