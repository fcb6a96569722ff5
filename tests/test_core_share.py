"""CoreShare / CoreTable: the nodes of one machine divide its cores among those with work."""
from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch

from kvmesh.node.core_share import MAX_NODES, CoreShare, CoreTable, machine_cores
from kvmesh.node.decode_threads import DecodeThreadChooser


@pytest.fixture
def table():
    t = CoreTable(num_cores=4)
    yield t
    t.close()


def share(table: CoreTable, node_id: str) -> CoreShare:
    return CoreShare.from_argument(table.node_argument(node_id))


def test_threads_follow_the_nodes_with_work(table):
    prefill, decode = share(table, "prefill-0"), share(table, "decode-0")
    assert decode.threads_now() == 4  # nobody busy: a node about to step would have them all
    decode.set_busy(True)
    assert decode.num_busy() == 1 and decode.threads_now() == 4
    prefill.set_busy(True)
    assert decode.threads_now() == prefill.threads_now() == 2
    third = share(table, "decode-1")
    third.set_busy(True)
    assert third.threads_now() == 1  # 4 // 3
    prefill.set_busy(False)
    third.set_busy(False)
    assert decode.threads_now() == 4
    assert decode.decode_candidates() == (3, 4)  # one core left to the serving machinery, or not
    prefill.set_busy(True)
    assert decode.decode_candidates() == (1, 2)  # 3 // 2, 4 // 2
    prefill.close()
    prefill.close()  # twice: nothing more
    assert decode.num_busy() == 1  # a closed node is unmarked
    for s in (decode, third):
        s.close()


def test_a_restarted_node_clears_what_its_predecessor_left_marked(table):
    dead = share(table, "decode-0")
    dead.set_busy(True)  # and never closed: the process died
    other = share(table, "prefill-0")
    assert other.num_busy() == 1
    restarted = share(table, "decode-0")  # the same slot for the same node id
    assert restarted.slot == dead.slot and other.num_busy() == 0


def test_slots_are_stable_and_run_out(table):
    ids = [f"n{i}" for i in range(MAX_NODES)]
    slots = [table.slot_of(n) for n in ids]
    assert slots == list(range(MAX_NODES)) and table.slot_of("n3") == 3
    assert table.slot_of("one-too-many") is None and table.node_argument("one-too-many") is None
    assert table.node_argument("n5") == f"{table.fd}:5:4"


@pytest.mark.parametrize("bad", ["", "1:2", "a:b:c", "3:0:0", f"3:{MAX_NODES}:2"])
def test_a_malformed_argument_is_refused(table, bad):
    value = bad.replace("3", str(table.fd), 1) if bad.startswith("3") else bad
    with pytest.raises(ValueError):
        CoreShare.from_argument(value)


def test_fit_threads_sets_the_calling_threads_torch_threads(table):
    decode, prefill = share(table, "decode-0"), share(table, "prefill-0")
    seen = {}

    def engine_thread():
        decode.set_busy(True)
        prefill.set_busy(True)
        seen["both"] = (decode.fit_threads(), torch.get_num_threads())
        prefill.set_busy(False)
        seen["alone"] = (decode.fit_threads(), torch.get_num_threads())

    main_threads = torch.get_num_threads()
    t = threading.Thread(target=engine_thread)
    t.start()
    t.join()
    assert seen == {"both": (2, 2), "alone": (4, 4)}
    assert torch.get_num_threads() == main_threads  # another thread's setting


def test_the_table_crosses_processes_through_the_inherited_descriptor(table):
    """A child marks its slot through the descriptor it inherited; the parent sees it, and nothing is on disk."""
    code = ("import sys; from kvmesh.node.core_share import CoreShare; s = CoreShare.from_argument(sys.argv[1]); "
            "s.set_busy(True); print(s.num_busy(), flush=True); sys.stdin.readline()")
    child = subprocess.Popen([sys.executable, "-c", code, table.node_argument("decode-0")], pass_fds=(table.fd,),
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "1"
        assert share(table, "prefill-0").num_busy() == 1
    finally:
        child.communicate("\n", timeout=60)
    assert os.readlink(f"/proc/self/fd/{table.fd}").endswith("(deleted)")


def test_machine_cores_is_this_process_affinity():
    assert machine_cores() == len(os.sched_getaffinity(0))


def probe(chooser: DecodeThreadChooser, fewer: int, more: int, seconds: dict[int, float]) -> list[int]:
    """Run decode-only steps that take ``seconds[threads]`` until a choice is made; the counts they ran on."""
    ran = []
    while not chooser.choices().get(f"{fewer}-{more}"):
        n = chooser.pick(fewer, more)
        ran.append(n)
        chooser.record(fewer, more, n, seconds[n])
        assert len(ran) < 100
    return ran


def test_the_chooser_alternates_then_keeps_the_faster_count_and_probes_again():
    chooser = DecodeThreadChooser(probe_steps=3, hold_steps=5)
    assert probe(chooser, 1, 2, {1: 0.090, 2: 0.070}) == [1, 2, 1, 2, 1, 2]  # in turn, fewer first
    assert chooser.choices() == {"1-2": 2} and chooser.num_probes == 1
    for _ in range(5):  # held
        assert chooser.pick(1, 2) == 2
        chooser.record(1, 2, 2, 0.070)
    assert chooser.pick(1, 2) == 1 and chooser.choices() == {}  # held long enough: a new probe
    assert probe(chooser, 1, 2, {1: 0.060, 2: 0.070}) == [1, 2, 1, 2, 1, 2]  # the machine changed
    assert chooser.choices() == {"1-2": 1} and chooser.num_probes == 2


def test_the_whole_share_must_win_by_the_margin_and_pairs_are_apart():
    chooser = DecodeThreadChooser(probe_steps=2, margin=0.05)
    probe(chooser, 3, 4, {3: 0.100, 4: 0.097})  # 3% faster: not worth a core taken from everything else
    assert chooser.choices() == {"3-4": 3}
    assert chooser.pick(1, 2) == 1  # another share: its own probe
    probe(chooser, 1, 2, {1: 0.100, 2: 0.080})
    assert chooser.choices() == {"3-4": 3, "1-2": 2}
    assert chooser.pick(1, 1) == 1 and chooser.pick(2, 2) == 2  # one candidate: nothing to choose
    chooser.record(5, 6, 5, 1.0)  # a pair never picked: ignored
    assert "5-6" not in chooser.choices()


def test_the_chooser_takes_the_median_so_one_stall_does_not_decide():
    chooser = DecodeThreadChooser(probe_steps=5)
    times = iter([0.09, 0.07, 0.09, 0.07, 0.09, 0.50, 0.09, 0.07, 0.09, 0.07])  # one stalled step on 2 threads
    while not chooser.choices():
        n = chooser.pick(1, 2)
        chooser.record(1, 2, n, next(times))
    assert chooser.choices() == {"1-2": 2}


@pytest.mark.parametrize("bad", [dict(probe_steps=0), dict(hold_steps=0), dict(margin=1.0), dict(margin=-0.1)])
def test_a_chooser_out_of_range_is_refused(bad):
    with pytest.raises(ValueError):
        DecodeThreadChooser(**bad)


class _Recorder(DecodeThreadChooser):
    def __init__(self):
        super().__init__(probe_steps=1)
        self.recorded = []

    def record(self, fewer, more, threads, seconds):
        self.recorded.append((fewer, more, threads, seconds))
        super().record(fewer, more, threads, seconds)


def test_decode_only_steps_are_sized_by_the_chooser_and_timed_for_it(table):
    recorder = _Recorder()
    decode = CoreShare(table.fd, table.slot_of("decode-0"), 4, chooser=recorder)
    seen = []

    def engine_thread():
        decode.set_busy(True)
        for computes_prompts, seconds in ((True, 0.5), (False, 0.09), (False, 0.07)):
            seen.append((decode.fit_threads(computes_prompts), torch.get_num_threads()))
            decode.end_step(seconds)
        decode.end_step(0.5)  # no step sized: nothing recorded

    t = threading.Thread(target=engine_thread)
    t.start()
    t.join()
    assert seen == [(4, 4), (3, 3), (4, 4)]  # a prompt step on the whole share; decode-only steps probe 3, then 4
    assert recorder.recorded == [(3, 4, 3, 0.09), (3, 4, 4, 0.07)]  # the prompt step is not a decode sample
    assert recorder.choices() == {"3-4": 4} and recorder.num_probes == 1
    decode.close()


def test_a_decode_step_another_node_shared_the_cores_of_is_no_sample(table):
    """A decode-only step during which another node started (or ended) work ran on cores it was not sized for:
    the chooser never sees it, so a probe cannot pick the slower count for the whole hold."""
    recorder = _Recorder()
    decode = CoreShare(table.fd, table.slot_of("decode-0"), 2, chooser=recorder)
    prefill = CoreShare(table.fd, table.slot_of("prefill-0"), 2)
    decode.set_busy(True)
    assert decode.fit_threads(False) == 1  # the probe's first count
    prefill.set_busy(True)  # mid-step
    decode.end_step(0.30)
    assert recorder.recorded == [] and decode.num_mixed_steps == 1
    assert decode.fit_threads(False) == 1  # (1, 1) now: one candidate, nothing to probe
    decode.end_step(0.12)
    prefill.set_busy(False)
    assert decode.fit_threads(False) == 1  # the probe of (1, 2) starts again where it was
    decode.end_step(0.09)
    assert recorder.recorded == [(1, 1, 1, 0.12), (1, 2, 1, 0.09)]  # steps the share held through: samples


def test_start_up_measurements_take_turns_and_hold_every_core(table):
    """``alone`` (a node's start-up probe): while one node of the table measures, another waits for its turn,
    and the measuring node is marked busy and computes on every core. Probes of nodes started together used to
    run at once and measured rates several times too slow."""
    code = ("import sys, torch; from kvmesh.node.core_share import CoreShare; s = CoreShare.from_argument(sys.argv[1])\n"
            "with s.alone():\n"
            "    print(s.num_busy(), torch.get_num_threads(), flush=True); sys.stdin.readline()\n"
            "print('out', flush=True); sys.stdin.readline()")
    child = subprocess.Popen([sys.executable, "-c", code, table.node_argument("prefill-0")], pass_fds=(table.fd,),
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    entered, seen = threading.Event(), {}

    def measure() -> None:
        mine = share(table, "decode-0")
        with mine.alone():
            seen["busy"], seen["threads"] = mine.num_busy(), torch.get_num_threads()
            entered.set()
        seen["after"] = mine.num_busy()

    try:
        assert child.stdout.readline().split() == ["1", "4"]  # the child measures: busy, on all 4 cores
        waiter = threading.Thread(target=measure, daemon=True)
        waiter.start()
        assert not entered.wait(0.5), "a second node measured while the first still did"
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.stdout.readline().split() == ["out"]
        assert entered.wait(60), "the second node never got its turn"
        waiter.join(60)
        assert seen == {"busy": 1, "threads": 4, "after": 0}
    finally:
        child.communicate("\n", timeout=60)
