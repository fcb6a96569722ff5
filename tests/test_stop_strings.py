"""The engine's stop strings (``kvmesh/engine/stop_strings.py``) against the whole decode searched after every token:
the same cut, at the same token or once the character after it completes, for stop strings that span tokens and
multi-byte characters, with each token decoded a bounded number of times (the whole output decoded per token was
quadratic in its length)."""
from __future__ import annotations

import random

import pytest

from kvmesh.engine.sampling_params import first_stop
from kvmesh.engine.stop_strings import StopStrings
from kvmesh.model.card import load_tokenizer
from tests.test_detokenizer import TEXT, Counting


def whole_decode_cut(tokenizer, token_ids: list[int], stop: tuple[str, ...]) -> tuple[int, str] | None:
    """The reference: after each token, the whole output decoded and searched."""
    for n in range(1, len(token_ids) + 1):
        text = tokenizer.decode(token_ids[:n])
        cut = first_stop(text, stop)
        if cut >= 0:
            return n, text[:cut]
    return None


def stop_strings_cut(tokenizer, token_ids: list[int], stop: tuple[str, ...]) -> tuple[int, str] | None:
    watch = StopStrings(tokenizer, stop)
    for n in range(1, len(token_ids) + 1):
        text = watch.text_before_stop(token_ids[:n])
        if text is not None:
            return n, text
    return None


@pytest.mark.parametrize("model", ["tiny-llama", "smollm2-135m"])
def test_the_same_cut_at_the_same_token_as_the_whole_decode(model):
    tokenizer = load_tokenizer(model).tokenizer
    rng = random.Random(11)
    tokens = tokenizer.encode(TEXT * 2)
    text = tokenizer.decode(tokens)
    num_found = 0
    for _ in range(40):
        start = rng.randrange(len(text) - 12)
        stop = tuple(text[s:s + rng.randint(1, 6)] for s in (start, rng.randrange(len(text) - 6)))
        if any("\ufffd" in s or not s for s in stop):
            continue
        got, want = stop_strings_cut(tokenizer, tokens, stop), whole_decode_cut(tokenizer, tokens, stop)
        assert (got is None) == (want is None), stop
        if got is not None:  # text settles in whole characters: a stop string is seen when the next one completes
            assert got[1] == want[1] and want[0] <= got[0] <= want[0] + 3, (stop, got, want)
            num_found += 1
    assert num_found >= 30
    assert stop_strings_cut(tokenizer, tokens, ("never in it",)) is None


def test_each_token_is_decoded_a_bounded_number_of_times():
    tokenizer = load_tokenizer("tiny-llama").tokenizer
    tokens = tokenizer.encode(TEXT * 8)
    counting = Counting(tokenizer)
    assert stop_strings_cut(counting, tokens, ("never in it", "nor this")) is None
    assert counting.num_decoded <= 6 * len(tokens)  # the whole decode per token: len(tokens) ** 2 / 2
