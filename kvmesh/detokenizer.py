"""IncrementalDetokenizer: the text of a growing list of tokens, each token decoded a bounded number of times.

Decoding a stream's whole output again for every new token costs time quadratic in its length. Here each
``update`` decodes only the tokens since the last settled point, twice: alone (``tokens[prefix:read]``, text
already sent) and with the new ones (``tokens[prefix:]``); the difference is the new text. A decoded window
that ends in U+FFFD (an incomplete UTF-8 sequence: a multi-byte character split over tokens) settles nothing
until the rest arrives, or the stream ends. Byte-level tokenizers decode a window the same as the whole list,
so the settled text equals ``tokenizer.decode(tokens)``.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvmesh.tokenizer import Tokenizer

INCOMPLETE = "\ufffd"


@dataclass
class IncrementalDetokenizer:
    tokenizer: Tokenizer
    num_chars: int = 0  # characters of the settled text of ``tokens[:num_read]``
    num_read: int = 0
    _prefix: int = 0  # the window starts here: the first token the previous settling read

    def update(self, tokens: list[int], final: bool = False) -> str:
        """``tokens``: the stream so far (only ever appended to); returns the text it settles now (appended to
        what earlier calls returned: the whole settled text is their concatenation; nothing is copied again).
        ``final``: the stream ends here, so an incomplete character at its end is settled as U+FFFD (as a whole
        decode gives)."""
        if len(tokens) == self.num_read:
            return ""
        settled = self.tokenizer.decode(tokens[self._prefix:self.num_read])
        window = self.tokenizer.decode(tokens[self._prefix:])
        if not final and (len(window) <= len(settled) or window.endswith(INCOMPLETE)):
            return ""  # nothing new yet, or a character still arriving
        self._prefix, self.num_read = self.num_read, len(tokens)
        new_text = window[len(settled):]
        self.num_chars += len(new_text)
        return new_text
