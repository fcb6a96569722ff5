"""Request traces (OpenTelemetry over OTLP/HTTP): one trace per request across the router, the decode node and
the prefill node, received by a collector of the test's own; nothing at all when tracing is off."""
from __future__ import annotations

import gzip
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvmesh import SamplingParams
from kvmesh.cluster.local_launcher import LocalCluster
from kvmesh.cluster.router import Router, RouterConfig
from kvmesh.node import messages as nm
from kvmesh.tracing import NO_SPAN, Tracer, traces_url
from kvmesh.wire import MessageError, decode, encode
from tests.test_cluster import REMOTE_ONLY, prompt, wait_until


class Collector:
    """An OTLP/HTTP trace receiver: every span posted to /v1/traces, as (service, name, trace id, span id,
    parent span id, attributes)."""

    def __init__(self):
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        self.spans: list[dict] = []
        lock = threading.Lock()
        spans = self.spans

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                request = ExportTraceServiceRequest.FromString(body)
                with lock:
                    for resource in request.resource_spans:
                        service = next(a.value.string_value for a in resource.resource.attributes
                                       if a.key == "service.name")
                        for scope in resource.scope_spans:
                            for s in scope.spans:
                                spans.append({"service": service, "name": s.name, "trace": s.trace_id.hex(),
                                              "id": s.span_id.hex(), "parent": s.parent_span_id.hex(),
                                              "attributes": {a.key: a.value for a in s.attributes},
                                              "events": [e.name for e in s.events],
                                              "start_ns": s.start_time_unix_nano, "end_ns": s.end_time_unix_nano,
                                              "event_ns": [e.time_unix_nano for e in s.events]})
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.end_headers()

            def log_message(self, *args):
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_port}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def named(self, name: str) -> list[dict]:
        return [s for s in list(self.spans) if s["name"] == name]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def test_one_trace_follows_a_request_through_router_decode_and_prefill_nodes():
    collector = Collector()
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
        assert push["service"] == "kvmesh-prefill" and push["attributes"]["kvmesh.blocks_written"].int_value == 4
        assert [s["service"] for s in (request, decode_span, prefill)] == \
            ["kvmesh-router", "kvmesh-decode", "kvmesh-prefill"]
        assert route["attributes"]["kvmesh.node"].string_value == "decode-0"
        assert "first_token" in request["events"] and "first_token" in decode_span["events"]
        assert fetch["attributes"]["kvmesh.prefill_node"].string_value == "prefill-0"
        assert fetch["attributes"]["kvmesh.blocks_from_prefill_node"].int_value == 4  # 70 tokens: 4 full blocks
        assert fetch["attributes"]["kvmesh.bytes_received"].int_value > 0
        assert [v.string_value for v in fetch["attributes"]["kvmesh.fences"].array_value.values] == ["process"]
        assert fetch["attributes"]["kvmesh.transfer_rounds"].int_value == 1
        assert fetch["attributes"]["kvmesh.step_boundary_wait_ms"].double_value >= 0
        assert decode_span["attributes"]["kvmesh.tokens_from_prefill_node"].int_value == 64
        assert request["attributes"]["kvmesh.completion_tokens"].int_value == 4
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
    finally:
        tracer._provider.shutdown = lambda: None  # nothing is listening on port 9: do not wait to export
        tracer.close()
