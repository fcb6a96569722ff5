"""Pre-packed oneDNN linears: same results as ``F.linear``, dense weights still exported."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kvmesh.model.cpu_linear import PackedLinear, can_pack, pack_linears
from kvmesh.model.loader import load_model

CPU = torch.device("cpu")
# Packing itself needs oneDNN; whether it is on by default (not on AMX CPUs) is tested below, everywhere.
needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(dtype, bias, monkeypatch):
    monkeypatch.setenv("KVMESH_PACKED_LINEAR", "1")  # on AMX CPUs packing is off by default, not impossible
    if not can_pack(CPU, dtype):
        pytest.skip(f"oneDNN has no {dtype} kernels on this CPU")
    gen = torch.Generator().manual_seed(0)
    dense = nn.Linear(96, 200, bias=bias).to(dtype)
    packed = PackedLinear(dense)
    for rows in (1, 7, 16, 300):
        x = torch.randn(rows, 96, generator=gen).to(dtype)
        got, want = packed(x), F.linear(x, dense.weight, dense.bias)
        assert got.shape == want.shape and got.dtype == dtype
        if dtype == torch.bfloat16 and not bias:
            assert torch.equal(got, want)
        elif dtype == torch.bfloat16:  # the bias is added before rounding, not after: one bf16 ulp apart
            assert torch.allclose(got.float(), want.float(), rtol=8e-3, atol=1e-3)
        else:
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    x3 = torch.randn(2, 3, 96, generator=gen).to(dtype)
    assert packed(x3).shape == (2, 3, 200)
    assert torch.equal(packed.weight, dense.weight.detach())
    state = packed.state_dict()
    assert sorted(state) == (["bias", "weight"] if bias else ["weight"])
    assert torch.equal(state["weight"], dense.weight.detach())


@needs_onednn
def test_loaded_cpu_model_is_packed_and_exports_its_dense_weights(monkeypatch):
    monkeypatch.setenv("KVMESH_PACKED_LINEAR", "1")  # packed even on an AMX machine, where it is off by default
    packed = load_model("tiny-llama")
    monkeypatch.setenv("KVMESH_PACKED_LINEAR", "0")
    plain = load_model("tiny-llama")
    assert not can_pack(CPU, torch.float32)
    monkeypatch.delenv("KVMESH_PACKED_LINEAR")
    assert not any(isinstance(m, nn.Linear) for m in packed.model.modules())
    assert any(isinstance(m, nn.Linear) for m in plain.model.modules())
    assert not any(isinstance(m, PackedLinear) for m in plain.model.modules())
    ours, theirs = packed.model.hf_state_dict(), plain.model.hf_state_dict()
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name
    assert packed.fingerprint == plain.fingerprint  # packing is a layout, not different weights
    assert pack_linears(packed.model) == 0  # nothing left to pack
    assert not can_pack(torch.device("meta"), torch.float32)
    assert not can_pack(CPU, torch.float16)


def test_packing_is_off_by_default_where_the_cpu_has_amx(monkeypatch):
    """Measured: packed linears are slower than F.linear where oneDNN has AMX kernels (docs/benchmarks.md)."""
    from kvmesh.model import cpu_linear

    monkeypatch.delenv("KVMESH_PACKED_LINEAR", raising=False)
    monkeypatch.setattr(cpu_linear, "cpu_features", lambda: ["amx_bf16", "amx_tile", "avx512_bf16", "avx512f"])
    assert not can_pack(CPU, torch.float32) and not can_pack(CPU, torch.bfloat16)
    monkeypatch.setenv("KVMESH_PACKED_LINEAR", "1")
    assert can_pack(CPU, torch.float32)
    monkeypatch.delenv("KVMESH_PACKED_LINEAR")
    monkeypatch.setattr(cpu_linear, "cpu_features", lambda: ["avx2", "avx512_bf16", "avx512f"])
    assert can_pack(CPU, torch.float32)
