"""The gRPC front end: kvmesh.v1.Router, plus the standard health and reflection services.

The .proto is compiled when this module loads (``grpc.protos_and_services``), so
no generated code lives in the repository.
"""
from __future__ import annotations

import json
import queue
import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvmesh.cluster.api_keys import ApiKeys
from kvmesh.cluster.openai_protocol import MAX_CHOICES, seeded_choices
from kvmesh.cluster.router import Overloaded, RequestTimeout, Router
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.errors import InvalidRequestError, KvmeshError
from kvmesh.node.messages import PROMPT_TOKEN_SOURCES

PROTO_DIR = Path(__file__).parent / "proto"


def load_protos():
    """(messages module, services module) for kvmesh.proto, compiled now."""
    import sys

    if str(PROTO_DIR) not in sys.path:
        sys.path.insert(0, str(PROTO_DIR))
    return grpc.protos_and_services("kvmesh.proto")


pb, pb_grpc = load_protos()
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Router"].full_name


def sampling_from_proto(s) -> list[SamplingParams]:
    """One SamplingParams per choice (``n``), with the OpenAI defaults the HTTP API uses."""
    base = SamplingParams(max_tokens=s.max_tokens or 16, temperature=s.temperature if s.HasField("temperature")
                          else 1.0, top_p=s.top_p or 1.0, top_k=s.top_k or -1,
                          seed=s.seed if s.HasField("seed") else None, stop_token_ids=tuple(s.stop_token_ids),
                          stop=tuple(s.stop), ignore_eos=s.ignore_eos,
                          logprobs=s.logprobs if s.HasField("logprobs") else None, priority=s.priority,
                          cache_salt=s.cache_salt or None)
    n = s.n or 1
    if n > MAX_CHOICES:
        raise InvalidRequestError(f"n must be in 1..{MAX_CHOICES}, got {n}")
    return seeded_choices(base, n)


def merged(streams) -> Iterator[tuple[int, object]]:
    """(choice index, chunk) from several router streams as they come; the first error is raised here.

    Each stream is advanced, and closed (which aborts its request), by a thread of its own: when the
    caller stops early, every pump closes its stream at its next chunk.
    """
    events: queue.Queue = queue.Queue()
    stop = threading.Event()

    def pump(index: int, stream) -> None:
        try:
            for chunk in stream:
                if stop.is_set():
                    break
                events.put((index, chunk))
        except Exception as e:  # re-raised on the caller's thread
            events.put((index, e))
        finally:
            stream.close()
            events.put((index, None))

    for i, s in enumerate(streams):
        threading.Thread(target=pump, args=(i, s), name=f"kvmesh-grpc-choice-{i}", daemon=True).start()
    remaining = len(streams)
    try:
        while remaining:
            index, item = events.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        stop.set()


class RouterServicer(pb_grpc.RouterServicer):
    def __init__(self, router: Router, keys: ApiKeys | None = None):
        self.router = router
        self.keys = keys or ApiKeys()

    def _client_of(self, context) -> str:
        """Who is asking, for the router's per-client limit: their key, else their address."""
        client = self.keys.match(dict(context.invocation_metadata()).get("authorization"))
        return client or context.peer().rpartition(":")[0]

    def _check_model(self, model: str, context) -> None:
        if model and model != self.router.model_name:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"unknown model {model!r} (serving {self.router.model_name!r})")

    def Generate(self, request, context):
        self._check_model(request.model, context)
        try:
            choices = sampling_from_proto(request.sampling)
            if request.WhichOneof("prompt") == "text":
                prompt_ids = self.router.tokenize(request.text)
            else:
                prompt_ids = list(request.token_ids.ids)
            client = self._client_of(context)
            streams = [self.router.generate(prompt_ids, params, request.session_id, client) for params in choices]
            for index, chunk in merged(streams):
                if not context.is_active():
                    return
                reply = pb.GenerateResponse(token_ids=chunk.token_ids, text=chunk.text, finished=chunk.finished,
                                            finish_reason=chunk.finish_reason, node_id=chunk.node_id, index=index,
                                            logprobs=chunk.logprobs)
                for top in chunk.top_logprobs:
                    reply.top_logprobs.add(token_ids=[t for t, _ in top], logprobs=[v for _, v in top])
                if chunk.finished:
                    reply.usage.prompt_tokens = chunk.prompt_tokens
                    reply.usage.completion_tokens = chunk.completion_tokens
                    for key in PROMPT_TOKEN_SOURCES:
                        setattr(reply.cache, key, getattr(chunk.cache, key))
                yield reply
        except InvalidRequestError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except Overloaded as e:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except RequestTimeout as e:
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(e))
        except KvmeshError as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(e))

    def Tokenize(self, request, context):
        self._check_model(request.model, context)
        return pb.TokenizeResponse(token_ids=self.router.tokenize(request.text))

    def ListModels(self, request, context):
        return pb.ListModelsResponse(models=[self.router.model_name])

    def ClusterStatus(self, request, context):
        return pb.ClusterStatusResponse(nodes=[
            pb.NodeStatus(node_id=n["node_id"], role=n["role"], requests_endpoint=n["requests"],
                          in_flight=n["in_flight"], stats_json=json.dumps(n["stats"]))
            for n in self.router.status()])


class BearerTokenInterceptor(grpc.ServerInterceptor):
    """Refuses calls without ``authorization: Bearer <key>`` of one of ``keys`` (health and reflection stay
    open)."""

    _OPEN = ("/grpc.health.v1.Health/", "/grpc.reflection.")

    def __init__(self, keys: ApiKeys):
        self._keys = keys

        def deny(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

        self._deny = grpc.unary_unary_rpc_method_handler(deny)
        self._deny_stream = grpc.unary_stream_rpc_method_handler(deny)

    def intercept_service(self, continuation, details):
        if details.method.startswith(self._OPEN):
            return continuation(details)
        if self._keys.match(dict(details.invocation_metadata).get("authorization")) is not None:
            return continuation(details)
        return self._deny_stream if details.method.endswith("/Generate") else self._deny


def _follow_readiness(router: Router, health_servicer, period_s: float = 0.5) -> None:
    """Keep the health service's status in step with ``router.readiness()`` until the router closes."""
    import threading

    def update() -> None:
        ready = router.readiness()[0]
        status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            health_servicer.set(name, status)

    def loop() -> None:
        while not router.closed.wait(period_s):  # as long as the router lives
            try:
                update()
            except Exception:  # the router is closing
                return

    update()
    threading.Thread(target=loop, name="kvmesh-grpc-health", daemon=True).start()


SPARE_THREADS = 16  # beyond the router's in-flight limit: refusals, health checks, listings


def start_grpc_server(router: Router, address: str = "127.0.0.1:50051", max_workers: int | None = None,
                      token: str | ApiKeys | None = None, tls: tuple[bytes, bytes] | None = None
                      ) -> tuple[grpc.Server, int]:
    """Start serving; returns the server and the bound port (``:0`` picks a free one).

    Each call holds a thread while it runs: the pool has one per request the router admits
    (``max_in_flight``) and ``SPARE_THREADS`` more, so a call past the limit is refused at once
    (RESOURCE_EXHAUSTED) instead of queueing, and health checks are answered while the router is full.
    ``token``: require ``authorization: Bearer <key>`` (one key, or ``ApiKeys``); ``tls``: (PEM key, PEM
    certificate chain).
    """
    max_workers = max_workers or router.cfg.max_in_flight + SPARE_THREADS
    keys = token if isinstance(token, ApiKeys) else ApiKeys([token] if token else [])
    interceptors = [BearerTokenInterceptor(keys)] if keys.enabled else []
    # grpc.so_reuseport off: a second server on a taken port fails instead of sharing it with the first.
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), interceptors=interceptors,
                         options=[("grpc.so_reuseport", 0)])
    pb_grpc.add_RouterServicer_to_server(RouterServicer(router, keys), server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    try:
        if tls is not None:
            port = server.add_secure_port(address, grpc.ssl_server_credentials([tls]))
        else:
            port = server.add_insecure_port(address)
    except RuntimeError:  # grpcio raises where older releases returned 0
        port = 0
    if port == 0:
        raise KvmeshError(f"gRPC cannot listen on {address}: the port is taken or the address is not ours")
    server.start()
    _follow_readiness(router, health_servicer)
    return server, port
