"""The OpenAI-compatible HTTP front end (aiohttp): /v1/models, /v1/completions, /v1/chat/completions.

Streaming responses are server-sent events ending with ``data: [DONE]``, as the
official ``openai`` client expects. ``usage.prompt_tokens_details.cached_tokens``
counts prompt tokens reused from any cache (local or a peer's). Errors use
OpenAI's shape: 400 for bad input, 429 when the router is full, 503 when no
node can serve.
"""
from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid

from aiohttp import web

from kvmesh.cluster import openai_protocol as proto
from kvmesh.cluster.api_keys import ApiKeys
from kvmesh.cluster.router import Overloaded, Router
from kvmesh.errors import InvalidRequestError, KvmeshError

MAX_BODY_BYTES = 1 << 20


def _error(status: int, message: str, kind: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)


OPEN_PATHS = ("/health", "/ready")  # probes: everything else needs a key when keys are set
CLIENT = web.RequestKey("client", str)  # the API key's client id, set by the bearer check


@web.middleware
async def _body_size_middleware(request: web.Request, handler):
    """A body declared larger than the limit is refused before a byte of it is read (never a wait for bytes
    that will not come)."""
    if request.content_length is not None and request.content_length > MAX_BODY_BYTES:
        response = _error(413, f"the body is larger than {MAX_BODY_BYTES} bytes", "invalid_request_error")
        response.force_close()
        return response
    return await handler(request)


def _bearer_middleware(keys: ApiKeys):
    @web.middleware
    async def check(request: web.Request, handler):
        if request.path not in OPEN_PATHS:
            client = keys.match(request.headers.get("Authorization"))
            if client is None:
                return _error(401, "missing or wrong bearer token", "authentication_error")
            request[CLIENT] = client
        return await handler(request)

    return check


class OpenAIServer:
    def __init__(self, router: Router, token: str | ApiKeys | None = None):
        self.router = router
        keys = token if isinstance(token, ApiKeys) else ApiKeys([token] if token else [])
        middlewares = [_body_size_middleware] + ([_bearer_middleware(keys)] if keys.enabled else [])
        self.app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=middlewares)
        self.app.router.add_get("/v1/models", self.models)
        self.app.router.add_post("/v1/completions", self.completions)
        self.app.router.add_post("/v1/chat/completions", self.chat_completions)
        self.app.router.add_get("/health", self.health)
        self.app.router.add_get("/ready", self.ready)
        self.app.router.add_get("/metrics", self.metrics)
        self.app.router.add_post("/tokenize", self.tokenize)
        self.app.router.add_post("/detokenize", self.detokenize)
        self.app.router.add_get("/admin/status", self.cluster_status)
        self.app.router.add_get("/admin/pins", self.list_pins)
        self.app.router.add_post("/admin/pins", self.pin)
        self.app.router.add_delete("/admin/pins/{pin_id}", self.unpin)

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def ready(self, request: web.Request) -> web.Response:
        """200 while a decode node can take requests, else 503; the body says which processes are up."""
        ready, detail = await asyncio.to_thread(self.router.readiness)
        return web.json_response(detail, status=200 if ready else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        body = await asyncio.to_thread(self.router.metrics.exposition)
        return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.router.model_name, "object": "model", "created": 0, "owned_by": "kvmesh",
             "max_model_len": self.router.max_model_len}]})

    async def tokenize(self, request: web.Request) -> web.Response:
        """{"prompt": str} or {"messages": [...]} (with the chat template) -> {"tokens", "count", "max_model_len"}."""
        try:
            body = await self._body(request)
            if "messages" in body:
                tokens = self._prompts({"messages": body["messages"]}, chat=True)[0]
            elif isinstance(body.get("prompt"), str):
                tokens = self.router.tokenize(body["prompt"])
            else:
                raise InvalidRequestError("tokenize takes a string prompt or chat messages")
        except InvalidRequestError as e:
            return _error(400, str(e), "invalid_request_error")
        return web.json_response({"tokens": tokens, "count": len(tokens), "max_model_len": self.router.max_model_len})

    async def pin(self, request: web.Request) -> web.Response:
        """{"text": str} or {"tokens": [ids]}, optional "label" -> the pin: kept on every node until unpinned."""
        try:
            body = await self._body(request)
            if isinstance(body.get("text"), str):
                tokens = self.router.tokenize(body["text"])
            elif isinstance(body.get("tokens"), list):
                tokens = body["tokens"]
            else:
                raise InvalidRequestError("pin takes {\"text\": str} or {\"tokens\": [token ids]}")
            label = body.get("label", "")
            if not isinstance(label, str):
                raise InvalidRequestError("label must be a string")
            pinned = await asyncio.to_thread(self.router.pin, tokens, label)
        except InvalidRequestError as e:
            return _error(400, str(e), "invalid_request_error")
        return web.json_response(pinned)

    async def unpin(self, request: web.Request) -> web.Response:
        pin_id = request.match_info["pin_id"]
        if not await asyncio.to_thread(self.router.unpin, pin_id):
            return _error(404, f"no pin {pin_id!r}", "not_found_error")
        return web.json_response({"id": pin_id, "unpinned": True})

    async def cluster_status(self, request: web.Request) -> web.Response:
        """The cluster as ``kvmesh status`` shows it (``Router.cluster_view``)."""
        return web.json_response(await asyncio.to_thread(self.router.cluster_view))

    async def list_pins(self, request: web.Request) -> web.Response:
        return web.json_response({"pins": await asyncio.to_thread(self.router.pins)})

    async def detokenize(self, request: web.Request) -> web.Response:
        """{"tokens": [ids]} -> {"prompt": text}."""
        try:
            body = await self._body(request)
            tokens = body.get("tokens")
            if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                       and 0 <= t < self.router.vocab_size for t in tokens):
                raise InvalidRequestError(f"tokens must be a list of token ids in [0, {self.router.vocab_size})")
        except InvalidRequestError as e:
            return _error(400, str(e), "invalid_request_error")
        return web.json_response({"prompt": self.router.tokenizer.decode(tokens)})

    async def _body(self, request: web.Request) -> dict:
        try:
            body = await request.json()
        except web.HTTPRequestEntityTooLarge:
            raise
        except Exception:
            raise InvalidRequestError("the body is not valid JSON") from None
        if not isinstance(body, dict):
            raise InvalidRequestError("the body must be a JSON object")
        model = body.get("model")
        if model not in (None, self.router.model_name):
            raise InvalidRequestError(f"unknown model {model!r} (serving {self.router.model_name!r})")
        return body

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def _serve(self, request: web.Request, chat: bool) -> web.StreamResponse:
        """One generation per (prompt, n) choice, run concurrently; admitted all together or not at all."""
        streams = []
        try:
            body = await self._body(request)
            prompts = self._prompts(body, chat)
            params = proto.choice_params(body, proto.sampling_params(body, chat))
            if len(prompts) * len(params) > proto.MAX_CHOICES:
                raise InvalidRequestError(f"{len(prompts)} prompts x n={len(params)} is more than "
                                          f"{proto.MAX_CHOICES} choices")
            user = str(body.get("user") or "")
            client = request.get(CLIENT) or request.remote or ""
            streams = [_Stream(self.router.generate(p, sp, user, client)) for p in prompts for sp in params]
            firsts = await asyncio.gather(*(asyncio.to_thread(s.next) for s in streams), return_exceptions=True)
            failure = next((f for f in firsts if isinstance(f, BaseException)), None)
            if failure is not None:  # validation or admission failed for one: none of them runs
                _close_all(streams)
                raise failure
        except web.HTTPRequestEntityTooLarge:
            return _error(413, f"the body is larger than {MAX_BODY_BYTES} bytes", "invalid_request_error")
        except (InvalidRequestError, ValueError, TypeError, KeyError) as e:
            return _error(400, str(e), "invalid_request_error")
        except Overloaded as e:
            return _error(429, str(e), "rate_limit_exceeded")
        except KvmeshError as e:
            return _error(503, str(e), "service_unavailable")
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        if body.get("stream"):
            options = body.get("stream_options") or {}
            return await self._stream(request, streams, firsts, rid, chat, bool(options.get("include_usage")),
                                      bool(options.get("continuous_usage_stats")), len(params))
        try:
            rests = await asyncio.gather(*(asyncio.to_thread(s.rest) if not f.finished else _nothing()
                                           for s, f in zip(streams, firsts)))
        except KvmeshError as e:  # cut off mid-generation and not migratable: never a partial 200
            _close_all(streams)
            return _error(503, f"the answer was cut off: {e}", "service_unavailable")
        choices, lasts = [], []
        for index, (first, rest) in enumerate(zip(firsts, rests)):
            chunks = [first, *rest]
            text, last = "".join(c.text for c in chunks), chunks[-1]
            logprobs = proto.logprobs_object(self.router.tokenizer, chunks, chat)
            choices.append({"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                            "finish_reason": last.finish_reason} if chat else
                           {"index": index, "text": text, "logprobs": logprobs, "finish_reason": last.finish_reason})
            lasts.append(last)
        return web.json_response({"id": rid, "object": "chat.completion" if chat else "text_completion",
                                  "created": int(time.time()), "model": self.router.model_name,
                                  "choices": choices, "usage": _total_usage(lasts, len(params))})

    def _prompts(self, body: dict, chat: bool) -> list[list[int]]:
        proto.refuse_unsupported(body, chat)
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
                raise InvalidRequestError("messages must be a non-empty list of {role, content} objects")
            for m in messages:
                if m.get("role") not in proto.CHAT_ROLES:
                    raise InvalidRequestError(f"message role must be one of {', '.join(proto.CHAT_ROLES)}, "
                                              f"got {m.get('role')!r}")
            messages = [{**m, "content": proto.message_text(m.get("content"))} for m in messages]
            return [self.router.tokenize(self.router.tokenizer.apply_chat_template(messages))]
        return proto.completion_prompts(body, self.router.tokenize)

    async def _stream(self, request, streams, firsts, rid: str, chat: bool, include_usage: bool,
                      continuous_usage: bool, n: int) -> web.StreamResponse:
        """Every choice's chunks as they come (``index`` tells them apart), then usage, then [DONE]."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        created, model = int(time.time()), self.router.model_name
        kind = "chat.completion.chunk" if chat else "text_completion"
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, stream, first) -> None:
            chunk = first
            try:
                while True:
                    await merged.put((index, chunk))
                    if chunk.finished:
                        return
                    chunk = await asyncio.to_thread(stream.next)
                    if chunk is None:
                        raise KvmeshError("the stream ended without a final chunk")
            except KvmeshError as e:
                await merged.put((index, e))

        def payload(index: int, text: str, finish_reason: str | None, role: bool, logprobs=None) -> dict:
            if chat:
                delta = {"role": "assistant", "content": text} if role else {"content": text}
                choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
            else:
                choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
            return {"id": rid, "object": kind, "created": created, "model": model, "choices": [choice]}

        async def send(body: dict) -> None:
            await response.write(f"data: {json.dumps(body)}\n\n".encode())

        pumps = [asyncio.create_task(pump(i, s, f)) for i, (s, f) in enumerate(zip(streams, firsts))]
        started, lasts, open_choices = set(), {}, len(streams)
        offsets: dict[int, int] = {}  # per choice: where its next token's text starts (logprobs' text_offset)
        try:
            while open_choices:
                index, item = await merged.get()
                if isinstance(item, KvmeshError):  # cut off and not migratable: say so, never "stop" or "length"
                    body = payload(index, "", "error", False)
                    body["error"] = {"message": str(item), "type": "service_unavailable"}
                    await send(body)
                    open_choices -= 1
                    continue
                logprobs = proto.logprobs_object(self.router.tokenizer, [item], chat, offsets.get(index, 0))
                if logprobs is not None and not chat and logprobs["tokens"]:
                    offsets[index] = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
                body = payload(index, item.text, item.finish_reason if item.finished else None, index not in started,
                               logprobs)
                started.add(index)
                if continuous_usage and item.finished:
                    body["usage"] = proto.usage(item)
                await send(body)
                if item.finished:
                    lasts[index] = item
                    open_choices -= 1
            if include_usage and len(lasts) == len(streams):
                await send({"id": rid, "object": kind, "created": created, "model": model, "choices": [],
                            "usage": _total_usage([lasts[i] for i in range(len(streams))], n)})
        except ConnectionResetError:  # the client went away: its requests end, nothing to log
            _close_all(streams)
            return response
        except asyncio.CancelledError:
            _close_all(streams)
            raise
        finally:
            for task in pumps:
                task.cancel()
        try:
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        except ConnectionResetError:
            pass
        return response


async def _nothing() -> list:
    return []


class _Stream:
    """A router stream read in executor threads: a read and a close never run at once (a generator cannot be
    closed while another thread is inside it), so a close waits for a read in flight to return."""

    def __init__(self, generator):
        self._generator = generator
        self._lock = threading.Lock()

    def next(self):
        with self._lock:
            return next(self._generator, None)

    def rest(self) -> list:
        with self._lock:
            return list(self._generator)

    def close(self) -> None:
        """Ends the stream (its request is aborted on the node)."""
        with self._lock:
            self._generator.close()


def _close_all(streams: list[_Stream]) -> None:
    """Close every stream in the background: a read in flight (until the node's next chunk or the router's
    timeout) never holds up the event loop."""
    loop = asyncio.get_running_loop()
    for stream in streams:
        loop.run_in_executor(None, stream.close)


def _total_usage(lasts: list, n: int) -> dict:
    """Prompt tokens once per prompt (every n-th choice starts a prompt), completion tokens of every choice."""
    per_prompt = [proto.usage(c) for c in lasts[::n]]
    prompt = sum(u["prompt_tokens"] for u in per_prompt)
    completion = sum(proto.usage(c)["completion_tokens"] for c in lasts)
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in per_prompt)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


async def start_http_server(router: Router, host: str = "127.0.0.1", port: int = 8000, token: str | None = None,
                            tls: tuple[str, str] | None = None) -> tuple[web.AppRunner, int]:
    """Serve until ``runner.cleanup()``; ``token`` requires a bearer token on /v1/*, ``tls`` = (cert, key) files."""
    ssl_context = None
    if tls is not None:
        import ssl

        ssl_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ssl_context.load_cert_chain(*tls)
    # Streams wait in threads (a chunk each, or a whole non-streamed choice): a pool sized for the router's
    # in-flight limit, so that n=16 requests cannot starve the rest.
    from concurrent.futures import ThreadPoolExecutor

    asyncio.get_running_loop().set_default_executor(
        ThreadPoolExecutor(router.cfg.max_in_flight + 16, thread_name_prefix="kvmesh-http"))
    # On shutdown, open streams get 3 s to finish (aiohttp's default is 60 s: a SIGTERM'd router seemed hung).
    runner = web.AppRunner(OpenAIServer(router, token).app, shutdown_timeout=3.0)
    await runner.setup()
    site = web.TCPSite(runner, host, port, ssl_context=ssl_context)
    try:
        await site.start()
    except OSError as e:
        await runner.cleanup()
        raise KvmeshError(f"HTTP cannot listen on {host}:{port}: {e.strerror or e}") from None
    return runner, site._server.sockets[0].getsockname()[1]
