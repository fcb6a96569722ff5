"""A minimal OTLP/HTTP trace receiver: what ``kvmesh bench traces`` and the tests export to.

``POST /v1/traces`` bodies (protobuf ``ExportTraceServiceRequest``, gzip or plain) are parsed with the
OpenTelemetry proto package and kept as plain dicts: service, name, trace and span ids, parent, attributes,
events and times. Not a collector for production (no storage, no query): point ``--otlp-endpoint`` at
Jaeger, Tempo or the OpenTelemetry Collector for that.
"""
from __future__ import annotations

import gzip
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class OTLPSink:
    """Listens on ``127.0.0.1`` (a free port) from construction; ``endpoint`` is the ``--otlp-endpoint`` value;
    ``close`` stops it."""

    def __init__(self):
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        self.spans: list[dict] = []
        self.num_posts = 0
        lock = threading.Lock()
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                spans = list(_spans(ExportTraceServiceRequest.FromString(body)))
                with lock:
                    sink.spans += spans
                    sink.num_posts += 1
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.end_headers()

            def log_message(self, *args):
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_port}"
        threading.Thread(target=self._server.serve_forever, name="kvmesh-otlp-sink", daemon=True).start()

    def named(self, name: str) -> list[dict]:
        return [s for s in list(self.spans) if s["name"] == name]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _spans(request):
    for resource in request.resource_spans:
        service = next((a.value.string_value for a in resource.resource.attributes if a.key == "service.name"), "")
        for scope in resource.scope_spans:
            for s in scope.spans:
                yield {"service": service, "name": s.name, "trace": s.trace_id.hex(), "id": s.span_id.hex(),
                       "parent": s.parent_span_id.hex(), "attributes": {a.key: a.value for a in s.attributes},
                       "events": [e.name for e in s.events], "start_ns": s.start_time_unix_nano,
                       "end_ns": s.end_time_unix_nano, "event_ns": [e.time_unix_nano for e in s.events]}


def attribute_value(value):
    """An OTLP ``AnyValue`` as Python (strings, ints, floats, bools, lists of them)."""
    for field in ("string_value", "int_value", "double_value", "bool_value"):
        if value.HasField(field):
            return getattr(value, field)
    return [attribute_value(v) for v in value.array_value.values]


def render(spans: list[dict]) -> str:
    """The spans of one trace as a tree: each span's offset from the first, duration, attributes and events."""
    spans = sorted(spans, key=lambda s: s["start_ns"])
    if not spans:
        return ""
    t0, children, lines = spans[0]["start_ns"], {}, []
    ids = {s["id"] for s in spans}
    for s in spans:
        children.setdefault(s["parent"] if s["parent"] in ids else "", []).append(s)

    def show(s: dict, depth: int) -> None:
        pad = "  " * depth
        lines.append(f"{pad}{s['name']:<18} [{s['service']}] +{(s['start_ns'] - t0) / 1e6:7.1f} ms  "
                     f"{(s['end_ns'] - s['start_ns']) / 1e6:7.1f} ms")
        for key, value in sorted(s["attributes"].items()):
            value = attribute_value(value)
            lines.append(f"{pad}    {key} = {round(value, 2) if isinstance(value, float) else value}")
        for name, ns in zip(s["events"], s["event_ns"]):
            lines.append(f"{pad}    event {name} at +{(ns - t0) / 1e6:.1f} ms")
        for child in children.get(s["id"], []):
            show(child, depth + 1)

    for root in children.get("", []):
        show(root, 0)
    return "\n".join(lines)
