"""The connector seam (``kvmesh/engine/kv_connector.py``): a load writes a lease's block ids off the engine thread,
the engine learns of it between two steps; what arrived is used, what did not is computed, what a stalled writer
may still write is never read. Outputs against Hugging Face transformers on the same weights."""
from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

from kvmesh import LLM, SamplingParams
from kvmesh.engine.kv_connector import KVLease, KVLoads, LoadReport
from kvmesh.engine.request_state import RequestStatus
from tests.conftest import hf_reference

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPT = "You are a terse assistant. Answer in one word. " * 2 + "Sky colour?"  # 105 bytes: 6 full blocks


@pytest.fixture(scope="module")
def peer():
    """An engine that computed the prompt: its cached blocks are what a connector supplies."""
    llm = LLM("tiny-llama", num_kv_blocks=64, progress=False)
    llm.generate(PROMPT, SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    return llm


@pytest.fixture(scope="module")
def reference(peer):
    ids = peer.tokenizer.encode(PROMPT)
    with torch.inference_mode():
        out = hf_reference(peer.loaded).generate(torch.tensor([ids]), max_new_tokens=GREEDY.max_tokens,
                                                 do_sample=False, eos_token_id=None, pad_token_id=0,
                                                 attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    return out[0, len(ids):].tolist()


class Node:
    """A node's engine with a ``KVLoads``; ``call_soon`` queues what the engine thread runs between steps."""

    def __init__(self, num_kv_blocks: int = 64):
        self.llm = LLM("tiny-llama", num_kv_blocks=num_kv_blocks, progress=False)
        self.engine = self.llm.engine
        self.between_steps: list = []
        self.landed: list[tuple[str, LoadReport]] = []
        self.loads = KVLoads(self.engine, self.between_steps.append,
                             lambda seq, report: self.landed.append((seq.request_id, report)))

    def admit(self, request_id: str):
        seq = self.engine.prepare_request(self.llm.tokenizer.encode(PROMPT), GREEDY, request_id=request_id)
        return seq, self.loads.start(seq, (seq.num_prompt_tokens - 1) // 16)

    def run(self) -> None:
        """Steps until every request ends, running what loads handed over at each step boundary."""
        while self.between_steps or self.engine.has_unfinished():
            while self.between_steps:
                self.between_steps.pop(0)()
            if self.engine.scheduler.has_runnable():
                self.engine.step()
        self.engine.check_integrity()


def copy_from(peer: LLM, node: Node, lease: KVLease, end: int) -> LoadReport:
    """A connector's load: the peer's cached blocks [start, end) copied into the lease's block ids."""
    src = [peer.engine.pool.cached_block(h) for h in lease.block_hashes[lease.start:end]]
    assert None not in src
    node.engine.runner.kv_buffer[list(lease.block_ids[lease.start:end])] = peer.engine.runner.kv_buffer[src]
    return LoadReport(end)


def test_a_load_on_another_thread_lands_between_steps(peer, reference):
    node = Node()
    seq, lease = node.admit("r1")
    assert lease is not None and lease.start == 0 and lease.end == 6 and list(lease.block_ids) == seq.block_ids
    assert seq.status is RequestStatus.WAITING_FOR_REMOTE_KV and node.loads.loading("r1")
    with pytest.raises(dataclasses.FrozenInstanceError):
        lease.end = 7  # a load cannot widen what it may write
    worker = threading.Thread(target=node.loads.run, args=(lease, lambda: copy_from(peer, node, lease, 4)))
    worker.start()
    worker.join()
    assert seq.status is RequestStatus.WAITING_FOR_REMOTE_KV  # nothing changes until the engine thread runs it
    node.between_steps.pop(0)()
    assert seq in node.engine.scheduler.kv_landed and seq.num_computed_tokens == 4 * 16  # the rest computed here
    node.run()
    (rid, report), = node.landed
    assert rid == "r1" and report.got == 4 and report.load_s > 0 and not node.loads.loading("r1")
    assert seq.num_prefix_hit_tokens == 0 and seq.output_token_ids == reference
    # Blocks [0, 4) were used as landed, the rest computed here: a second request finds all six cached.
    assert len(node.engine.kv.find_cached_prefix(node.engine.prepare_request(seq.prompt_token_ids, GREEDY))) == 6


def test_a_tail_that_arrives_leaves_only_the_last_token_to_compute(reference):
    """A lease reaching the prompt's partial last block offers it too (``KVLease.tail``): a load that fills it
    (here from a peer that computed the prompt and still runs it) lands ``end + 1`` blocks, the engine computes
    the last token alone, and its KV, the tail's slots included, equals a full recompute's."""
    from kvmesh.engine.kv_probe import compare_with_engine, prompt_kv_sums

    peer = LLM("tiny-llama", num_kv_blocks=64, progress=False)
    running = peer.engine.prepare_request(peer.tokenizer.encode(PROMPT), GREEDY, request_id="peer")
    peer.engine.scheduler.add(running)
    while running.num_computed_tokens < running.num_prompt_tokens:
        peer.engine.step()
    node = Node()
    seq, lease = node.admit("r6")
    assert lease.tail and lease.end == 6 and (seq.num_prompt_tokens - 1) % 16 == 8  # 8 tokens before the last

    def with_tail() -> LoadReport:
        copy_from(peer, node, lease, 6)
        node.engine.runner.kv_buffer[lease.block_ids[6]] = peer.engine.runner.kv_buffer[running.block_ids[6]]
        return LoadReport(7)

    node.loads.run(lease, with_tail)
    node.between_steps.pop(0)()
    assert seq.num_computed_tokens == seq.num_prompt_tokens - 1
    node.run()
    assert seq.output_token_ids == reference
    full = seq.prompt_token_ids + seq.output_token_ids[:-1]  # 116 tokens: block 6 full, cached here
    got = prompt_kv_sums(node.engine, full)
    assert got["num_blocks"] == 7 and compare_with_engine(LLM("tiny-llama", num_kv_blocks=64, progress=False),
                                                         [(full, got)]) == (7, [])
    peer.engine.abort(running)
    peer.engine.check_integrity()
    short = Node()  # a lease that stops short of the last block offers no tail
    seq = short.engine.prepare_request(short.llm.tokenizer.encode(PROMPT), GREEDY, request_id="r7")
    assert not short.loads.start(seq, 5).tail


def test_a_first_token_with_the_tail_is_streamed_at_landing_for_greedy_requests_only(reference):
    """A tail that comes with the token a prefill node picked after the prompt (``LoadReport.first_token``): a
    greedy request lands every prompt token and has that token as its first output at once, before any step, then
    decodes on token-exact with its KV equal to a full recompute's; a request that token ends finishes at landing
    with its blocks freed; a sampled request ignores it and computes the last token itself. A greedy request's
    lease takes the last block even when it holds only the last token."""
    from kvmesh.engine.kv_probe import compare_with_engine, prompt_kv_sums

    peer = LLM("tiny-llama", num_kv_blocks=64, progress=False)
    running = peer.engine.prepare_request(peer.tokenizer.encode(PROMPT), GREEDY, request_id="peer")
    peer.engine.scheduler.add(running)
    while not running.output_token_ids:
        peer.engine.step()
    first = (running.output_token_ids[0], running.output_logprobs[0])
    assert first[0] == reference[0]

    def landing(node, lease, token=first):
        def load() -> LoadReport:
            copy_from(peer, node, lease, 6)
            node.engine.runner.kv_buffer[lease.block_ids[6]] = peer.engine.runner.kv_buffer[running.block_ids[6]]
            return LoadReport(7, first_token=token)
        return load

    node = Node()
    seq, lease = node.admit("g1")
    node.loads.run(lease, landing(node, lease))
    node.between_steps.pop(0)()
    assert seq.num_computed_tokens == seq.num_prompt_tokens and seq.output_token_ids == [reference[0]]
    assert seq.output_logprobs == [first[1]]
    node.run()
    assert seq.output_token_ids == reference
    full = seq.prompt_token_ids + seq.output_token_ids[:-1]
    got = prompt_kv_sums(node.engine, full)
    assert compare_with_engine(LLM("tiny-llama", num_kv_blocks=64, progress=False), [(full, got)]) == (7, [])
    node.engine.check_integrity()

    one = Node()  # the first token ends it: finished at landing, nothing left to run
    seq = one.engine.prepare_request(one.llm.tokenizer.encode(PROMPT), dataclasses.replace(GREEDY, max_tokens=1),
                                     request_id="g2")
    lease = one.loads.start(seq, 6)
    one.loads.run(lease, landing(one, lease))
    one.between_steps.pop(0)()
    assert seq.status is RequestStatus.FINISHED and seq.output_token_ids == [reference[0]]
    assert one.landed[0][0] == "g2" and not one.engine.has_unfinished()
    one.engine.check_integrity()
    assert one.engine.pool.usage().num_used == 0

    sampled = Node()  # not greedy: the token is not this request's draw; it computes the last token itself
    params = SamplingParams(max_tokens=4, temperature=0.8, seed=7, ignore_eos=True)
    seq = sampled.engine.prepare_request(sampled.llm.tokenizer.encode(PROMPT), params, request_id="s1")
    lease = sampled.loads.start(seq, 6)
    assert lease.tail
    sampled.loads.run(lease, landing(sampled, lease))
    sampled.between_steps.pop(0)()
    assert seq.num_computed_tokens == seq.num_prompt_tokens - 1 and not seq.output_token_ids
    sampled.run()
    alone = LLM("tiny-llama", num_kv_blocks=64, progress=False)
    assert seq.output_token_ids == alone.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids
    peer.engine.abort(running)
    peer.engine.check_integrity()

    # A prompt whose last token starts its block: a greedy lease still takes that block, a sampled one does not.
    short = Node()
    ids = short.llm.tokenizer.encode(PROMPT)[:97]  # 96 tokens before the last: six full blocks
    assert short.loads.start(short.engine.prepare_request(ids, GREEDY, request_id="g3"), 6).tail
    assert not short.loads.start(short.engine.prepare_request(ids, params, request_id="s3"), 6).tail


def test_a_load_that_raises_reports_nothing_and_the_request_is_computed(reference):
    node = Node()
    seq, lease = node.admit("r2")

    def broken() -> LoadReport:
        raise ConnectionError("the peer went away")

    account = LoadReport(lease.start)  # what the role's accounting reads after a failure (a decode node's outcome)
    node.loads.run(lease, broken, nothing=account)
    node.run()
    assert node.landed[0][1] is account and account.got == 0 and seq.output_token_ids == reference


def test_blocks_a_writer_may_still_write_are_swapped_before_anyone_reads_them(peer, reference):
    node = Node()
    seq, lease = node.admit("r3")
    late = list(lease.block_ids[2:4])
    node.engine.pool.touch(late)  # the grant table's own reference while its writer may still write

    def stalled() -> LoadReport:
        copy_from(peer, node, lease, 2)
        node.engine.runner.kv_buffer[late] = 7.0  # what a late writer leaves behind
        return LoadReport(2, tainted=late)

    node.loads.run(lease, stalled)
    node.between_steps.pop(0)()
    assert not set(late) & set(seq.block_ids) and node.loads.num_tainted_swapped == 2
    assert seq.num_computed_tokens == 2 * 16 and len(seq.block_ids) == 7
    node.run()
    assert seq.output_token_ids == reference
    assert [node.engine.pool.block_state(b).ref_count for b in late] == [1, 1]
    node.engine.pool.free(late)  # the writer stopped: the quarantine lifts
    node.engine.check_integrity()


def test_cancel_reaches_the_load_and_its_blocks_wait_for_its_report(peer):
    node = Node()
    seq, lease = node.admit("r4")
    assert not node.loads.cancel("nobody") and node.loads.cancel("r4") and lease.cancelled()
    assert node.loads.loading("r4")  # cancelled, not reported: its blocks stay the request's
    node.loads.run(lease, lambda: LoadReport(lease.start))
    node.between_steps.pop(0)()
    assert not node.loads.loading("r4") and seq in node.engine.scheduler.kv_landed
    node.engine.abort(seq)
    node.engine.check_integrity()
    assert node.engine.pool.usage().num_used == 0


def test_no_room_leases_nothing():
    node = Node(num_kv_blocks=8)
    busy = node.engine.pool.allocate(2)  # another request's: 6 free, the prompt needs 7
    seq, lease = node.admit("r5")
    assert lease is None and not seq.block_ids and node.loads.num_loading == 0
    assert node.engine.pool.usage().num_used == 2
    node.engine.pool.free(busy)
    node.engine.check_integrity()
