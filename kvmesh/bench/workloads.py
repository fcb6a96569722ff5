"""Benchmark workloads: lists of requests with arrival times (or none, for closed-loop driving).

- ``shared_prefix``: groups x prompts sharing a system prompt (SGLang's generator's parameters:
  groups, prompts per group, system prompt length, question length, output length);
- ``multi_turn``: conversations whose every turn extends the previous prompt and its answer
  (the answer is only known at run time, so a turn carries its conversation and index);
- ``random``: independent prompts;
- ``mooncake_trace``: Mooncake's JSONL (timestamp ms, input_length, output_length, hash_ids of
  512-token blocks); each hash id maps to the same synthetic 512 tokens everywhere, so shared
  ids mean shared prefixes;
- ``sharegpt``: ShareGPT-style JSON, first human message as the prompt.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class BenchRequest:
    prompt_ids: list[int]
    max_tokens: int
    arrival_s: float | None = None  # None: closed loop (as soon as a worker is free)
    conversation: int = -1  # multi-turn: which conversation, which turn
    turn: int = 0
    follow_up: list[int] = field(default_factory=list)  # multi-turn: the user's next message


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


def shared_prefix(groups: int, per_group: int, system_len: int, question_len: int, output_len: int, vocab: int,
                  seed: int = 0) -> list[BenchRequest]:
    rng = random.Random(seed)
    systems = [_tokens(rng, system_len, vocab) for _ in range(groups)]
    return [BenchRequest(systems[g] + _tokens(rng, question_len, vocab), output_len)
            for _ in range(per_group) for g in range(groups)]  # groups interleaved, as they arrive in practice


def multi_turn(conversations: int, turns: int, first_len: int, turn_len: int, output_len: int, vocab: int,
               seed: int = 0) -> list[list[BenchRequest]]:
    """One list per conversation; turn k's prompt is built at run time from turn k-1 and its answer."""
    rng = random.Random(seed)
    return [[BenchRequest(_tokens(rng, first_len, vocab) if t == 0 else [], output_len, conversation=c, turn=t,
                          follow_up=_tokens(rng, turn_len, vocab)) for t in range(turns)]
            for c in range(conversations)]


def random_prompts(num: int, min_len: int, max_len: int, output_len: int, vocab: int, seed: int = 0) -> list[BenchRequest]:
    rng = random.Random(seed)
    return [BenchRequest(_tokens(rng, rng.randint(min_len, max_len), vocab), output_len) for _ in range(num)]


def mooncake_trace(path: str | Path, vocab: int, max_len: int, time_scale: float = 1.0) -> list[BenchRequest]:
    out = []
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        prompt: list[int] = []
        for hash_id in row["hash_ids"]:
            prompt += _tokens(random.Random(f"mooncake-{hash_id}"), 512, vocab)
        prompt = prompt[: min(int(row["input_length"]), max_len)]
        out.append(BenchRequest(prompt, max(1, int(row["output_length"])),
                                arrival_s=float(row["timestamp"]) / 1000 * time_scale))
    return out


def sharegpt(path: str | Path, tokenize, num: int, max_len: int, seed: int = 0) -> list[BenchRequest]:
    data = json.loads(Path(path).read_text())
    rng = random.Random(seed)
    rng.shuffle(data)
    out = []
    for item in data:
        turns = item.get("conversations") or []
        if len(turns) < 2 or turns[0].get("from") != "human":
            continue
        prompt = tokenize(turns[0]["value"])[:max_len]
        answer = tokenize(turns[1]["value"])
        if prompt:
            out.append(BenchRequest(prompt, max(1, min(len(answer), 256))))
        if len(out) == num:
            break
    return out


def poisson_arrivals(requests: list[BenchRequest], rate: float, seed: int = 0) -> None:
    """Give requests Poisson arrival times at ``rate`` requests per second (in place)."""
    rng = random.Random(seed)
    t = 0.0
    for r in requests:
        t += rng.expovariate(rate)
        r.arrival_s = t
