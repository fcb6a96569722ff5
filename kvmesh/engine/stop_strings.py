"""StopStrings: where a request's output text first contains one of its stop strings, in time linear in the output.

Decoding the whole output again for every new token (to search it) costs time quadratic in its length. Here the
text settles token by token through an ``IncrementalDetokenizer`` (``kvmesh/detokenizer.py``) and only the new
text, with the few characters before it that could begin a stop string, is searched: a stop string found is the
first one in the whole text, since every earlier position was searched when its text settled. Text settles in
whole characters: a stop string followed by part of a multi-byte character is seen when that character completes
(a few tokens later at most; the text cut is the same).
"""
from __future__ import annotations

from kvmesh.detokenizer import IncrementalDetokenizer
from kvmesh.engine.sampling_params import first_stop
from kvmesh.tokenizer import Tokenizer


class StopStrings:
    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...]):
        self._stop = stop
        self._detokenizer = IncrementalDetokenizer(tokenizer)
        self._chunks: list[str] = []  # the settled text, in pieces (joined once, when a stop string cuts it)
        self._tail = ""  # the settled text's last characters that could begin a stop string
        self._keep = max(len(s) for s in stop) - 1

    def text_before_stop(self, output_token_ids: list[int]) -> str | None:
        """The output's text up to the first stop string, once the tokens so far complete one; else None."""
        new_text = self._detokenizer.update(output_token_ids)
        if not new_text:
            return None
        window = self._tail + new_text
        cut = first_stop(window, self._stop)
        if cut >= 0:
            before = self._detokenizer.num_chars - len(new_text)  # characters before ``new_text``
            return "".join((*self._chunks, new_text))[: before - len(self._tail) + cut]
        self._chunks.append(new_text)
        self._tail = window[-self._keep:] if self._keep else ""
        return None
