"""NodeClient: send GenerateRequests to a decode node and collect the streamed tokens."""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

import zmq

from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.errors import KvmeshError
from kvmesh.node import messages as nm
from kvmesh.wire import decode, encode


class RequestFailed(KvmeshError, RuntimeError):
    pass


@dataclass
class Completion:
    request_id: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    error: str = ""
    stats: dict = field(default_factory=dict)
    ttft_s: float = 0.0
    latency_s: float = 0.0


def sampling_dict(params: SamplingParams) -> dict:
    """SamplingParams as the ``sampling`` map of a GenerateRequest."""
    out = {"max_tokens": params.max_tokens, "temperature": params.temperature, "top_p": params.top_p,
           "top_k": params.top_k, "ignore_eos": params.ignore_eos, "stop_token_ids": list(params.stop_token_ids)}
    if params.seed is not None:
        out["seed"] = params.seed
    return out


class NodeClient:
    """One DEALER per client; many requests can be in flight at once (``generate_many``)."""

    def __init__(self, endpoint: str):
        self.endpoint = endpoint
        self._sock = zmq.Context.instance().socket(zmq.DEALER)
        self._sock.linger = 0
        self._sock.connect(f"tcp://{endpoint}")

    def generate_many(self, prompts: list[list[int]], params: SamplingParams, timeout_s: float = 120.0,
                      prefill_node: str = "", liveness_s: float = 3.0) -> list[Completion]:
        """Send every prompt, collect every stream; raises RequestFailed when the decode node goes quiet.

        After ``liveness_s`` without a message the node is pinged; no answer within another
        ``liveness_s`` means it is gone (requests are not migrated here: the router does that).
        """
        start = time.perf_counter()
        completions = {}
        for prompt in prompts:
            rid = uuid.uuid4().hex
            completions[rid] = Completion(rid)
            self._sock.send(encode(nm.GenerateRequest(rid, list(prompt), sampling_dict(params), prefill_node)))
        pending = set(completions)
        deadline = time.monotonic() + timeout_s
        pinged = False
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RequestFailed(f"{len(pending)} of {len(prompts)} requests unfinished after {timeout_s} s "
                                    f"(decode node {self.endpoint})")
            if not self._sock.poll(min(remaining, liveness_s) * 1000):
                if pinged:
                    raise RequestFailed(f"decode node {self.endpoint} stopped answering; {len(pending)} of "
                                        f"{len(prompts)} requests lost with it")
                self._sock.send(encode(nm.StatsRequest()))
                pinged = True
                continue
            pinged = False
            event = decode(self._sock.recv(), (nm.TokenEvent, nm.StatsReply))
            if isinstance(event, nm.StatsReply):
                continue  # the node is alive, just busy
            c = completions.get(event.request_id)
            if c is None:
                continue
            if event.token_ids and not c.token_ids:
                c.ttft_s = time.perf_counter() - start
            c.token_ids += event.token_ids
            if event.finished:
                c.finish_reason, c.error, c.stats = event.finish_reason, event.error, event.stats
                c.latency_s = time.perf_counter() - start
                pending.discard(event.request_id)
        return list(completions.values())

    def generate(self, prompt: list[int], params: SamplingParams, **kwargs) -> Completion:
        return self.generate_many([prompt], params, **kwargs)[0]

    def stats(self, check: bool = False, timeout_s: float = 10.0) -> dict:
        self._sock.send(encode(nm.StatsRequest(check)))
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self._sock.poll(remaining * 1000):
                raise RequestFailed(f"no stats from {self.endpoint}")
            reply = decode(self._sock.recv(), (nm.StatsReply, nm.TokenEvent))
            if isinstance(reply, nm.StatsReply):
                break  # token events here belong to requests already given up on
        if reply.error:
            raise RequestFailed(f"{reply.node_id}: {reply.error}")
        return reply.stats

    def close(self) -> None:
        self._sock.close()
