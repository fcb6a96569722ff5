"""The OpenAI request and response shapes: body fields -> prompts and SamplingParams, chunks -> JSON.

Defaults are OpenAI's where the OpenAI API is spoken (``temperature`` 1, ``max_tokens`` 16);
``ignore_eos`` and ``priority`` (lower is more urgent) are accepted as vLLM does. A field this
server does not implement is a 400 naming it, never silently dropped.
"""
from __future__ import annotations

from dataclasses import replace

from kvmesh.engine.sampling_params import SEED_MAX, SamplingParams
from kvmesh.errors import InvalidRequestError

MAX_CHOICES = 16  # prompts x n in one request
CHAT_ROLES = ("system", "developer", "user", "assistant")


def sampling_params(body: dict, chat: bool) -> SamplingParams:
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
                          logprobs=logprobs, priority=body.get("priority", 0),  # a vLLM extension too
                          cache_salt=body.get("cache_salt"),  # vLLM's: tenants that must not share prefix hits
                          stop=(stop,) if isinstance(stop, str) else tuple(stop) if isinstance(stop, list) else stop)


def message_text(content) -> str:
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
_UNSUPPORTED = {"best_of": lambda v: v not in (None, 1),
                "echo": lambda v: v not in (None, False), "presence_penalty": lambda v: v not in (None, 0, 0.0),
                "frequency_penalty": lambda v: v not in (None, 0, 0.0), "logit_bias": lambda v: bool(v),
                "repetition_penalty": lambda v: v not in (None, 1, 1.0), "tools": lambda v: bool(v),
                "response_format": lambda v: v not in (None, {"type": "text"})}


_FIELDS = {"model", "cache_salt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n",
           "stream", "stream_options", "ignore_eos", "user", "logprobs", "priority"}
_COMPLETION_FIELDS = _FIELDS | {"prompt"}
_CHAT_FIELDS = _FIELDS | {"messages", "top_logprobs"}


def refuse_unsupported(body: dict, chat: bool) -> None:
    """400 for a field this server does not implement (named), or does not know at all."""
    for name, used in _UNSUPPORTED.items():
        if name in body and used(body[name]):
            raise InvalidRequestError(f"'{name}' is not supported by this server (got {body[name]!r})")
    unknown = sorted(set(body) - (_CHAT_FIELDS if chat else _COMPLETION_FIELDS) - set(_UNSUPPORTED))
    if unknown:
        raise InvalidRequestError(f"unknown or unsupported field(s) {', '.join(map(repr, unknown))}")


def logprobs_object(tokenizer, chunks, chat: bool, text_start: int = 0) -> dict | None:
    """The OpenAI ``logprobs`` object of these chunks' tokens (None when none were asked for); completions'
    ``text_offset``: where each token's text starts in the choice's text (``text_start``: of the first)."""
    entries = [(tok, lp, top) for c in chunks for tok, lp, top in zip(c.token_ids, c.logprobs,
                                                                       c.top_logprobs or [[]] * len(c.logprobs))]
    if not any(c.logprobs for c in chunks):
        return None
    text = lambda t: tokenizer.decode([t])  # noqa: E731
    if chat:
        return {"content": [{"token": text(t), "logprob": lp, "bytes": list(text(t).encode()),
                             "top_logprobs": [{"token": text(a), "logprob": v, "bytes": list(text(a).encode())}
                                              for a, v in top]} for t, lp, top in entries]}
    tokens = [text(t) for t, _, _ in entries]
    offsets, at = [], text_start
    for token in tokens:
        offsets.append(at)
        at += len(token)
    return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in entries],
            "top_logprobs": [{text(a): v for a, v in top} for _, _, top in entries], "text_offset": offsets}


def usage(chunk) -> dict:
    """OpenAI's usage object; ``cached_tokens``: prompt tokens whose KV was reused from any cache (the KV buffer,
    the node's host or disk tier, a peer, a prefill node's cache)."""
    cached = chunk.cache.cached_tokens
    return {"prompt_tokens": chunk.prompt_tokens, "completion_tokens": chunk.completion_tokens,
            "total_tokens": chunk.prompt_tokens + chunk.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached}}




def choice_params(body: dict, base: SamplingParams) -> list[SamplingParams]:
    """One SamplingParams per choice of ``n``: independent samples (a given seed s becomes s, s+1, ...)."""
    n = body.get("n", 1)
    if n is None:
        n = 1
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_CHOICES:
        raise InvalidRequestError(f"n must be an integer in 1..{MAX_CHOICES}, got {n!r}")
    return seeded_choices(base, n)


def seeded_choices(base: SamplingParams, n: int) -> list[SamplingParams]:
    """``n`` choices; choice i samples with ``seed + i`` (each within the seed's range: a 400 otherwise)."""
    if base.seed is not None and base.seed + n - 1 > SEED_MAX:
        raise InvalidRequestError(f"seed + n - 1 must be at most {SEED_MAX} (choice i samples with seed + i), "
                                  f"got seed {base.seed} with n={n}")
    return [replace(base, seed=base.seed + j) if base.seed is not None else base for j in range(n)]


def completion_prompts(body: dict, tokenize) -> list[list[int]]:
    """``prompt``: a string, a list of token ids, a list of strings or a list of token-id lists."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [tokenize(prompt)]
    if isinstance(prompt, list) and prompt and all(_is_token(t) for t in prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return [tokenize(p) for p in prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, list) and all(_is_token(t) for t in p)
                                                   for p in prompt):
        return [list(p) for p in prompt]
    raise InvalidRequestError("prompt must be a string, a list of token ids, a list of strings or a list of "
                              "token-id lists")


def _is_token(t) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)
