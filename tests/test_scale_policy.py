"""The scale policy on synthetic load traces: when the cluster grows by a node, of which role, when it shrinks and
by which node, its bounds (max nodes, minimums, changes under way, cooldown) and a no-flapping property."""
from __future__ import annotations

import random
from types import SimpleNamespace

from kvmesh.cluster.role_balancer import NodeLoad
from kvmesh.cluster.scale_policy import ScaleConfig, ScalePolicy
from kvmesh.node.messages import NodeLoadStats

CONFIG = ScaleConfig(max_nodes=4, high=0.8, low=0.5, idle=0.2, sustain=3, sustain_down=10, cooldown_s=30.0,
                     min_prefill=0, min_decode=1)


def nodes(*roles: str, running: tuple[int, ...] = (), queue_s: float = 0.0) -> list[NodeLoad]:
    running = running or (0,) * len(roles)
    return [NodeLoad(f"{role}-{i}", role, num_running=r, queue_s=queue_s if role == "prefill" else 0.0)
            for i, (role, r) in enumerate(zip(roles, running))]


def run(policy: ScalePolicy, trace, tick_s: float = 2.0, start: float = 0.0):
    """trace: (loads, prefill pressure, decode pressure) per tick; the actions taken, with their times."""
    actions = []
    for k, (loads, prefill, decode) in enumerate(trace):
        now = start + k * tick_s
        action = policy.observe(loads, prefill, decode, now)
        if action is not None:
            policy.acted(action, now)
            actions.append((now, action))
    return actions


def test_a_role_short_of_capacity_that_no_move_can_help_gets_a_node_after_sustain_ticks():
    policy = ScalePolicy(CONFIG)
    both_busy = (nodes("prefill", "decode"), 0.6, 1.2)  # decode short; the prefill node is needed (0.6 > low)
    assert [policy.observe(*both_busy, now=t) for t in (0.0, 2.0)] == [None, None]
    action = policy.observe(*both_busy, now=4.0)
    assert (action.kind, action.role) == ("add", "decode") and "decode pressure 1.20" in action.reason
    # Nothing to give: a decode-only cluster (no prefill node at all) short of decode capacity.
    assert [(a.kind, a.role) for _, a in run(ScalePolicy(CONFIG), [(nodes("decode"), 0.0, 1.0)] * 3)] == \
        [("add", "decode")]
    # Both short: the role further over its SLO.
    assert [a.role for _, a in run(ScalePolicy(CONFIG), [(nodes("prefill", "decode"), 1.5, 0.9)] * 3)] == \
        ["prefill"]


def test_what_a_move_can_fix_is_left_to_the_role_balancer():
    """Prefill short while decode is quiet and has a node to spare: a move, not a new node."""
    assert run(ScalePolicy(CONFIG), [(nodes("prefill", "decode", "decode"), 1.5, 0.3)] * 20) == []
    # ... unless decode is at its minimum: then the only way is a new node.
    assert [a.role for _, a in run(ScalePolicy(CONFIG), [(nodes("prefill", "decode"), 1.5, 0.3)] * 3)] == \
        ["prefill"]


def test_an_idle_cluster_shrinks_to_its_minimums_prefill_nodes_first():
    idle = [(nodes("prefill", "decode", "decode", running=(0, 2, 0)), 0.0, 0.1)] * 10
    action = run(ScalePolicy(CONFIG), idle)[0][1]
    assert (action.kind, action.role, action.node_id) == ("remove", "prefill", "prefill-0")
    busy_queue = [(nodes("prefill", "decode", "decode", running=(0, 2, 0), queue_s=0.1), 0.05, 0.1)] * 10
    action = run(ScalePolicy(CONFIG), busy_queue)[0][1]  # a prefill node still holding prompts stays
    assert (action.kind, action.role, action.node_id) == ("remove", "decode", "decode-2")  # the fewest streams
    assert run(ScalePolicy(CONFIG), [(nodes("decode"), 0.0, 0.0)] * 30) == []  # min_decode 1
    assert run(ScalePolicy(CONFIG), [(nodes("prefill", "decode"), 0.0, 0.1)] * 9) == []  # sustain_down: 10 ticks


def test_bounds_max_nodes_changes_under_way_and_off():
    full = [(nodes("prefill", "decode", "decode", "decode"), 0.6, 1.5)] * 20
    assert run(ScalePolicy(CONFIG), full) == []  # max_nodes 4
    three = nodes("prefill", "decode", "decode")  # and a fourth registered whose stats did not come: it counts
    counted = ScalePolicy(CONFIG)
    assert [counted.observe(three, 0.6, 1.5, float(t), num_nodes=4) for t in range(5)] == [None] * 5
    assert run(ScalePolicy(CONFIG), [(three, 0.6, 1.5)] * 3)[0][1].kind == "add"  # (three alone: room for one)
    policy = ScalePolicy(CONFIG)
    for t in range(10):  # an added node still starting: nothing more until it registers
        assert policy.observe(nodes("decode"), 0.0, 1.0, float(t), num_pending=1) is None
    draining = nodes("prefill", "decode") + [NodeLoad("decode-9", "draining")]
    assert run(ScalePolicy(CONFIG), [(draining, 0.6, 1.5)] * 20) == []
    off = ScalePolicy(ScaleConfig(max_nodes=0))
    assert run(off, [(nodes("decode"), 0.0, 2.0)] * 20) == []
    assert run(off, [(nodes("decode", "decode"), 0.0, 0.0)] * 30) == []


def test_no_flapping_on_random_traces():
    """Whatever the load does, actions are at least a cooldown apart, and the node count stays within its bounds."""
    rng = random.Random(7)
    for _ in range(200):
        policy = ScalePolicy(CONFIG)
        roles = ["prefill", "decode"]
        last = None
        for k in range(120):
            now = k * 2.0
            loads = nodes(*roles, running=tuple(rng.randint(0, 4) for _ in roles))
            action = policy.observe(loads, rng.choice([0.0, 0.1, 0.6, 1.2]), rng.choice([0.0, 0.1, 0.6, 1.2]), now)
            if action is None:
                continue
            assert last is None or now - last >= CONFIG.cooldown_s
            last = now
            policy.acted(action, now)
            if action.kind == "add":
                roles.append(action.role)
            else:
                roles.remove(action.role)
            assert roles.count("decode") >= CONFIG.min_decode and len(roles) <= CONFIG.max_nodes


def test_the_controller_adds_then_drains_a_decode_node_before_removing_it():
    """The router's side (``RoleController`` with a supply): a node is asked for when the only decode node is full;
    when idle, a decode node is first moved to prefill (its streams handed back) and removed only once its record
    says prefill; nothing else happens while that drain is under way."""
    from kvmesh.cluster.role_balancer import BalancerConfig, RoleBalancer
    from kvmesh.cluster.role_controller import RoleController

    calls: list[tuple] = []

    class Supply:  # the calls a RayCluster would take, recorded
        def add_node(self, role):
            calls.append(("add", role))
            return f"{role}-1"

        def remove_node(self, node_id):
            calls.append(("remove", node_id))

        def num_starting(self, registered):
            return 0 if "decode-1" in registered or ("add", "decode") not in calls else 1

    def entry(node_id, role, running):
        return {"node_id": node_id, "role": role, "load": NodeLoadStats(num_running=running, max_num_seqs=2)}

    entries = [entry("decode-0", "decode", 2)]
    controller = RoleController(
        RoleBalancer(BalancerConfig(cooldown_s=0.0)), lambda: entries,
        lambda *a: calls.append(("set_role", *a[:2])) or SimpleNamespace(error=""),  # the node took it
        scaler=ScalePolicy(ScaleConfig(max_nodes=2, sustain=2, sustain_down=2, cooldown_s=0.0)), supply=Supply())
    for t in range(4):
        controller.tick(float(t))
    assert calls == [("add", "decode")] and controller.scaled == {"add": 1}
    entries[:] = [entry("decode-0", "decode", 0), entry("decode-1", "decode", 0)]  # registered; idle now
    for t in range(4, 8):
        controller.tick(float(t))
    assert calls[1:] == [("set_role", "decode-0", "prefill")]  # drained first, not removed yet
    entries[0] = entry("decode-0", "draining", 0)
    for t in range(8, 12):
        controller.tick(float(t))
    assert calls[2:] == []  # still draining: nothing removed, nothing else started
    entries[0] = entry("decode-0", "prefill", 0)
    for t in range(12, 16):  # the directory still lists it for a while: not removed twice, nothing else done
        controller.tick(float(t))
    assert calls[2:] == [("remove", "decode-0")] and controller.scaled == {"add": 1, "remove": 1}
    del entries[0]


def test_launch_refuses_max_nodes_without_auto_roles_before_joining_ray(capsys):
    from kvmesh.cli import main

    assert main(["launch", "--address", "127.0.0.1:1", "--max-nodes", "3"]) == 2
    assert "--max-nodes 3 needs --roles auto" in capsys.readouterr().err
    assert main(["launch", "--address", "127.0.0.1:1", "--roles", "auto", "--prefill", "2", "--decode", "2",
                 "--max-nodes", "3"]) == 2
    assert "at least the nodes launched (4)" in capsys.readouterr().err
