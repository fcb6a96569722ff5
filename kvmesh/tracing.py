"""Distributed traces of requests (OpenTelemetry): one trace per request across router, decode node, prefill
node and holder, exported over OTLP/HTTP. Off by default.

    router   request ─┬─ route (the chosen node, the alternatives it priced)
                      └─ ... the stream, first token, finish
    decode             decode.request ─┬─ admission (where the prompt's KV comes from)
                                       ├─ fetch (source, blocks, bytes, the wait for the step boundary)
                                       └─ first token, finish
    prefill                            prefill.compute (tokens computed, reused; pushes)

A trace's context travels in the frames that already go between the processes (``trace_context``: a W3C
``traceparent``), so no request pays for a lookup. ``Tracer("")`` (no endpoint) is the default: every call
is a check of one attribute and nothing else (no OpenTelemetry import), so tracing costs nothing when off.
``http://HOST:PORT`` exports to ``HOST:PORT/v1/traces`` (the collectors' OTLP/HTTP layout), in batches from
a thread of the SDK; ``close`` flushes what is left.
"""
from __future__ import annotations

import logging

from kvmesh.wire import MessageError

log = logging.getLogger("kvmesh.tracing")
MAX_TRACE_CONTEXT = 128  # a traceparent is 55 characters


def check_trace_context(kind: str, value: str) -> None:
    """A frame's ``trace_context`` field: a short string (MessageError otherwise; what it says is parsed by the
    OpenTelemetry propagator, which ignores what is not a traceparent)."""
    if not isinstance(value, str) or len(value) > MAX_TRACE_CONTEXT:
        raise MessageError(f"{kind}: trace_context is not a traceparent")


class _NoSpan:
    """What a tracer that is off hands out: every call does nothing."""

    def set_attribute(self, key: str, value) -> None:
        pass

    def set_attributes(self, attributes: dict) -> None:
        pass

    def add_event(self, name: str, attributes: dict | None = None) -> None:
        pass

    def record_error(self, message: str) -> None:
        pass

    def end(self) -> None:
        pass

    @property
    def context(self) -> str:
        return ""


NO_SPAN = _NoSpan()


class Span:
    """One OpenTelemetry span; ``context`` is its ``traceparent`` for the next process."""

    def __init__(self, span):
        self._span = span

    def set_attribute(self, key: str, value) -> None:
        self._span.set_attribute(key, value)

    def set_attributes(self, attributes: dict) -> None:
        self._span.set_attributes(attributes)

    def add_event(self, name: str, attributes: dict | None = None) -> None:
        self._span.add_event(name, attributes or {})

    def record_error(self, message: str) -> None:
        from opentelemetry.trace import Status, StatusCode

        self._span.set_status(Status(StatusCode.ERROR, message))

    def end(self) -> None:
        self._span.end()

    @property
    def context(self) -> str:
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        from opentelemetry.trace import set_span_in_context

        carrier: dict[str, str] = {}
        TraceContextTextMapPropagator().inject(carrier, context=set_span_in_context(self._span))
        return carrier.get("traceparent", "")


def traces_url(endpoint: str) -> str:
    """``--otlp-endpoint`` -> where spans are posted (``http://HOST:PORT`` -> ``http://HOST:PORT/v1/traces``)."""
    endpoint = endpoint.rstrip("/")
    if not endpoint.startswith(("http://", "https://")):
        raise ValueError(f"--otlp-endpoint {endpoint!r}: expected http://HOST:PORT or https://HOST:PORT")
    return endpoint if endpoint.endswith("/v1/traces") else endpoint + "/v1/traces"


class Tracer:
    def __init__(self, service: str, endpoint: str = "", sample_ratio: float = 1.0, instance: str = "",
                 export_interval_s: float = 1.0):
        """``service``: what this process is in the traces (``service.name``; ``instance``: which one, e.g. a
        node id). ``sample_ratio``: the share of traces a router starts (a trace begun elsewhere is followed
        as its parent decided)."""
        self.enabled = bool(endpoint)
        self._provider = self._tracer = None
        if not self.enabled:
            return
        if not 0.0 <= sample_ratio <= 1.0:
            raise ValueError(f"--trace-sample-ratio must be within 0..1, got {sample_ratio}")
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

        self._provider = TracerProvider(resource=Resource.create({"service.name": service,
                                                                  "service.instance.id": instance or service}),
                                        sampler=ParentBased(TraceIdRatioBased(sample_ratio)))
        self._provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=traces_url(endpoint)),
                                                             schedule_delay_millis=int(export_interval_s * 1e3)))
        self._tracer = self._provider.get_tracer("kvmesh")
        log.info("%s: traces to %s (sampled: %g)", service, traces_url(endpoint), sample_ratio)

    def start(self, name: str, parent: str | Span | None = None, attributes: dict | None = None):
        """A new span (``end`` it), child of ``parent`` (a ``traceparent`` from another process, or a span of
        this one); without a parent, a new trace (sampled at the ratio). ``NO_SPAN`` when off, or when the
        parent's trace is not sampled or has no context (a client that does not trace)."""
        if not self.enabled or parent is NO_SPAN:  # off, or the parent's trace was not sampled
            return NO_SPAN
        from opentelemetry.trace import set_span_in_context
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        if isinstance(parent, Span):
            context = set_span_in_context(parent._span)
        elif parent:
            context = TraceContextTextMapPropagator().extract({"traceparent": parent})
        elif parent is None:
            context = None
        else:  # "": a request from a process that did not trace it
            return NO_SPAN
        span = self._tracer.start_span(name, context=context, attributes=attributes or {})
        return Span(span) if span.is_recording() else NO_SPAN

    def close(self) -> None:
        """Export what is left and stop (idempotent)."""
        if self._provider is not None:
            self._provider.shutdown()
            self._provider = None
            self.enabled = False


def add_tracing_arguments(p) -> None:
    p.add_argument("--otlp-endpoint", default="",
                   help="export OpenTelemetry traces of requests over OTLP/HTTP to this collector "
                        "(http://HOST:PORT: posted to HOST:PORT/v1/traces; default: no tracing, no cost)")
    p.add_argument("--trace-sample-ratio", type=float, default=1.0,
                   help="the share of requests traced (the router decides; nodes follow it)")
