"""Where nodes compute (--device) and what their transfer engine registers (--kv-transfer-memory).

The CUDA branches are driven with torch's CUDA queries replaced: what is checked is the decision
(and its message), not a GPU. tests/gpu runs the same paths on a real device.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kvmesh.device import DeviceError, device_for_ray_actor, resolve_device
from kvmesh.transfer.kv_memory import KVMemory, MemoryChoice, choose_mode, gpudirect_available


@pytest.fixture
def cuda_devices(monkeypatch):
    """Pretend torch sees ``n`` CUDA devices (0: none)."""
    def set_count(n: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    return set_count


def test_resolve_device(cuda_devices):
    cuda_devices(0)
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(DeviceError, match="use --device cpu or auto"):
        resolve_device("cuda")
    cuda_devices(2)
    assert resolve_device("auto") == torch.device("cuda", 0)
    assert resolve_device("CUDA:1") == torch.device("cuda", 1)
    with pytest.raises(DeviceError, match=r"only 2 CUDA device\(s\) are visible"):
        resolve_device("cuda:2")
    for bad in ("gpu", "cpu:1", "cuda:x", "auto:0", ""):
        with pytest.raises(DeviceError, match="expected auto, cpu, cuda or cuda:N"):
            resolve_device(bad)


def test_ray_actors_follow_the_gpus_ray_assigned():
    assert device_for_ray_actor("auto", [3]) == "cuda:0"  # CUDA_VISIBLE_DEVICES=3 in that actor
    assert device_for_ray_actor("auto", []) == "cpu"
    assert device_for_ray_actor("cpu", [0]) == "cpu"
    assert device_for_ray_actor("cuda:1", []) == "cuda:1"


def test_kv_transfer_memory_choice():
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert choose_mode("auto", cpu, "zmq", "zmq-tcp", False) == MemoryChoice("direct", "the KV buffer is host memory")
    assert choose_mode("host-staging", cpu, "mooncake", "tcp", False).mode == "host-staging"
    assert choose_mode("direct", cpu, "zmq", "zmq-tcp", False).mode == "direct"
    for engine, transport, peermem, why in [("zmq", "zmq-tcp", True, "host memory only"),
                                            ("mooncake", "tcp", True, "not GPUDirect"),
                                            ("mooncake", "rdma", False, "no nvidia_peermem")]:
        choice = choose_mode("auto", gpu, engine, transport, peermem)
        assert choice.mode == "host-staging" and why in choice.reason
        with pytest.raises(ValueError, match=why):
            choose_mode("direct", gpu, engine, transport, peermem)
    assert choose_mode("auto", gpu, "mooncake", "rdma", True).mode == "direct"
    assert choose_mode("host-staging", gpu, "mooncake", "rdma", True).mode == "host-staging"
    with pytest.raises(ValueError, match="expected auto, direct, host-staging"):
        choose_mode("pinned", cpu, "zmq", "zmq-tcp", False)


def test_gpudirect_needs_a_peer_memory_module(tmp_path):
    assert not gpudirect_available([tmp_path / "nvidia_peermem"])
    (tmp_path / "nvidia_peermem").mkdir()
    assert gpudirect_available([tmp_path / "nv_peer_mem", tmp_path / "nvidia_peermem"])


def test_staging_copies_only_the_named_blocks():
    kv = torch.randn(10, 2, 4)
    memory = KVMemory(kv, MemoryChoice("host-staging", "test"))
    assert memory.staged and memory.host_visible and memory.registered.shape == kv.shape
    memory.registered.zero_()
    memory.stage_out([7, 2, 3, 4])
    assert torch.equal(memory.registered[[2, 3, 4, 7]], kv[[2, 3, 4, 7]])
    assert not memory.registered[[0, 1, 5, 6, 8, 9]].any()
    memory.registered[5] = 1.0
    before = kv.clone()
    memory.stage_in([5])
    assert torch.equal(kv[5], torch.ones(2, 4)) and torch.equal(kv[:5], before[:5])
    assert memory.describe()["blocks_staged_out"] == 4 and memory.describe()["blocks_staged_in"] == 1
    direct = KVMemory(kv, MemoryChoice("direct", "test"))
    assert direct.registered is kv and not direct.staged
    direct.stage_out([1]), direct.stage_in([1])
    assert direct.num_blocks_staged_out == direct.num_blocks_staged_in == 0


def test_a_node_on_an_absent_device_exits_with_the_reason():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # no device visible, GPU machine or not
    proc = subprocess.run([sys.executable, "-m", "kvmesh.cli", "decode-node", "--node-id", "d", "--etcd",
                           "127.0.0.1:1", "--device", "cuda:0"], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1].startswith("d: --device cuda:0: ")
    assert "use --device cpu or auto" in proc.stderr
