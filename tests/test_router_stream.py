"""The router's stream assembly without a cluster: node events in, client chunks out (text from the incremental
detokenizer, errors classified by the kind the node gives, never by their wording)."""
from __future__ import annotations

import queue

import pytest

from kvmesh.cluster.detokenizer import IncrementalDetokenizer
from kvmesh.cluster.router import Router, RouterConfig, _StreamState
from kvmesh.errors import InvalidRequestError, KvmeshError
from kvmesh.model.card import load_tokenizer
from kvmesh.node import messages as nm


def stream(events: list[nm.TokenEvent], stop: tuple[str, ...] = ()):
    router = Router.__new__(Router)  # only what _stream reads: its config and tokenizer
    router.cfg = RouterConfig(etcd="", cluster_token="x", request_timeout_s=5.0)
    router.tokenizer = load_tokenizer("tiny-llama").tokenizer
    q = queue.Queue()
    for event in events:
        q.put(event)
    state = _StreamState(3, IncrementalDetokenizer(router.tokenizer))
    return list(router._stream(q, "decode-0", state, stop)), state


def test_chunks_carry_the_text_of_their_tokens_and_the_end():
    text = "héllo wörld"
    ids = list(text.encode())
    events = [nm.TokenEvent("r", [t]) for t in ids] + [nm.TokenEvent("r", [], finished=True, finish_reason="length")]
    chunks, state = stream(events)
    assert "".join(c.text for c in chunks) == text == state.text
    assert chunks[-1].finished and chunks[-1].finish_reason == "length"
    assert all("\ufffd" not in c.text for c in chunks)  # a two-byte letter is sent whole, with its second byte
    cut, _ = stream(events, stop=("wö",))
    assert "".join(c.text for c in cut) == "héllo " and cut[-1].finish_reason == "stop"


@pytest.mark.parametrize("kind, error_type", [(nm.ERROR_INVALID, InvalidRequestError), (nm.ERROR_INTERNAL, KvmeshError)])
def test_node_errors_are_classified_by_their_kind_not_their_wording(kind, error_type):
    wording = "token ids [999] are outside the vocabulary" if kind == nm.ERROR_INTERNAL else "some refusal"
    with pytest.raises(KvmeshError, match="decode node decode-0") as raised:
        stream([nm.TokenEvent("r", [], finished=True, error=wording, error_kind=kind)])
    assert type(raised.value) is error_type


def test_an_error_without_its_kind_is_a_malformed_event():
    with pytest.raises(nm.MessageError):
        nm.TokenEvent("r", [], finished=True, error="boom").validate()
