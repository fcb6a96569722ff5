"""CoreShare / CoreTable: the nodes of one machine divide its cores among those with work."""
from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch

from kvmesh.node.core_share import MAX_NODES, CoreShare, CoreTable, machine_cores


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
    assert decode.threads_now(computes_prompts=False) == 3  # one core left to the serving machinery
    prefill.set_busy(True)
    assert decode.threads_now(computes_prompts=False) == 1  # 3 // 2
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
