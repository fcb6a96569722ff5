"""Nodes change role at run time, under load, with real processes on both transfer backends: a decode node
becoming a prefill node hands its streams back to the router (which continues them elsewhere, token-exact),
a prefill node becomes a decode node at once, a change asked for while another drains is refused, and no
block leaks."""
from __future__ import annotations

import random
import signal
import threading
import time

import pytest

from kvmesh import LLM, SamplingParams
from kvmesh.engine.sampling_params import to_wire
from kvmesh.cluster.client import RequestFailed
from kvmesh.cluster.local_launcher import LocalCluster
from kvmesh.cluster.router import Router, RouterConfig
from kvmesh.node.messages import GenerateRequest
from kvmesh.node.roles import NodeRole, RoleChangeRefused, RoleState
from kvmesh.transfer.engine import mooncake_available

BACKENDS = ["zmq"] + (["mooncake"] if mooncake_available() else [])


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(length)]


@pytest.fixture(scope="module")
def reference():
    llm = LLM("tiny-llama", num_kv_blocks=1024, progress=False)
    return lambda prompts, sp: [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]


@pytest.fixture(scope="module", params=BACKENDS)
def served(request):
    """1 prefill + 2 decode nodes (decode nodes send every prompt to the prefill node; three streams a node at
    most) behind a router."""
    args = ["--transfer-backend", request.param, "--kv-placement", "threshold:0", "--prefill-timeout", "30",
            "--max-num-seqs", "3"]
    if request.param == "mooncake":
        args.append("--no-shared-memory-transfers")
    with LocalCluster(1, 2, node_args=args, cluster=f"roles{request.param}") as cluster:
        router = Router(RouterConfig(etcd=cluster.etcd_endpoint, cluster_token=cluster.token,
                                     cluster=f"roles{request.param}", request_timeout_s=30.0))
        try:
            yield cluster, router
        finally:
            router.close()


def wait_for(condition, what: str, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)
    return value


def stream_all(router: Router, prompts: list[list[int]], sp: SamplingParams) -> tuple[list, list[threading.Thread]]:
    """Each prompt streamed through the router on its own thread; results[i] is its tokens (or the error)."""
    results: list = [None] * len(prompts)

    def run(i: int) -> None:
        try:
            results[i] = [t for chunk in router.generate(prompts[i], sp) for t in chunk.token_ids]
        except Exception as e:  # noqa: BLE001 (the test reports it)
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    return results, threads


def settle(cluster: LocalCluster) -> None:
    """Every node idle, its integrity checks passing, nothing pinned or held."""
    for node_id in cluster.nodes:
        stats = wait_for(lambda: (s := cluster.client(node_id).stats(check=True))["num_used_blocks"] == 0 and s,
                         f"{node_id} to free its blocks")
        assert stats["num_pinned"] == 0


def roles(router: Router) -> dict[str, str]:
    return {node_id: record.role for node_id, record in router.directory.nodes.items()}


def test_the_role_state_machine_refuses_a_change_while_draining():
    role = NodeRole(RoleState.DECODE)
    assert role.request("decode", 5.0) is False and role.state is RoleState.DECODE  # no-op
    assert role.request("prefill", 5.0) is True and role.state is RoleState.DRAINING
    assert not role.takes_streams and not role.takes_prefills
    for other in ("decode", "prefill"):
        with pytest.raises(RoleChangeRefused):
            role.request(other, 5.0)
    role.transition(RoleState.PREFILL)
    assert role.takes_prefills and role.num_changes == 1
    with pytest.raises(RoleChangeRefused):
        role.transition(RoleState.DRAINING)  # only a decode node drains
    assert role.request("decode", 5.0) is True and role.takes_streams and role.num_changes == 2


def test_a_decode_node_becomes_a_prefill_node_and_its_streams_continue_elsewhere(served, reference):
    cluster, router = served
    prompts = [prompt(100 + i, 40 + 7 * i) for i in range(6)]
    sp = params(160)
    expected = reference(prompts, sp)
    results, threads = stream_all(router, prompts, sp)
    running = wait_for(lambda: max((cluster.client(n).stats()["num_running"], n) for n in ("decode-0", "decode-1"))
                       if any(cluster.client(n).stats()["num_running"] for n in ("decode-0", "decode-1")) else None,
                       "streams to run")
    busy = running[1]
    changes_before = cluster.client(busy).stats()["num_role_changes"]  # (other tests of the module move nodes)
    reply = cluster.client(busy).set_role("prefill", drain_timeout_s=0.0)  # its streams go back at once
    assert reply.state == "prefill"
    for t in threads:
        t.join(120)
    assert results == expected  # every stream completed, token-exact, wherever it finished
    stats = cluster.client(busy).stats()
    assert stats["role"] == "prefill" and stats["num_role_changes"] == changes_before + 1
    assert stats["num_streams_handed_back"] >= 1  # the streams it was running moved on
    wait_for(lambda: roles(router).get(busy) == "prefill", "the router to see the new role")
    # The cluster serves on: the other decode node, with two prefill nodes now.
    more = [prompt(200 + i, 50) for i in range(3)]
    assert [[t for c in router.generate(p, params(8)) for t in c.token_ids] for p in more] == reference(more, params(8))
    settle(cluster)
    cluster.client(busy).set_role("decode")  # back as it was for the next test
    wait_for(lambda: roles(router).get(busy) == "decode", "the router to see it decode again")


def test_a_draining_node_keeps_a_stream_whose_kv_is_on_its_way(served, reference):
    """A stream without a token yet whose prefill node is computing its KV is not handed back when its decode node
    starts draining: the KV lands there and the stream finishes there (handing it back would throw the prefill
    node's work away and start the request again elsewhere). The prefill node is stopped (SIGSTOP) until the change
    has arrived, so the KV is still on its way then."""
    cluster, router = served
    node, ids, sp = "decode-0", prompt(300, 70), params(8)  # (no other test's prompt shares its prefix)
    expected = reference([ids], sp)[0]
    before = cluster.client(node).stats()
    prefill, result = cluster.nodes["prefill-0"].proc, {}
    asking = threading.Thread(target=lambda: result.update(out=cluster.client(node).generate(ids, sp)))
    prefill.send_signal(signal.SIGSTOP)
    try:
        asking.start()
        wait_for(lambda: cluster.client(node).stats()["num_remote"] > before["num_remote"], "the fetch to start")
        assert cluster.client(node).set_role("prefill", drain_timeout_s=60.0).state == "draining"
    finally:
        prefill.send_signal(signal.SIGCONT)
    asking.join(60)
    out = result["out"]
    assert out.error == "" and out.token_ids == expected
    assert (out.stats.tokens_from_prefill_node, out.stats.tokens_computed) == (70, 0), out.stats  # its first token too
    stats = wait_for(lambda: (s := cluster.client(node).stats())["role"] == "prefill" and s, "the drain to end")
    assert stats["num_streams_handed_back"] == before["num_streams_handed_back"]
    settle(cluster)
    cluster.client(node).set_role("decode")  # back as it was for the next test
    wait_for(lambda: roles(router).get(node) == "decode", "the router to see it decode again")


def test_a_prefill_node_becomes_a_decode_node_and_a_change_while_draining_is_refused(served, reference):
    cluster, router = served
    changes_before = cluster.client("prefill-0").stats()["num_role_changes"]  # (other tests of the module move it)
    assert cluster.client("prefill-0").set_role("decode").state == "decode"  # at once
    wait_for(lambda: roles(router).get("prefill-0") == "decode", "the router to see prefill-0 decode")
    long_prompt, sp = prompt(350, 60), params(400)
    events = cluster.client("prefill-0").submit(GenerateRequest("long-1", long_prompt, to_wire(sp)))
    wait_for(lambda: cluster.client("prefill-0").stats()["num_running"], "the stream to run on prefill-0")
    assert cluster.client("prefill-0").set_role("prefill", drain_timeout_s=120.0).state == "draining"
    with pytest.raises(RequestFailed, match="already changing"):
        cluster.client("prefill-0").set_role("decode")  # never interleaved with the drain in progress
    tokens = []
    while True:
        event = events.get(timeout=120)
        tokens += event.token_ids
        if event.finished:
            break
    assert event.error == "" and tokens == reference([long_prompt], sp)[0]  # drained: it finished here
    wait_for(lambda: cluster.client("prefill-0").stats()["role"] == "prefill", "the drain to end")
    wait_for(lambda: roles(router).get("prefill-0") == "prefill", "the router to see prefill-0 prefill")
    assert cluster.client("prefill-0").stats()["num_role_changes"] == changes_before + 2
    settle(cluster)


def test_the_router_balancer_moves_a_prefill_node_to_decode_when_decode_slots_run_out(served, reference):
    """``--roles auto`` end to end: eight clients against two decode nodes of three slots each keep every slot
    taken (decode pressure 1.0) while nothing queues at the prefill node: the balancer moves it to decode, the
    streams complete exactly, the move is counted in /metrics. The SLOs are far off, so that the slots alone make
    the pressures whatever else runs on the machine: prompts waiting for a slot count as prompt work queued at a
    decode node, at its rate, and a slowed step against the TPOT SLO (under the suite's load a CI run saw no move
    in two minutes with the default SLOs)."""
    cluster, _ = served
    router = Router(RouterConfig(etcd=cluster.etcd_endpoint, cluster_token=cluster.token, cluster=cluster.cluster,
                                 request_timeout_s=30.0, roles="auto", role_interval_s=0.1, role_cooldown_s=0.0,
                                 ttft_slo_ms=600_000.0, tpot_slo_ms=60_000.0))
    try:
        prompts = [prompt(400 + i, 40 + 3 * i) for i in range(48)]
        sp = params(24)
        expected = reference(prompts, sp)
        results: list = [None] * len(prompts)
        moved = threading.Event()

        def client(first: int) -> None:  # each client streams its prompts one after another, until a move and
            for i in range(first, len(prompts), 8):  # a few more (the rest stay None: not sent)
                results[i] = [t for chunk in router.generate(prompts[i], sp) for t in chunk.token_ids]
                if moved.is_set() and i >= 16:
                    return

        threads = [threading.Thread(target=client, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        wait_for(lambda: sum(router.roles.moves.values()), "the balancer to move a node", timeout_s=120)
        moved.set()
        for t in threads:
            t.join(180)
        sent = [i for i, r in enumerate(results) if r is not None]
        assert len(sent) >= 16 and [results[i] for i in sent] == [expected[i] for i in sent]
        (_, node_id, to_role, reason), = router.roles.history
        assert (node_id, to_role) == ("prefill-0", "decode") and "decode pressure 1.00" in reason
        wait_for(lambda: roles(router).get("prefill-0") == "decode", "the moved node's record")
        assert 'kvmesh_role_changes{to="decode"} 1.0' in router.metrics.exposition().decode()
    finally:
        router.close()
    cluster.client("prefill-0").set_role("prefill")  # as it was
    settle(cluster)
