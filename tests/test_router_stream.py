"""The router's stream assembly without a cluster: node events in, client chunks out (text from the incremental
detokenizer, errors classified by the kind the node gives, never by their wording)."""
from __future__ import annotations

import queue

import pytest

from kvmesh.detokenizer import IncrementalDetokenizer
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
    assert "".join(c.text for c in chunks) == text and state.held == ""
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


def test_closing_a_stream_while_a_thread_reads_it_waits_for_the_read():
    """A client that leaves while a chunk is being read: the close waits for that read (a generator cannot be
    closed while another thread runs it: "generator already executing"), then the request's cleanup runs."""
    import threading

    from kvmesh.cluster.http_server import _Stream

    inside, release, cleaned = threading.Event(), threading.Event(), threading.Event()

    def generator():
        try:
            inside.set()
            release.wait(30)
            yield "chunk"
            yield "never read"
        finally:
            cleaned.set()

    stream = _Stream(generator())
    reader = threading.Thread(target=stream.next)
    reader.start()
    assert inside.wait(30)
    closer = threading.Thread(target=stream.close)
    closer.start()
    closer.join(0.2)
    assert closer.is_alive() and not cleaned.is_set()  # waiting for the read in flight, not raising
    release.set()
    reader.join(30)
    closer.join(30)
    assert cleaned.is_set() and not closer.is_alive()


def test_text_that_might_begin_a_stop_string_is_held_until_ruled_out():
    text = "a </b c </an> d </a> never"
    events = [nm.TokenEvent("r", [t]) for t in text.encode()]
    events.append(nm.TokenEvent("r", [], finished=True, finish_reason="length"))
    chunks, state = stream(events, stop=("</a>", "</ab>"))
    sent = ""
    for chunk in chunks:
        sent += chunk.text
        assert not any(s in sent for s in ("</a>", "</ab>"))  # no stop string is ever sent whole
    assert sent == "a </b c </an> d " and chunks[-1].finish_reason == "stop"


def test_the_router_stream_bench_measures_each_length(tmp_path):
    import json

    from kvmesh.bench import router_stream

    result = router_stream.run("tiny-llama", [64, 256], 1, str(tmp_path / "stream.json"))
    assert [row["output_tokens"] for row in result["rows"]] == [64, 256]
    assert all(row["cpu_us_per_token"] > 0 for row in result["rows"])
    assert json.loads((tmp_path / "stream.json").read_text())["rows"] == result["rows"]
