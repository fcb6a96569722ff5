"""SamplingParams: how one request picks its tokens and when it stops (vLLM's names).

The one internal request model: HTTP (``cluster/openai_protocol.py``), gRPC
(``cluster/grpc_server.py``), the router, clients and nodes all build or carry
this record, with one set of defaults (OpenAI's: ``temperature`` 1, ``max_tokens``
16, ``top_p`` 1). Between processes it travels as ``to_wire()`` / ``from_wire()``;
stop strings stay with the router, which cuts the text (nodes see token ids only).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvmesh.errors import InvalidRequestError


MAX_LOGPROBS = 20
MIN_PRIORITY, MAX_PRIORITY = -1000, 1000
MAX_STOP_STRINGS, MAX_STOP_CHARS = 16, 256  # each token event scans the text for every stop string
MAX_STOP_TOKEN_IDS = 256
MAX_CACHE_SALT_CHARS = 256
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # a 64-bit signed integer (what a generator's seed and the wire carry)
GREEDY_BELOW = 1e-5  # a temperature below this is greedy (dividing logits by it overflows float32)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1: no top-k
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None  # also return this many most likely alternatives per token (0..20)
    priority: int = 0  # lower is more urgent (admitted first, preempted last); ageing bounds waits
    cache_salt: str | None = None  # prefix-cache hits only between requests with the same salt (tenants)
    # derived in __post_init__: greedy with no alternatives asked (the sampler's whole-batch path)
    argmax_only: bool = field(init=False, repr=False, compare=False, default=False)

    def __post_init__(self) -> None:
        # Accept lists from callers while keeping the frozen record hashable.
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        object.__setattr__(self, "stop", stop)
        _check_number("temperature", self.temperature)
        _check_number("top_p", self.top_p)
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not SEED_MIN <= self.seed <= SEED_MAX):
            raise InvalidRequestError(f"seed must be an integer in {SEED_MIN}..{SEED_MAX}, got {self.seed!r}")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            raise InvalidRequestError("stop_token_ids must be non-negative integers")
        if not all(isinstance(s, str) for s in self.stop):
            raise InvalidRequestError("stop must be a string or a list of strings")
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequestError(f"ignore_eos must be true or false, got {self.ignore_eos!r}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0.0):
            raise InvalidRequestError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or (self.top_k != -1 and self.top_k < 1):
            raise InvalidRequestError(f"top_k must be -1 (off) or >= 1, got {self.top_k!r}")
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty")
        if len(self.stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in self.stop):
            raise InvalidRequestError(f"at most {MAX_STOP_STRINGS} stop strings of at most {MAX_STOP_CHARS} "
                                      f"characters each")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequestError(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids, got {len(self.stop_token_ids)}")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt
                                            or len(self.cache_salt) > MAX_CACHE_SALT_CHARS):
            raise InvalidRequestError(f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} "
                                      f"characters")
        if isinstance(self.priority, bool) or not isinstance(self.priority, int) or \
                not MIN_PRIORITY <= self.priority <= MAX_PRIORITY:
            raise InvalidRequestError(f"priority must be an integer in {MIN_PRIORITY}..{MAX_PRIORITY}, "
                                      f"got {self.priority!r}")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise InvalidRequestError(f"logprobs must be an integer in 0..{MAX_LOGPROBS}, got {self.logprobs!r}")
        object.__setattr__(self, "argmax_only", self.greedy and not self.logprobs)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW or self.top_k == 1


WIRE_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "ignore_eos", "logprobs",
               "priority", "cache_salt")


def to_wire(params: SamplingParams) -> dict:
    """The fields a decode node needs, as a msgpack-friendly dict (unset optional fields left out)."""
    out = {name: getattr(params, name) for name in WIRE_FIELDS if getattr(params, name) is not None}
    out["stop_token_ids"] = list(params.stop_token_ids)
    return out


def from_wire(fields: dict) -> SamplingParams:
    """The inverse of ``to_wire``; unknown fields and bad values raise InvalidRequestError."""
    unknown = set(fields) - set(WIRE_FIELDS)
    if unknown:
        raise InvalidRequestError(f"unknown sampling fields {sorted(unknown)}")
    return SamplingParams(**fields)


def _check_number(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequestError(f"{name} must be a number, got {value!r}")


def first_stop(text: str, stop: tuple[str, ...], start: int = 0) -> int:
    """Where the earliest stop string begins in ``text`` at or after ``start``, or -1."""
    found = [i for i in (text.find(s, start) for s in stop) if i >= 0]
    return min(found, default=-1)


def stop_prefix_len(text: str, stop: tuple[str, ...]) -> int:
    """The length of the longest end of ``text`` that begins some stop string (and is shorter than it): text
    that must be held back until the next tokens complete the stop string or rule it out."""
    longest = 0
    for s in stop:
        for k in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:k]):
                longest = k
                break
    return longest
