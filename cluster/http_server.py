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
import time
import uuid

from aiohttp import web

from kvmesh.cluster.router import Overloaded, Router
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.errors import InvalidRequestError, KvmeshError

MAX_BODY_BYTES = 1 << 20


def _error(status: int, message: str, kind: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)


def _sampling(body: dict, chat: bool) -> SamplingParams:
    """OpenAI request fields -> SamplingParams (which validates every value and type)."""
    stop = body.get("stop") or ()
    if chat:  # chat: logprobs is a flag, top_logprobs the number of alternatives
        if body.get("top_logprobs") and not body.get("logprobs"):
            raise InvalidRequestError("top_logprobs needs logprobs: true")
        logprobs = (body.get("top_logprobs") or 0) if body.get("logprobs") is True else None
        if body.get("logprobs") not in (None, True, False):
            raise InvalidRequestError(f"logprobs must be true or false for chat, got {body.get('logprobs')!r}")
    else:
        logprobs = body.get("logprobs")
    max_tokens = body.get("max_tokens", body.get("max_completion_tokens"))
    temperature, top_p, top_k = body.get("temperature"), body.get("top_p"), body.get("top_k")
    return SamplingParams(max_tokens=16 if max_tokens is None else max_tokens,
                          temperature=1.0 if temperature is None else temperature,
                          top_p=1.0 if top_p is None else top_p, top_k=-1 if top_k is None else top_k,
                          seed=body.get("seed"), ignore_eos=body.get("ignore_eos", False),  # a vLLM extension
                          logprobs=logprobs,
                          stop=(stop,) if isinstance(stop, str) else tuple(stop) if isinstance(stop, list) else stop)


def _message_text(content) -> str:
    """A chat message's content: a string, or a list of parts whose text parts are joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        texts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                raise InvalidRequestError(f"message content part of type {kind!r} is not supported (only 'text')")
            texts.append(part["text"])
        return "".join(texts)
    raise InvalidRequestError("message content must be a string or a non-empty list of text parts")


# Fields this server does not implement yet: asking for them is a 400 naming the field, never silently ignored.
_UNSUPPORTED = {"n": lambda v: v not in (None, 1), "best_of": lambda v: v not in (None, 1),
                "echo": lambda v: v not in (None, False), "presence_penalty": lambda v: v not in (None, 0, 0.0),
                "frequency_penalty": lambda v: v not in (None, 0, 0.0), "logit_bias": lambda v: bool(v),
                "repetition_penalty": lambda v: v not in (None, 1, 1.0), "tools": lambda v: bool(v),
                "response_format": lambda v: v not in (None, {"type": "text"})}


def _refuse_unsupported(body: dict) -> None:
    for name, used in _UNSUPPORTED.items():
        if name in body and used(body[name]):
            raise InvalidRequestError(f"'{name}' is not supported by this server (got {body[name]!r})")


def _logprobs(tokenizer, chunks, chat: bool) -> dict | None:
    """The OpenAI ``logprobs`` object of these chunks' tokens (None when none were asked for)."""
    entries = [(tok, lp, top) for c in chunks for tok, lp, top in zip(c.token_ids, c.logprobs,
                                                                       c.top_logprobs or [[]] * len(c.logprobs))]
    if not any(c.logprobs for c in chunks):
        return None
    text = lambda t: tokenizer.decode([t])  # noqa: E731
    if chat:
        return {"content": [{"token": text(t), "logprob": lp, "bytes": list(text(t).encode()),
                             "top_logprobs": [{"token": text(a), "logprob": v, "bytes": list(text(a).encode())}
                                              for a, v in top]} for t, lp, top in entries]}
    return {"tokens": [text(t) for t, _, _ in entries], "token_logprobs": [lp for _, lp, _ in entries],
            "top_logprobs": [{text(a): v for a, v in top} for _, _, top in entries]}


def _usage(chunk) -> dict:
    cached = int(chunk.cache.get("tokens_reused_local", 0)) + int(chunk.cache.get("tokens_reused_remote", 0))
    return {"prompt_tokens": chunk.prompt_tokens, "completion_tokens": chunk.completion_tokens,
            "total_tokens": chunk.prompt_tokens + chunk.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _bearer_middleware(token: str):
    expected = f"Bearer {token}"

    @web.middleware
    async def check(request: web.Request, handler):
        if request.path.startswith("/v1/") and request.headers.get("Authorization") != expected:
            return _error(401, "missing or wrong bearer token", "authentication_error")
        return await handler(request)

    return check


class OpenAIServer:
    def __init__(self, router: Router, token: str | None = None):
        self.router = router
        middlewares = [_bearer_middleware(token)] if token else []
        self.app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=middlewares)
        self.app.router.add_get("/v1/models", self.models)
        self.app.router.add_post("/v1/completions", self.completions)
        self.app.router.add_post("/v1/chat/completions", self.chat_completions)
        self.app.router.add_get("/health", self.health)
        self.app.router.add_get("/ready", self.ready)
        self.app.router.add_get("/metrics", self.metrics)

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
            {"id": self.router.model_name, "object": "model", "created": 0, "owned_by": "kvmesh"}]})

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
        try:
            body = await self._body(request)
            prompt_ids = self._prompt(body, chat)
            params = _sampling(body, chat)
            stream = self.router.generate(prompt_ids, params, str(body.get("user") or ""))
            first = await asyncio.to_thread(next, stream)  # validation and admission happen here
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
            return await self._stream(request, stream, first, rid, chat, bool(
                (body.get("stream_options") or {}).get("include_usage")))
        chunks = [first]
        if not first.finished:
            try:
                chunks += await asyncio.to_thread(list, stream)
            except KvmeshError as e:  # cut off mid-generation and not migratable: never a partial 200
                return _error(503, f"the answer was cut off: {e}", "service_unavailable")
        text = "".join(c.text for c in chunks)
        last = chunks[-1]
        logprobs = _logprobs(self.router.tokenizer, chunks, chat)
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                   "finish_reason": last.finish_reason}
                  if chat else {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": last.finish_reason})
        return web.json_response({"id": rid, "object": "chat.completion" if chat else "text_completion",
                                  "created": int(time.time()), "model": self.router.model_name,
                                  "choices": [choice], "usage": _usage(last)})

    def _prompt(self, body: dict, chat: bool) -> list[int]:
        _refuse_unsupported(body)
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
                raise InvalidRequestError("messages must be a non-empty list of {role, content} objects")
            messages = [{**m, "content": _message_text(m.get("content"))} for m in messages]
            return self.router.tokenize(self.router.tokenizer.apply_chat_template(messages))
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return self.router.tokenize(prompt)
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return prompt
        if isinstance(prompt, list):
            raise InvalidRequestError("a list of prompts is not supported: send one prompt per request")
        raise InvalidRequestError("prompt must be a string or a list of token ids")

    async def _stream(self, request, stream, first, rid: str, chat: bool, include_usage: bool) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        created, model = int(time.time()), self.router.model_name

        async def send(payload: dict) -> None:
            await response.write(f"data: {json.dumps(payload)}\n\n".encode())

        def chunk_payload(text: str, finish_reason: str | None, role: bool = False, logprobs=None) -> dict:
            if chat:
                delta = {"role": "assistant", "content": text} if role else {"content": text}
                choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
            else:
                choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
            return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
                    "model": model, "choices": [choice]}

        chunk, is_first = first, True
        try:
            while True:
                await send(chunk_payload(chunk.text, chunk.finish_reason if chunk.finished else None, is_first,
                                         _logprobs(self.router.tokenizer, [chunk], chat)))
                is_first = False
                if chunk.finished:
                    if include_usage:
                        await send({"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                                    "created": created, "model": model, "choices": [], "usage": _usage(chunk)})
                    break
                chunk = await asyncio.to_thread(next, stream, None)
                if chunk is None:
                    raise KvmeshError("the stream ended without a final chunk")
        except (ConnectionResetError, asyncio.CancelledError):
            stream.close()  # the client went away
            raise
        except KvmeshError as e:  # cut off and not migratable: say so, never "stop" or "length"
            payload = chunk_payload("", "error")
            payload["error"] = {"message": str(e), "type": "service_unavailable"}
            await send(payload)
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


async def start_http_server(router: Router, host: str = "127.0.0.1", port: int = 8000, token: str | None = None,
                            tls: tuple[str, str] | None = None) -> tuple[web.AppRunner, int]:
    """Serve until ``runner.cleanup()``; ``token`` requires a bearer token on /v1/*, ``tls`` = (cert, key) files."""
    ssl_context = None
    if tls is not None:
        import ssl

        ssl_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ssl_context.load_cert_chain(*tls)
    runner = web.AppRunner(OpenAIServer(router, token).app)
    await runner.setup()
    site = web.TCPSite(runner, host, port, ssl_context=ssl_context)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]
