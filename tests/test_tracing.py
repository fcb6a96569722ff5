"""Request traces (OpenTelemetry over OTLP/HTTP): one trace per request across the router, the decode node and
the prefill node, received by a collector of the test's own; nothing at all when tracing is off."""
from __future__ import annotations

import subprocess
import sys

import pytest

from kvmesh import SamplingParams
from kvmesh.bench.otlp_sink import OTLPSink, render
from kvmesh.cluster.local_launcher import LocalCluster
from kvmesh.cluster.router import Router, RouterConfig
from kvmesh.node import messages as nm
from kvmesh.tracing import NO_SPAN, Tracer, traces_url
from kvmesh.wire import MessageError, decode, encode
from tests.test_cluster import REMOTE_ONLY, prompt, wait_until


def test_one_trace_follows_a_request_through_router_decode_and_prefill_nodes():
    collector = OTLPSink()
    try:
        args = REMOTE_ONLY + ["--otlp-endpoint", collector.endpoint]
        with LocalCluster(1, 1, node_args=args, cluster="traced") as cluster:
            router = Router(RouterConfig(etcd=cluster.etcd_endpoint, cluster_token=cluster.token, cluster="traced",
                                         otlp_endpoint=collector.endpoint))
            try:
                ids = prompt(400, 70)
                chunks = list(router.generate(ids, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)))
                assert sum(len(c.token_ids) for c in chunks) == 4
            finally:
                router.close()  # flushes the router's spans
            wait_until(lambda: collector.named("request") and collector.named("prefill.compute")
                       and collector.named("decode.request") and collector.named("fetch")
                       and collector.named("holder.push"), timeout_s=60)
        (request,) = collector.named("request")
        (route,) = collector.named("route")
        (decode_span,) = collector.named("decode.request")
        (fetch,) = collector.named("fetch")
        (prefill,) = collector.named("prefill.compute")
        (push,) = collector.named("holder.push")  # the prefill node's holder writing what it computed
        assert {s["trace"] for s in (request, route, decode_span, fetch, prefill, push)} == {request["trace"]}
        assert (route["parent"], decode_span["parent"], fetch["parent"], prefill["parent"], push["parent"]) == \
            (request["id"], request["id"], decode_span["id"], fetch["id"], fetch["id"])
        # 70 tokens: 4 full blocks, then the partial last one (its 5 tokens before the last)
        assert push["service"] == "kvmesh-prefill" and push["attributes"]["kvmesh.blocks_written"].int_value == 5
        assert [s["service"] for s in (request, decode_span, prefill)] == \
            ["kvmesh-router", "kvmesh-decode", "kvmesh-prefill"]
        assert route["attributes"]["kvmesh.node"].string_value == "decode-0"
        assert "first_token" in request["events"] and "first_token" in decode_span["events"]
        assert fetch["attributes"]["kvmesh.prefill_node"].string_value == "prefill-0"
        assert fetch["attributes"]["kvmesh.blocks_from_prefill_node"].int_value == 5
        assert fetch["attributes"]["kvmesh.bytes_received"].int_value > 0
        assert [v.string_value for v in fetch["attributes"]["kvmesh.fences"].array_value.values] == ["process"]
        assert fetch["attributes"]["kvmesh.transfer_rounds"].int_value == 1
        assert fetch["attributes"]["kvmesh.step_boundary_wait_ms"].double_value >= 0
        # Every prompt token from the prefill node, the last included: a greedy request's first token came with it.
        assert decode_span["attributes"]["kvmesh.tokens_from_prefill_node"].int_value == 70
        assert decode_span["attributes"]["kvmesh.tokens_computed"].int_value == 0
        assert request["attributes"]["kvmesh.completion_tokens"].int_value == 4
        tree = render(collector.spans).splitlines()  # what docs/traces.md shows
        assert tree[0].startswith("request ") and sum(line.lstrip().startswith("holder.push") for line in tree) == 1
    finally:
        collector.close()


def test_tracing_off_costs_nothing_and_a_bad_context_is_refused():
    """Off (the default): spans are one shared no-op object and OpenTelemetry is never imported. A frame whose
    trace context is not a traceparent is refused like any malformed field."""
    assert Tracer("kvmesh-router").start("request") is NO_SPAN and NO_SPAN.context == ""
    code = ("import sys; from kvmesh.tracing import Tracer; t = Tracer('x'); t.start('y').end(); "
            "print(any(m.startswith('opentelemetry') for m in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          timeout=120).stdout.strip() == "False"
    with pytest.raises(MessageError, match="trace_context"):
        decode(encode(nm.GenerateRequest("r", [1, 2], trace_context="x" * 500)), nm.REQUESTS)
    with pytest.raises(ValueError, match="otlp-endpoint"):
        traces_url("127.0.0.1:4318")
    assert traces_url("http://collector:4318/") == "http://collector:4318/v1/traces"
    # A node follows a trace it is handed; it never starts one of its own for an untraced request.
    tracer = Tracer("kvmesh-decode", "http://127.0.0.1:9", export_interval_s=60)
    try:
        assert tracer.start("decode.request", "") is NO_SPAN
        parent = tracer.start("request")
        child = tracer.start("decode.request", parent.context)
        assert child is not NO_SPAN and child.context.split("-")[1] == parent.context.split("-")[1]
        unsampled = Tracer("kvmesh-router", "http://127.0.0.1:9", sample_ratio=0.0, export_interval_s=60)
        root = unsampled.start("request")  # not sampled: neither it nor its children are recorded
        assert root is NO_SPAN and unsampled.start("route", root) is NO_SPAN and root.context == ""
        unsampled._provider.shutdown = lambda: None
        unsampled.close()
    finally:
        tracer._provider.shutdown = lambda: None  # nothing is listening on port 9: do not wait to export
        tracer.close()


def test_bench_traces_runs_each_setting_and_counts_what_was_exported(tmp_path):
    """``kvmesh bench traces`` (one run per setting here): spans arrive with tracing on and none with it off."""
    from kvmesh.bench import traces

    out = traces.run(str(tmp_path / "traces.json"), "tiny-llama", ratios=(1.0,), repeat=1, groups=2, per_group=3)
    assert set(out["settings"]) == {"off", "ratio 1"} and (tmp_path / "traces.json").exists()
    assert out["settings"]["off"]["spans_received"] == 0
    assert out["settings"]["ratio 1"]["spans_received"] >= 6 * 3  # each request: request, route, decode.request
    assert out["settings"]["ratio 1"]["requests_per_s"] > 0
