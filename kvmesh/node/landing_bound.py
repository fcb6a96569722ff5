"""LandingBound: a node's prompt budget (the scheduler's ``PromptBudget`` policy): prompts computed in slices
where streams decode beside them, and steps kept short while a fetch is about to land.

The node sets, on the engine thread, as its role changes: ``slice_tokens``, one prompt's tokens per step at
most (None: the scheduler's configured ``long_prefill_token_threshold``), and ``cap_steps``, all prompts'
tokens of a step beside running decodes at most (none by default). A decode node's automatic slice is the
latter (``step_tokens``: what the node computes in ``--prompt-slice-ms`` at its fitted rate now), so
the streams wait about a slice per step however many prompts arrive at once, the prompts go one after
another (oldest first), and a prompt with no stream beside it is computed whole. (A slice per prompt let four
prompts arriving together make every step four slices long.)

A fetch's blocks join the engine at a step boundary. A step that starts just before they land and
computes a slice of some prompt holds them (and the request's first token) for that whole step. While a
fetch in flight is due within about one such step, this policy lets a step compute no prompt tokens beside
running decodes (a decode-only step), or, with nothing decoding, only the prompt tokens that fit in one
decode step's time: the landing then waits at most about one decode step. A fetch later than twice its
estimate (plus a decode step) stops bounding steps: the node's own prompts must not starve behind a stalled
peer. Engine thread only (``expect`` at admission, ``landed`` when the fetch returns, ``prompt_tokens`` in
the scheduler).
"""
from __future__ import annotations

import time
from collections.abc import Callable

PROMPT_SLICE_S = 0.1  # auto: a decode node's step beside streams computes at most this much prompt, at its fitted rate


def prompt_slice(prefill_tokens_per_s: float, block_size: int, step_budget: int,
                 slice_s: float = PROMPT_SLICE_S) -> int:
    """The automatic ``long_prefill_token_threshold`` of a decode node: the prompt tokens it computes in
    ``slice_s`` (whole blocks, one at least), so the streams decoding beside a long prompt wait that
    long per step, not for the whole prompt; 0 (no cap) where that reaches the step's budget (a GPU)."""
    tokens = int(prefill_tokens_per_s * slice_s) // block_size * block_size
    return 0 if tokens >= step_budget else max(tokens, block_size)


class LandingBound:
    def __init__(self, block_size: int, prompt_step_s: Callable[[], float], decode_step_s: Callable[[], float],
                 prefill_tokens_per_s: Callable[[], float], clock: Callable[[], float] = time.perf_counter):
        """``prompt_step_s()``: a step computing the node's usual prompt slice, estimated; ``decode_step_s()``: a
        decode step; ``prefill_tokens_per_s()``: the node's marginal prompt rate (all kept current by the node)."""
        self.block_size = block_size
        self._prompt_step_s = prompt_step_s
        self._decode_step_s = decode_step_s
        self._tokens_per_s = prefill_tokens_per_s
        self._clock = clock
        self._due: dict[str, tuple[float, float]] = {}  # request id -> (expected landing, stop bounding after)
        self.slice_tokens: int | None = None  # one prompt's tokens per step, at most (0: the step's budget)
        self._step_slice_s, self._step_budget = 0.0, 0  # ``cap_steps``
        self.num_bounded_steps = 0

    def expect(self, request_id: str, seconds: float) -> None:
        """A fetch for ``request_id`` started now and is estimated to land in ``seconds``."""
        now = self._clock()
        self._due[request_id] = (now + seconds, now + 2 * seconds + self._decode_step_s())

    def landed(self, request_id: str) -> None:
        """The fetch returned (landed, failed or aborted)."""
        self._due.pop(request_id, None)

    @property
    def num_expected(self) -> int:
        return len(self._due)

    def prompt_slice(self) -> int | None:
        return self.slice_tokens

    def cap_steps(self, slice_s: float, step_budget: int) -> None:
        """Beside running decodes, a step computes at most ``slice_s`` of prompt at the node's rate (all prompts
        together); ``slice_s`` 0: no such cap. ``step_budget``: the scheduler's tokens per step."""
        self._step_slice_s, self._step_budget = slice_s, step_budget

    @property
    def step_tokens(self) -> int:
        """The cap ``cap_steps`` set, in tokens at the node's rate now (which its prompt steps keep refitting); 0
        where there is none or where it would fill a step's budget anyway."""
        if self._step_slice_s <= 0:
            return 0
        return prompt_slice(self._tokens_per_s(), self.block_size, self._step_budget, self._step_slice_s)

    def prompt_tokens(self, num_decodes: int) -> int | None:
        cap = (self.step_tokens or None) if num_decodes else None
        if not self._due:
            return cap
        now = self._clock()
        due = [landing for landing, until in self._due.values() if now <= until]
        if not due or min(due) - now > self._prompt_step_s():
            return cap  # nothing due before a usual step would end anyway
        self.num_bounded_steps += 1
        if num_decodes:
            return 0
        tokens = int(self._decode_step_s() * self._tokens_per_s()) // self.block_size * self.block_size
        return max(tokens, self.block_size)
