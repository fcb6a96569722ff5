"""IncrementalDetokenizer against a whole decode: the same text for any split of a stream into events, each token
decoded a bounded number of times (not once per later token), no incomplete character settled early."""
from __future__ import annotations

import random

import pytest

from kvmesh.detokenizer import IncrementalDetokenizer
from kvmesh.model.card import load_tokenizer

TEXT = ("Ünïcödé — 日本語のテキスト 🚀🎉 and plain words, café, naïve; 数学 ∑∫ √2 ≈ 1.414… "
        "Emoji families 👨‍👩‍👧‍👦 and flags 🇫🇷 end here.")


class Counting:
    """A tokenizer that counts the tokens it is asked to decode."""

    def __init__(self, tokenizer):
        self.tokenizer, self.num_decoded = tokenizer, 0

    def decode(self, token_ids):
        self.num_decoded += len(token_ids)
        return self.tokenizer.decode(token_ids)


@pytest.mark.parametrize("model", ["tiny-llama", "smollm2-135m"])
def test_the_settled_text_is_the_whole_decode_for_any_split(model):
    tokenizer = load_tokenizer(model).tokenizer
    rng = random.Random(7)
    tokens = tokenizer.encode(TEXT * 4)
    counting = Counting(tokenizer)
    detok, sent, seen = IncrementalDetokenizer(counting), [], []
    i = 0
    while i < len(tokens):
        step = rng.choice([1, 1, 1, 2, 3])
        seen += tokens[i:i + step]
        i += step
        sent.append(detok.update(seen, final=i >= len(tokens)))
        text = "".join(sent)
        assert tokenizer.decode(seen).startswith(text)  # settled text never changes later
        assert not text.endswith("\ufffd")  # no half character is sent (this text has none at its end)
        assert detok.num_chars == len(text)
    assert "".join(sent) == tokenizer.decode(tokens)
    assert counting.num_decoded <= 6 * len(tokens)  # a whole decode per event would be about n**2 / 4


def test_an_incomplete_character_waits_and_the_end_settles_it():
    tokenizer = load_tokenizer("tiny-llama").tokenizer  # bytes as tokens
    euro = list("€".encode())  # three bytes, three tokens
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.update([65]) == "A"
    assert detok.update([65, euro[0]]) == "" and detok.update([65, *euro[:2]]) == ""
    assert detok.update([65, *euro]) == "€"
    assert detok.update([65, *euro, euro[0]], final=True) == "\ufffd"  # cut off mid-character at the end
